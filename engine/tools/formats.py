"""Tool-call formats, the tools a request offers, and the calls a model makes.

A :class:`ToolFormat` is how one model family writes its calls. Every format writes a call
as one JSON object, ``{"name": <name>, "<arguments key>": <arguments>}``, and differs in what
surrounds the calls:

* ``hermes`` (Hermes 2 Pro, Qwen2.5): ``<tool_call>\\n{...}\\n</tool_call>``, one block a
  call, blocks joined by a newline; trigger ``<tool_call>``;
* ``generic`` (templates that know no tools): the same syntax;
* ``llama3_json`` (Llama 3.1 to 3.3): ``{"name": ..., "parameters": {...}}`` as the whole
  answer; trigger ``{"name": `` at the start of the output;
* ``mistral``: ``[TOOL_CALLS] [{...}, {...}]``; trigger ``[TOOL_CALLS]``.

The *trigger* is where free text ends and calls begin (``tool_choice`` ``"auto"``). Llama
3.x writes a call as its whole answer, so its trigger counts only at the start of the output
(vLLM's ``llama3_json`` parser and llama.cpp read it so too), and its templates show one call
a message, so the format allows one call.

The three formats of real templates (``native``) show the tools and the history through the
template's own ``tools`` variable and its ``tool_calls`` / ``tool`` messages
(:mod:`twostroke.engine.tools.template`); ``generic`` writes them into plain messages
(:func:`~twostroke.engine.tools.prompt.render_prompt`), with each result a ``tool`` message
wrapped in ``<tool_response>``: SmolLM2-135M answered from a result shown so, and echoed the
block back when it came as a ``user`` message.

The format is chosen once, from the chat template's text (:func:`choose_tool_format`), or by
name (:func:`tool_format`, ``twostroke serve --tool-format``).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

__all__ = [
    "FUNCTION_NAME",
    "FUNCTION_NAME_RULE",
    "GENERIC",
    "HERMES",
    "LLAMA3_JSON",
    "MAX_FUNCTION_NAME_LENGTH",
    "MISTRAL",
    "TOOL_FORMATS",
    "ChatTemplated",
    "ToolCall",
    "ToolFormat",
    "ToolSpec",
    "choose_tool_format",
    "tokenizer_tool_format",
    "tool_format",
]

#: The longest function name (OpenAI's limit).
MAX_FUNCTION_NAME_LENGTH = 64
#: A function's name, as OpenAI allows it: the grammar and the parser rely on it (no quote,
#: no backslash, nothing JSON escapes). The one definition: ``ToolSpec``, the server's checks
#: of the names a request gives, the parser's and the grammar's readers all use this pattern.
FUNCTION_NAME = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_FUNCTION_NAME_LENGTH}}}")
#: :data:`FUNCTION_NAME` in words, for the messages that refuse a name.
FUNCTION_NAME_RULE = f"1 to {MAX_FUNCTION_NAME_LENGTH} letters, digits, underscores or dashes"
_ALPHANUMERIC = re.compile(r"[A-Za-z0-9]+")


@attrs.frozen
class ToolFormat:
    """How a model family writes tool calls and reads tool results.

    The calls of one answer are written ``first``, then each call's JSON followed by
    ``close``, the calls joined by ``separator``, then ``end``.

    Attributes:
        name: The format's name (``--tool-format``).
        trigger: The text that starts the calls: the trigger of ``tool_choice`` ``"auto"``.
        first: The text before the first call (the trigger, or text that starts with it;
            empty where the trigger is the call's own beginning).
        close: The text after each call.
        separator: The text between two calls; ``None``: one call an answer.
        end: The text after the last call.
        arguments_key: The key that holds a call's arguments in its JSON.
        at_start: The trigger counts only at the start of the output.
        native: The chat template shows tools and history itself (its ``tools`` variable).
        result_role: The role a tool's result is given to the chat template: ``"tool"``, or
            ``"user"`` for a template that takes no other roles (consecutive results then
            share one user message).
        wrap_results: Whether a result is wrapped here in ``<tool_response>`` tags (a
            Hermes-style template wraps it itself).
        call_id_length: A call's id is this many letters and digits (Mistral's templates
            refuse any other); ``0``: ``call_`` and 24 hex digits, as OpenAI's look.
    """

    name: str
    trigger: str
    first: str
    close: str
    separator: str | None
    end: str = ""
    arguments_key: str = "arguments"
    at_start: bool = False
    native: bool = False
    result_role: Literal["tool", "user"] = "tool"
    wrap_results: bool = False
    call_id_length: int = 0

    def __attrs_post_init__(self) -> None:
        starts = self.call_json("f", {}).startswith(self.trigger)
        assert self.first.startswith(self.trigger) or (self.at_start and starts), self

    def call_json(self, name: str, arguments: Any) -> str:
        """One call's JSON, as the model writes it (and as the constraint spells it)."""
        body = {"name": name, self.arguments_key: arguments}
        return json.dumps(body, ensure_ascii=False)

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        """The calls ``(name, arguments)`` of one answer as the model writes them."""
        joiner = self.separator if self.separator is not None else ""
        written = joiner.join(self.call_json(name, args) + self.close for name, args in calls)
        return f"{self.first}{written}{self.end}"

    def call_text(self, name: str, arguments: Any) -> str:
        """One call as the model writes it (:meth:`calls_text` of one call)."""
        return self.calls_text([(name, arguments)])

    def new_call_id(self) -> str:
        """A fresh id for a call the model made."""
        if self.call_id_length:
            return uuid.uuid4().hex[: self.call_id_length]
        return f"call_{uuid.uuid4().hex[:24]}"

    def template_call_id(self, given: str) -> str:
        """``given`` as the template takes it: as it is, or (for a format whose templates
        take only ids of ``call_id_length`` letters and digits) a stable id made from it,
        so a call and the result that names it still agree."""
        if not self.call_id_length or (
            len(given) == self.call_id_length and _ALPHANUMERIC.fullmatch(given)
        ):
            return given
        return hashlib.sha256(given.encode()).hexdigest()[: self.call_id_length]

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"


#: Hermes 2 Pro, Qwen2.5 and the templates that write ``<tool_call>`` themselves.
HERMES = ToolFormat(
    "hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>", "\n<tool_call>\n", native=True
)
#: Any other template (SmolLM2's ChatML, the toy's): Hermes' call syntax, the tools and the
#: history written into plain messages, each result a ``tool`` message wrapped in
#: ``<tool_response>``.
GENERIC = ToolFormat(
    "generic", "<tool_call>", "<tool_call>\n", "\n</tool_call>", "\n<tool_call>\n",
    wrap_results=True,
)  # fmt: skip
#: Llama 3.1, 3.2 and 3.3 (JSON tool calling): the call is the whole answer, one call.
LLAMA3_JSON = ToolFormat(
    "llama3_json", '{"name": ', "", "", None, arguments_key="parameters", at_start=True,
    native=True,
)  # fmt: skip
#: Mistral's instruct models (v0.3 and later): ``[TOOL_CALLS] [...]``, ids of 9 characters.
MISTRAL = ToolFormat(
    "mistral", "[TOOL_CALLS]", "[TOOL_CALLS] [", "", ", ", "]", native=True, call_id_length=9
)
#: Every format by name.
TOOL_FORMATS: dict[str, ToolFormat] = {
    each.name: each for each in (HERMES, GENERIC, LLAMA3_JSON, MISTRAL)
}


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
    """The format a chat template implies, from what it writes for an assistant's calls.

    Mistral where it writes ``[TOOL_CALLS]``; Hermes where it writes ``<tool_call>``;
    Llama 3.x JSON where it is a Llama 3 template (``<|start_header_id|>``) that writes a
    call's ``"parameters"``; generic otherwise (a template without tools, or none at all).
    """
    if chat_template is None:
        return GENERIC
    if MISTRAL.trigger in chat_template:
        return MISTRAL
    if HERMES.trigger in chat_template:
        return HERMES
    if "<|start_header_id|>" in chat_template and '"parameters"' in chat_template:
        return LLAMA3_JSON
    return GENERIC


@runtime_checkable
class ChatTemplated(Protocol):
    """A tokenizer that has a chat template (a loaded model's does; the toy's has none)."""

    @property
    def chat_template(self) -> str | None:
        """The chat template (Jinja text), if there is one."""
        ...


def tokenizer_tool_format(tokenizer: object | None) -> ToolFormat:
    """The format ``tokenizer``'s chat template implies (:func:`choose_tool_format`).

    Args:
        tokenizer: An engine's tokenizer (``EngineSurface.tokenizer``), or ``None`` where
            there is none: a coordinator's front holds none (its replicas do), so it gets
            the generic format unless one is named (``twostroke serve --tool-format``).
    """
    template = tokenizer.chat_template if isinstance(tokenizer, ChatTemplated) else None
    return choose_tool_format(template if isinstance(template, str) else None)


def _function_name(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str, got {type(value).__name__}")
    if not FUNCTION_NAME.fullmatch(value):
        raise ValueError(
            f"a function's {attribute.name} must be {FUNCTION_NAME_RULE}, got {value[:80]!r}"
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
