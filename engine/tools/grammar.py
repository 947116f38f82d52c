"""The constraint of a request that offers tools: text or calls, in the format's syntax.

``tool_choice`` ``"auto"`` is a *lazy* constraint written as one llguidance (Lark) grammar;
for the Hermes format::

    start: TEXT | TEXT_FIRST calls
    TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/          # any text without the trigger
    TEXT_FIRST: ... any such text, then what comes before the first call
    calls: call (SEP call)* END                        # each format's joints (formats.py)
    call: (call_0 | call_1 | ...) CLOSE
    call_0: "{\"name\": \"get_weather\", \"arguments\": " args_0 "}"
    args_0: %json {...the tool's parameters...}

Before the trigger the mask allows every token that keeps the text free of it (so the model
writes what it likes, and a trigger split across tokens is still seen: the lexer reads
bytes, not tokens); once the text contains the trigger, the rest must be calls of the tools
in the format's syntax, then the end. A format whose trigger counts only at the start of the
output (Llama 3's) has ``TEXT`` be any text that does not *start* with the trigger, and its
calls begin at the first byte. Malformed output after a trigger cannot happen. The mask is
computed on the bookkeeping stroke like any other constraint's. With a constraint on the
text branch (``response_format``), the branch is that JSON instead of free text, and calls
start at the first byte. ``"required"`` and a named function drop the text branch (and the
named function drops the other tools); a format with one call an answer, or
``parallel_tool_calls`` false, allows one call.

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


def _arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    parameters = JsonSchema(tool.parameters or _NO_PARAMETERS).parsed()
    backend = for_backend(parameters)
    if not backend.checked:  # rewritten with the same valid instances: the backend's form
        parameters = backend.schema
    return parameters


def _literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


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
        parallel: Several calls may follow each other (else exactly one; a format whose
            answers hold one call allows one whatever this says).
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
    lines = []
    for index, tool in enumerate(chosen):
        head = fmt.call_json(tool.name, 0)[: -len("0}")]  # {"name": "<name>", "<key>":
        lines += [
            f"call_{index}: {_literal(head)} args_{index} {_literal('}')}",
            f"args_{index}: {_json_rule(_arguments_schema(tool))}",
        ]
    calls = " | ".join(f"call_{index}" for index in range(len(chosen)))
    lines.append(f"call: ({calls})" + (f" {_literal(fmt.close)}" if fmt.close else ""))
    more = ""
    if parallel and fmt.separator is not None:
        more = f" ({_literal(fmt.separator)} call)*"
    end = f" {_literal(fmt.end)}" if fmt.end else ""
    lines.append(f"calls: call{more}{end}")
    first = f"{_literal(fmt.first)} " if fmt.first else ""
    if choice == "required":
        start = f"start: {first}calls"
    elif text is not None:
        schema = _NO_PARAMETERS if isinstance(text, AnyJsonObject) else text.parsed()
        start = f"start: answer | {first}calls"
        lines.append(f"answer: {_json_rule(schema)}")
    elif fmt.at_start:
        trigger = _regex(fmt.trigger)
        start = f"start: TEXT | {first}calls"
        lines.append(f"TEXT: /(?s:.*)/ & ~/(?s:{trigger}.*)/")  # not starting with it
    else:
        trigger = _regex(fmt.trigger)
        start = "start: TEXT | TEXT_FIRST calls"
        lines += [
            f"TEXT: /(?s:.*)/ & ~/(?s:.*{trigger}.*)/",
            # The first trigger ends the text: text without it, then what opens the calls.
            f"TEXT_FIRST: /(?s:.*){_regex(fmt.first)}/ & ~/(?s:.*{trigger}.*{trigger}.*)/",
        ]
    return Grammar("\n".join([start, *lines]))
