"""Each kind of constraint as an llguidance grammar, and the backend's refusals as reasons.

A JSON schema (and "any JSON object", the schema ``{"type": "object"}``) goes through
llguidance's JSON-schema compiler with one fixed format, whatever the schema's own
``x-guidance`` says: no free whitespace, ``", "`` between items and ``": "`` after keys (the
format of Python's ``json.dumps``), and no leniency, so a keyword llguidance does not
implement is refused rather than ignored. Free whitespace would let a small model fill its
output with newlines; a fixed format costs nothing a parser notices. A regex is anchored at
both ends; a choice is a Lark alternation of string literals; a grammar is Lark, or GBNF
converted to Lark.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from twostroke.engine.structured.backend import llguidance
from twostroke.engine.structured.schemas import SchemaCheck, for_backend
from twostroke.engine.tools.formats import FUNCTION_NAME
from twostroke.states.constraints import (
    AnyJsonObject,
    Choice,
    Constraint,
    Grammar,
    JsonSchema,
    Regex,
)
from twostroke.states.errors import ConstraintRejected

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "JSON_FORMAT",
    "MAX_REASON_LENGTH",
    "field_of",
    "grammar_of",
    "json_grammar",
    "reason_of",
    "size_of",
]

#: The format every JSON output takes (llguidance's ``JsonCompileOptions``, as overrides).
JSON_FORMAT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
#: The longest reason a refusal carries (the backend's messages can quote a whole grammar).
MAX_REASON_LENGTH = 300


def field_of(constraint: Constraint) -> str:
    """The part of a request a refusal names (``"constraint.schema"``, ...)."""
    return f"constraint.{constraint.argument}"


def size_of(constraint: Constraint) -> int:
    """A constraint's size: the characters of its text (a choice's strings together).

    What compiling it costs grows with it, and what the compiled grammar holds: the
    compiler's queue and its cache are ordered and bounded by it.
    """
    value = constraint.value
    if value is None:  # any JSON object
        return 0
    if isinstance(value, str):
        return len(value)
    return sum(map(len, value))  # a choice's strings


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON text) that enforces ``constraint``.

    Nothing is checked here but GBNF syntax (its conversion to Lark): the backend validates
    the grammar when it is compiled.

    Raises:
        ConstraintRejected: a grammar that is neither Lark nor valid GBNF.
    """
    if isinstance(constraint, JsonSchema):
        return json_grammar(constraint)[0]
    if isinstance(constraint, AnyJsonObject):
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=JSON_FORMAT
        )
    if isinstance(constraint, Regex):
        return llguidance.LLMatcher.grammar_from_regex(constraint.pattern)
    if isinstance(constraint, Choice):
        # A Lark string literal reads JSON's escapes (llguidance's own "choice" format).
        literals = " | ".join(
            json.dumps(choice, ensure_ascii=False) for choice in constraint.choices
        )
        return llguidance.LLMatcher.grammar_from_lark(f"start: {literals}")
    assert isinstance(constraint, Grammar), constraint
    try:
        return llguidance.grammar_from("grammar", constraint.source)
    except ValueError as exc:  # GBNF that does not convert; the message says where
        reason = reason_of(str(exc), constraint.source, pattern=False)
        raise ConstraintRejected(field_of(constraint), reason) from None


def _regex_refused(pattern: str) -> bool:
    """Whether llguidance refuses ``pattern`` (it reads some inner ``$`` and ``^`` as
    look-around: ``^a($|b)`` it takes, ``^(a(,|$)){3}$`` it does not)."""
    grammar = llguidance.grammar_from("regex", pattern)
    return bool(llguidance.LLMatcher.validate_grammar(grammar))


def json_grammar(constraint: JsonSchema) -> tuple[str, SchemaCheck | None]:
    """The grammar of a JSON schema (:func:`~.schemas.for_backend`: rewritten where the
    backend cannot enforce a keyword as given), and the check of its complete outputs
    where it has keywords the backend leaves to it.

    Raises:
        ConstraintRejected: a checked keyword in a schema the checker cannot read.
    """
    given = constraint.parsed()
    backend = for_backend(given, regex_refused=_regex_refused)
    overrides = dict(JSON_FORMAT)
    if "oneOf" in backend.checked:
        overrides["coerce_one_of"] = True  # as anyOf; the check holds each output to one
    text = constraint.schema  # as given where nothing was rewritten: the backend's messages
    if backend.schema != given:  # quote its columns
        text = json.dumps(backend.schema, separators=(",", ":"), ensure_ascii=False)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=overrides)  # type: ignore[arg-type]
    if not backend.checked:
        return grammar, None
    try:
        return grammar, SchemaCheck(given, backend.checked)
    except Exception as exc:  # jsonschema's SchemaError, an unknown $schema ...
        keywords = " and ".join(sorted(backend.checked))
        raise ConstraintRejected(
            field_of(constraint),
            f"{keywords} must be checked after generation, and the checker cannot read the "
            f"schema: {reason_of(str(exc))}",
        ) from None


#: The backend's words for the limits of its parser, and the names they have in
#: :class:`~twostroke.engine.structured.compiler.CompilerConfig`.
_ROW_LIMIT = re.compile(r"Current row has (\d+) items; max is (\d+)")
_STEP_ITEMS = re.compile(r"Too many items \(limit (\d+)")
#: Where in a Lark grammar the backend found the problem: ``at <line>(<column>): ``.
_POSITION = re.compile(r"^at (\d+)\((\d+)\): ")
#: A rule of the tools' grammar that holds one tool's parameters
#: (:func:`~twostroke.engine.tools.grammar.tool_constraint`), and the rule that names it.
_TOOL_ARGUMENTS = re.compile(r"args_(\d+): %json ")
_JSON_PARSE = re.compile(r'^failed to parse "%json": (.*) at line 1 column (\d+)$')
_TOOL_CALL = (
    r'call_{}: "\{{\\"name\\": \\"('
    + FUNCTION_NAME.pattern.replace("{", "{{").replace("}", "}}")
    + r')\\"'
)


def _place(grammar: str | None, line: int, column: int) -> str:
    """What a backend position names: a tool's parameters, in the tools' grammar (its
    positions are the engine's, not the caller's), a line and column of the grammar a
    caller wrote, or nothing (a grammar the engine generated from a regex or a schema)."""
    if grammar is None:
        return ""
    lines = grammar.splitlines()
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    arguments = _TOOL_ARGUMENTS.match(text)
    if arguments is not None:
        call = re.compile(_TOOL_CALL.format(arguments[1]), re.MULTILINE)
        name = call.search(grammar)
        if name is not None:
            return f"the parameters of function {name[1]!r}"
    return f"line {line}, column {column}"


def _json_place(grammar: str | None, column: int) -> str:
    """The tool whose parameters' JSON text the backend could not read at ``column`` (the
    tools' grammar writes each tool's on one %json line), if exactly one can be."""
    found = []
    lines = (grammar or "").splitlines()
    for number, text in enumerate(lines, start=1):
        arguments = _TOOL_ARGUMENTS.match(text)
        value = text[arguments.end() :] if arguments is not None else ""
        # serde reports a column at or a few bytes past the number it could not read.
        if any(char.isdigit() for char in value[max(column - 4, 0) : column]):
            found.append(_place(grammar, number, column))
    return found[0] if len(found) == 1 else ""


def reason_of(message: str, grammar: str | None = None, *, pattern: bool = True) -> str:
    """The backend's refusal as one line: why, and where in what the caller wrote, without
    the backend's dump of the grammar it generated.

    A regex syntax error becomes ``"invalid regex '(a': unclosed group"`` (the pattern as
    written, since a schema or a grammar may hold many; its position in the grammar
    llguidance generated would mean nothing to the caller), a dead end says so, a parser
    limit names the rule and its value as ``CompilerConfig`` does (``max_items_in_row``,
    ``step_max_items``); anything else keeps its first line, cut at
    :data:`MAX_REASON_LENGTH` characters. A position in a Lark grammar (``at 3(9): ...``)
    becomes what it points at: in the tools' grammar, the function whose parameters failed
    (``the parameters of function 'pick': ...``); in a caller's grammar, its line and column.

    Args:
        message: The backend's message.
        grammar: The Lark text the message's positions refer to (a ``Grammar``'s source).
        pattern: Quote a regex that does not compile (not for a regex constraint, whose
            field is the pattern itself).
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "the backend refused it without a reason"
    where = ""
    position = _POSITION.match(lines[0])
    if position is not None:
        lines[0] = lines[0][position.end() :]
        place = _place(grammar, int(position[1]), int(position[2]))
        where = f"{place}: " if place else ""
    unread = _JSON_PARSE.match(lines[0])
    if unread is not None:  # a column of the engine's %json text: the tool it belongs to
        place = _json_place(grammar, int(unread[2]))
        if place:
            where += f"{place}: "
            lines[0] = 'failed to parse "%json": ' + unread[1]
    return (where + _reason(lines, pattern))[:MAX_REASON_LENGTH]


def _reason(lines: list[str], quote: bool) -> str:
    if lines[0].startswith("NoExtension"):
        return "no token of the vocabulary can continue the output (a dead end)"
    row = _ROW_LIMIT.search(lines[0])
    if row is not None:
        return f"a row of the parse reached {row[1]} Earley items, past max_items_in_row ({row[2]})"
    items = _STEP_ITEMS.search(lines[0])
    if items is not None:
        return (
            f"one step of the parse added too many Earley items, past step_max_items ({items[1]})"
        )
    parse = next((n for n, line in enumerate(lines[:2]) if "regex parse error" in line), None)
    if parse is not None:
        cause = next((line for line in lines if line.startswith("error: ")), None)
        if cause is not None:
            # The line after the backend's words is the pattern as written (one line of it).
            pattern = lines[parse + 1] if parse + 1 < len(lines) else ""
            shown = f" {pattern[:80]!r}" if quote and pattern and pattern[0] != "^" else ""
            prefix = "failed to compile JSON schema: " if "JSON schema" in lines[0] else ""
            return f"{prefix}invalid regex{shown}: {cause.removeprefix('error: ')}"
    first = lines[0]
    return first if len(first) <= MAX_REASON_LENGTH else first[: MAX_REASON_LENGTH - 3] + "..."
