"""The constraint of a request that offers tools: text or calls, in the format's syntax.

``tool_choice`` ``"auto"`` is a *lazy* constraint written as one llguidance (Lark) grammar::

    start: TEXT | TEXT_OPEN call (SEP OPEN call)*
    TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/          # any text without the trigger
    TEXT_OPEN: ... any such text, then the trigger and a newline
    call: (call_0 | call_1 | ...) CLOSE                # one %json rule per tool

Before the trigger the mask allows every token that keeps the text free of it (so the model
writes what it likes, and a trigger split across tokens is still seen: the lexer reads
bytes, not tokens); once the text contains the trigger, the rest must be a call of one of
the tools, ``{"name": <its name>, "arguments": <its schema>}``, closed by the closing tag,
then another call (unless calls may not be parallel) or the end. Malformed output after a
trigger cannot happen. The mask is computed on the bookkeeping stroke like any other
constraint's. With a constraint on the text branch (``response_format``), the branch is that
JSON instead of free text, and a call starts at the first byte. ``"required"`` and a named
function drop the text branch (and the named function drops the other tools).

A tool's parameters are rewritten as a JSON schema constraint's are where the rewrite keeps
the same valid instances (:func:`~twostroke.engine.structured.schemas.for_backend`:
``dependentRequired``, ``uniqueItems: false``, formats llguidance does not implement); a
keyword that a constraint leaves to a check of the complete output (``oneOf`` that the backend
cannot prove disjoint, ``uniqueItems: true``) has no such check inside a grammar, so the
backend refuses it there (over HTTP a 400 naming ``tools``, or the named function's
``parameters``).

JSON inside the grammar has the fixed format every constrained JSON output has
(:data:`~twostroke.engine.structured.grammars.JSON_FORMAT`'s: ``", "`` and ``": "``, no free
whitespace), so :class:`~twostroke.engine.tools.parser.ToolCallParser` reads the name and
the arguments' extent from the text alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

from twostroke.engine.structured.schemas import for_backend
from twostroke.engine.tools.formats import ToolFormat, ToolSpec
from twostroke.states.constraints import AnyJsonObject, Grammar, JsonSchema

__all__ = ["ToolChoice", "tool_constraint"]

#: Whether the model may answer in text (``"auto"``) or must call (``"required"``).
ToolChoice: TypeAlias = Literal["auto", "required"]

# The options every %json of the grammar compiles with (as JSON_FORMAT for a JSON schema).
_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
_NO_PARAMETERS: dict[str, Any] = {"type": "object"}


def _regex(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` regex (Rust's syntax)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$#&~/-])", r"\\\1", text).replace("\n", "\\n")


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(schema | {"x-guidance": _JSON_OPTIONS}, ensure_ascii=False)


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    parameters = JsonSchema(tool.parameters or _NO_PARAMETERS).parsed()
    backend = for_backend(parameters)
    if not backend.checked:  # rewritten with the same valid instances: the backend's form
        parameters = backend.schema
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_constraint(
    fmt: ToolFormat,
    tools: Sequence[ToolSpec],
    choice: ToolChoice = "auto",
    *,
    function: str | None = None,
    parallel: bool = True,
    text: JsonSchema | AnyJsonObject | None = None,
) -> Grammar:
    """The grammar a request's output must follow when it offers ``tools``.

    Args:
        fmt: The format the model writes calls in.
        tools: The tools offered (at least one).
        choice: ``"auto"``: text or calls; ``"required"``: one call or more.
        function: Only this tool may be called (``tool_choice`` naming it): implies
            ``"required"``.
        parallel: Several calls may follow each other (else exactly one).
        text: A constraint on the text branch of ``"auto"`` (``response_format``); ignored
            otherwise, since no text answer is possible.

    Returns:
        A :class:`~twostroke.states.constraints.Grammar`, compiled by the engine as any.

    Raises:
        ValueError: no tools, ``function`` names none of them, or a tool's parameters is not
            a JSON schema the engine takes (:class:`JsonSchema`'s message).
        TypeError: a parameters value of the wrong type.
    """
    if not tools:
        raise ValueError("tools must hold at least one tool, got none")
    chosen = list(tools)
    if function is not None:
        chosen = [tool for tool in tools if tool.name == function]
        if not chosen:
            names = ", ".join(tool.name for tool in tools)
            raise ValueError(f"function {function!r} is not one of the tools ({names})")
        choice = "required"
    rules = [f"call_{index}: {_json_rule(_call_schema(tool))}" for index, tool in enumerate(chosen)]
    calls = " | ".join(f"call_{index}" for index in range(len(chosen)))
    opening = json.dumps(fmt.open + "\n")
    more = " (SEP OPEN call)*" if parallel else ""
    lines = [
        f"call: ({calls}) CLOSE",
        f"OPEN: {opening}",
        f"CLOSE: {json.dumps(chr(10) + fmt.close)}",
        'SEP: "\\n"',
        *rules,
    ]
    if choice == "required":
        start = f"start: OPEN call{more}"
    elif text is not None:
        schema = _NO_PARAMETERS if isinstance(text, AnyJsonObject) else text.parsed()
        start = f"start: answer | OPEN call{more}"
        lines.append(f"answer: {_json_rule(schema)}")
    else:
        trigger = _regex(fmt.open)
        start = f"start: TEXT | TEXT_OPEN call{more}"
        lines += [
            f"TEXT: /(?s:.*)/ & ~/(?s:.*{trigger}.*)/",
            # The first trigger ends the text: text without it, the trigger, a newline.
            f"TEXT_OPEN: /(?s:.*){trigger}\\n/ & ~/(?s:.*{trigger}.*{trigger}.*)/",
        ]
    return Grammar("\n".join([start, *lines]))
