"""Tool calling: how a model is shown tools, how its calls are constrained and read back.

A model family writes its tool calls in a syntax of its own; a :class:`ToolFormat` is one
such syntax, chosen once from the chat template (:func:`choose_tool_format`) and passed down
as a value. With it:

* :func:`tool_prompt`: a conversation with tools, assistant calls and tool results through
  the chat template's own ``tools`` variable where it has one (:func:`native_template`),
  else as the plain ``{"role", "content"}`` messages every chat template (and the engine)
  takes (:func:`render_prompt`);
* :func:`tool_constraint`: the constraint a request carries so that its output is text or
  calls of the offered tools (``tool_choice`` ``"auto"``: a lazy grammar, free until the
  format's trigger), calls only (``"required"``, a named function), with an optional
  constraint on the text branch (``response_format``);
* :class:`ToolCallParser`: the output (whole, or delta by delta) as content and calls, so a
  streamed answer and a complete one are read by the same code and agree.

Nothing here knows HTTP: the chat completions endpoint and the Responses API both build on
it, and so can a program that drives an embedded engine (docs/structured-output.md shows an
agent loop).
"""

from twostroke.engine.tools.formats import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    TOOL_FORMATS,
    ToolCall,
    ToolFormat,
    ToolSpec,
    choose_tool_format,
    tokenizer_tool_format,
    tool_format,
)
from twostroke.engine.tools.grammar import ToolChoice, tool_constraint
from twostroke.engine.tools.parser import (
    ArgumentsDelta,
    CallStarted,
    ParsedOutput,
    TextDelta,
    ToolCallParser,
    ToolEvent,
    parse_output,
)
from twostroke.engine.tools.prompt import Turn, render_prompt
from twostroke.engine.tools.template import (
    ToolTemplate,
    native_template,
    template_messages,
    tool_prompt,
)

__all__ = [
    "GENERIC",
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "TOOL_FORMATS",
    "ArgumentsDelta",
    "CallStarted",
    "ParsedOutput",
    "TextDelta",
    "ToolCall",
    "ToolCallParser",
    "ToolChoice",
    "ToolEvent",
    "ToolFormat",
    "ToolSpec",
    "ToolTemplate",
    "Turn",
    "choose_tool_format",
    "native_template",
    "parse_output",
    "render_prompt",
    "template_messages",
    "tokenizer_tool_format",
    "tool_constraint",
    "tool_format",
    "tool_prompt",
]
