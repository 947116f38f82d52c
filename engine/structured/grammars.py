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
        raise ConstraintRejected(field_of(constraint), reason_of(str(exc))) from None


def json_grammar(constraint: JsonSchema) -> tuple[str, SchemaCheck | None]:
    """The grammar of a JSON schema (:func:`~.schemas.for_backend`: rewritten where the
    backend cannot enforce a keyword as given), and the check of its complete outputs
    where it has keywords the backend leaves to it.

    Raises:
        ConstraintRejected: a checked keyword in a schema the checker cannot read.
    """
    given = constraint.parsed()
    backend = for_backend(given)
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


def reason_of(message: str) -> str:
    """The backend's refusal as one line: why, without its dump of the generated grammar.

    A regex syntax error becomes ``"invalid regex: unclosed group"`` (its position in the
    grammar llguidance generated would mean nothing to the caller), a dead end says so, a
    parser limit names the rule and its value as ``CompilerConfig`` does
    (``max_items_in_row``, ``step_max_items``); anything else keeps its first line, cut at
    :data:`MAX_REASON_LENGTH` characters.
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "the backend refused it without a reason"
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
    if any("regex parse error" in line for line in lines[:2]):
        cause = next((line for line in lines if line.startswith("error: ")), None)
        if cause is not None:
            return f"invalid regex: {cause.removeprefix('error: ')}"[:MAX_REASON_LENGTH]
    first = lines[0]
    return first if len(first) <= MAX_REASON_LENGTH else first[: MAX_REASON_LENGTH - 3] + "..."
