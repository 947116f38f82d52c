"""Tool-call formats, the tools a request offers, and the calls a model makes.

A :class:`ToolFormat` is how one model family writes a call: Hermes and Qwen2.5 (and the
generic format, for templates that know no tools) write
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, blocks
separated by a newline. The opening tag is the *trigger*: before it the model writes free
text, after it a call. The two formats differ in how a tool's result is shown to the model:
a ``tool`` message, which a Hermes-style template wraps in ``<tool_response>`` itself, or
(generic) a ``tool`` message wrapped here, for templates that print any role as given
(ChatML). SmolLM2-135M answered from a result shown as a ``tool`` message, and echoed the
block back when it was shown as a ``user`` message.

The format is chosen once, from the chat template's text (:func:`choose_tool_format`), or by
name (:func:`tool_format`, ``twostroke serve --tool-format``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import attrs

__all__ = [
    "GENERIC",
    "HERMES",
    "MAX_FUNCTION_NAME_LENGTH",
    "TOOL_FORMATS",
    "ToolCall",
    "ToolFormat",
    "ToolSpec",
    "choose_tool_format",
    "engine_tool_format",
    "tool_format",
]

#: The longest function name (OpenAI's limit).
MAX_FUNCTION_NAME_LENGTH = 64
#: A function's name, as OpenAI allows it: the grammar and the parser rely on it (no quote,
#: no backslash, nothing JSON escapes).
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@attrs.frozen
class ToolFormat:
    """How a model family writes tool calls and reads tool results.

    Attributes:
        name: The format's name (``--tool-format``).
        open: The tag that opens a call: the trigger of ``tool_choice`` ``"auto"``.
        close: The tag that closes a call.
        result_role: The role a tool's result is given to the chat template: ``"tool"``, or
            ``"user"`` for a template that takes no other roles (consecutive results then
            share one user message).
        wrap_results: Whether a result is wrapped here in ``<tool_response>`` tags (a
            Hermes-style template wraps it itself).
    """

    name: str
    open: str
    close: str
    result_role: Literal["tool", "user"]
    wrap_results: bool

    def call_text(self, name: str, arguments: Any) -> str:
        """One call as the model writes it (and as the constraint spells it)."""
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.open}\n{body}\n{self.close}"

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"


#: Hermes 2 Pro, Qwen2.5 and the templates that write ``<tool_call>`` themselves.
HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "tool", wrap_results=False)
#: Any other template (SmolLM2's ChatML, the toy's): the same call syntax, each result a
#: ``tool`` message wrapped in ``<tool_response>``.
GENERIC = ToolFormat("generic", "<tool_call>", "</tool_call>", "tool", wrap_results=True)
#: Every format by name.
TOOL_FORMATS: dict[str, ToolFormat] = {each.name: each for each in (HERMES, GENERIC)}


def tool_format(name: str) -> ToolFormat:
    """The format called ``name``.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: no format has that name (the message lists the formats).
    """
    if not isinstance(name, str):
        raise TypeError(f"tool_format must be a str, got {type(name).__name__}")
    found = TOOL_FORMATS.get(name)
    if found is None:
        raise ValueError(
            f"tool_format must be one of {', '.join(sorted(TOOL_FORMATS))}, got {name[:80]!r}"
        )
    return found


def choose_tool_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template implies: Hermes where it writes ``<tool_call>``, else
    generic (a template without one, or none at all)."""
    if chat_template is not None and HERMES.open in chat_template:
        return HERMES
    return GENERIC


def engine_tool_format(engine: object) -> ToolFormat:
    """The format an engine's chat template implies (:func:`choose_tool_format`).

    Reads the template of the engine's tokenizer where the engine holds one (an ``Engine``
    does); a coordinator's front holds none (its replicas do), so it gets the generic
    format unless one is named (``twostroke serve --tool-format``).
    """
    tokenizer = getattr(engine, "tokenizer", None)
    template = getattr(tokenizer, "chat_template", None)
    return choose_tool_format(template if isinstance(template, str) else None)


def _function_name(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str, got {type(value).__name__}")
    if not FUNCTION_NAME.fullmatch(value):
        raise ValueError(
            f"a function's {attribute.name} must be 1 to {MAX_FUNCTION_NAME_LENGTH} letters, "
            f"digits, underscores or dashes, got {value[:80]!r}"
        )


@attrs.frozen
class ToolSpec:
    """A function the model may call.

    Args:
        name: 1 to 64 letters, digits, underscores or dashes.
        description: What it does, shown to the model.
        parameters: The JSON schema of its arguments (``None``: any JSON object).

    Raises:
        TypeError, ValueError: a name that is not one, a description that is not a str or a
            parameters that is not a dict.
    """

    name: str = attrs.field(validator=_function_name)
    description: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    parameters: dict[str, Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(dict))
    )

    def shown(self) -> dict[str, Any]:
        """The tool as the model is shown it (OpenAI's function object)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object"}
        return {"type": "function", "function": function}


@attrs.frozen
class ToolCall:
    """A call the model made: its id, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """The call as OpenAI's ``message.tool_calls`` holds it."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
