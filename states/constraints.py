"""Constraints on a request's output, as values, and the matcher the core knows them through.

A request may carry one constraint (``SamplingParams.constraint``): a JSON schema
(:class:`JsonSchema`), any JSON object (:class:`AnyJsonObject`), a regular expression
(:class:`Regex`), a choice among strings (:class:`Choice`) or a context-free grammar
(:class:`Grammar`). Each is a frozen, hashable value validated at construction, in canonical
form, so that equal constraints are equal values with one hash: the engine's cache of compiled
grammars is keyed by them. Each says what it is in two words: its ``kind`` (``"json"``,
``"json_object"``, ``"regex"``, ``"choice"``, ``"grammar"``: vLLM's names) and its argument's
``value`` (the schema's text, the pattern, the choices, the grammar's source; none for any
JSON object); :func:`constraint_from` makes it again from them, which is how it crosses a
process boundary. A JSON schema is kept as its compact JSON text, whether it was
given as a dict or as text (its keys keep their order: the order of ``properties`` is the
order the output's keys take); a choice's strings are sorted and deduplicated.

The values check their shape and their size only. Whether a schema's keywords, a pattern's
syntax or a grammar can be enforced is the backend's business (llguidance, in
``twostroke.engine.structured``): it refuses what it cannot enforce with a
:class:`~twostroke.states.errors.ConstraintRejected` naming the field and the reason.

The core knows a constraint only through :class:`Matcher`, one request's position in the
constraint's language: advance it by a token, ask which tokens may come next (as a set, or
as a packed bitmask row), and whether the output so far is complete. It never goes back: a
matcher advances only by tokens that are applied to its request
(:class:`~twostroke.states.request.TokenSampled`), and a sample that is discarded never is. The
bitmask layout is the one llguidance, xgrammar and vLLM share: bit ``t % 32`` of 32-bit word
``t // 32`` is token ``t``, which on a little-endian host is bit ``t % 8`` of byte ``t // 8``;
:func:`write_bitmask` and :func:`read_bitmask` convert between it and a set of ids. A plain
reference matcher for choices and regular expressions over a small vocabulary lives in
:mod:`twostroke.states.testing.constraints`. Pure: attrs and the standard library.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Protocol, TypeAlias, runtime_checkable

import attrs

__all__ = [
    "CONSTRAINT_TYPES",
    "MAX_CHOICES",
    "MAX_CHOICE_LENGTH",
    "MAX_CHOICE_TOTAL_LENGTH",
    "MAX_GRAMMAR_LENGTH",
    "MAX_GRAMMAR_RULES",
    "MAX_PATTERN_LENGTH",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_LENGTH",
    "MAX_SCHEMA_REFS",
    "AnyJsonObject",
    "Choice",
    "Constraint",
    "ConstraintValue",
    "Grammar",
    "JsonSchema",
    "Matcher",
    "Regex",
    "bitmask_words",
    "check_constraint",
    "constraint_from",
    "read_bitmask",
    "write_bitmask",
]

#: The longest JSON schema, in characters of its compact canonical text. Large tool schemas
#: are a few thousand; compiling is work per character.
MAX_SCHEMA_LENGTH = 131_072
#: How deep objects and arrays may nest in a JSON schema (each level of properties takes two).
MAX_SCHEMA_DEPTH = 64
#: The most ``$ref`` s in a JSON schema (keys of that name, anywhere). The backend compiles a
#: schema recursively through them: a chain of 3,500 overflowed a compiling thread's stack.
MAX_SCHEMA_REFS = 1_024
#: The longest regular expression, in characters.
MAX_PATTERN_LENGTH = 4_096
#: The most strings a choice may offer.
MAX_CHOICES = 1_024
#: The longest string of a choice, in characters.
MAX_CHOICE_LENGTH = 4_096
#: The most characters of a choice's strings together, as long as the longest schema: the
#: compiled grammar, and each request's matcher, hold every one of them.
MAX_CHOICE_TOTAL_LENGTH = 131_072
#: The longest grammar, in characters of its source.
MAX_GRAMMAR_LENGTH = 131_072
#: The most rules (and terminals) a grammar may define. The backend compiles a grammar
#: recursively through them: a chain of 4,000 overflowed a compiling thread's stack.
MAX_GRAMMAR_RULES = 1_024

#: Where a grammar defines a rule or terminal: at the start of a line, a name (Lark's may
#: start with ``?`` or ``!``, have a priority and template parameters) and ``:`` or GBNF's
#: ``::=``.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:\{[^}\n]*\}[ \t]*)?(?:::=|:)", re.M)
#: A ``"$ref"`` key of a JSON schema inlined in a grammar, however its letters are escaped.
_GRAMMAR_REF = re.compile(r'"(?:\$|\\u0024)(?:r|\\u0072)(?:e|\\u0065)(?:f|\\u0066)"', re.I)
_X_GUIDANCE = "x-guidance"

_SHORT_REPR = 60


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r:.80}"


def _short(text: str) -> str:
    if len(text) <= _SHORT_REPR:
        return repr(text)
    return f"{text[:_SHORT_REPR]!r}... ({len(text)} characters)"


def _lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (text no encoding writes), if it does.

    llguidance raised ``ValueError`` on one, which ended the engine that compiled it.
    """
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _check_unicode(name: str, text: str) -> None:
    index = _lone_surrogate(text)
    if index is not None:
        raise ValueError(
            f"{name} must be valid Unicode, got a lone surrogate {text[index]!r} "
            f"at character {index}"
        )


# --- JSON schemas -----------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"schema must hold finite numbers only, got {name}")


def _parse_schema(text: str) -> object:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"schema is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"schema must nest at most {MAX_SCHEMA_DEPTH} deep") from None


def _pointer(path: tuple[str, ...]) -> str:
    """A JSON pointer (RFC 6901) to a place in the schema, for messages."""
    return "/" + "/".join(part.replace("~", "~0").replace("/", "~1") for part in path)


def _surrogate_error(text: str, index: int, where: str) -> ValueError:
    return ValueError(f"schema must be valid Unicode, got a lone surrogate {text[index]!r} {where}")


def _check_json_value(root: object) -> None:
    """Raise unless ``root`` is plain JSON (string keys, lists, scalars), nested boundedly,
    with valid Unicode text, at most :data:`MAX_SCHEMA_REFS` ``$ref`` s and no ``x-guidance``.

    Iterative, so a deep value raises the depth rule, not ``RecursionError``.
    """
    stack: list[tuple[object, tuple[str, ...]]] = [(root, ())]
    refs = 0
    while stack:
        value, path = stack.pop()
        if isinstance(value, Mapping | list | tuple) and len(path) >= MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"schema must nest at most {MAX_SCHEMA_DEPTH} deep, got deeper at {_pointer(path)}"
            )
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise TypeError(
                        f"schema's keys must be strings, got {_kind(key)} at {_pointer(path)}"
                    )
                index = _lone_surrogate(key)
                if index is not None:
                    raise _surrogate_error(key, index, f"in a key at {_pointer(path)}")
                if key == _X_GUIDANCE:
                    raise ValueError(
                        f"schema must not hold {_X_GUIDANCE} (the backend's options: the "
                        f"server sets them), got it at {_pointer((*path, key))}"
                    )
                refs += key == "$ref"
                stack.append((item, (*path, key)))
        elif isinstance(value, list | tuple):
            stack.extend((item, (*path, str(index))) for index, item in enumerate(value))
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(
                    f"schema must hold finite numbers only, got {value!r} at {_pointer(path)}"
                )
        elif isinstance(value, str):
            index = _lone_surrogate(value)
            if index is not None:
                raise _surrogate_error(value, index, f"at {_pointer(path)}")
        elif value is not None and not isinstance(value, int):  # bool is an int
            raise TypeError(
                f"schema must hold only JSON values (dict, list, str, int, float, bool, None), "
                f"got {_kind(value)} at {_pointer(path)}"
            )
    if refs > MAX_SCHEMA_REFS:
        raise ValueError(f"schema must hold at most {MAX_SCHEMA_REFS} $refs, got {refs}")


def canonical_schema(value: object) -> str:
    """The compact JSON text of a schema: one text however the schema was written.

    Keys keep their order. It is not noise: a backend writes an object's properties in the
    order of the schema's ``properties`` (a ``"reasoning"`` before an ``"answer"`` is a
    choice), so two schemas that differ only in that order are two constraints.

    An attrs converter (for :class:`JsonSchema`).

    Args:
        value: The schema as a JSON object (a mapping with string keys) or as its JSON text.

    Returns:
        ``json.dumps(schema, separators=(",", ":"), ensure_ascii=False)``.

    Raises:
        TypeError: neither a mapping nor a string, a text whose JSON is not an object, or a
            key or value JSON cannot represent.
        ValueError: text that is not JSON, nesting past :data:`MAX_SCHEMA_DEPTH`, a NaN or
            infinity, a lone surrogate, more than :data:`MAX_SCHEMA_REFS` ``$ref`` s, an
            ``x-guidance`` key (llguidance's own options, which would override the fixed
            format), or a text longer than :data:`MAX_SCHEMA_LENGTH`.
    """
    if isinstance(value, str):
        if len(value) > 4 * MAX_SCHEMA_LENGTH:  # before parsing: no work for a huge text
            raise ValueError(
                f"schema must be <= {MAX_SCHEMA_LENGTH} characters as compact JSON, "
                f"got a text of {len(value)}"
            )
        value = _parse_schema(value)
        if not isinstance(value, Mapping):
            raise TypeError(f"schema must be a JSON object, got {_kind(value)}")
    elif not isinstance(value, Mapping):
        raise TypeError(
            f"schema must be a JSON object (a dict) or its JSON text, got {_kind(value)}"
        )
    _check_json_value(value)
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    if len(text) > MAX_SCHEMA_LENGTH:
        raise ValueError(
            f"schema must be <= {MAX_SCHEMA_LENGTH} characters as compact JSON, got {len(text)}"
        )
    return text


@attrs.frozen(repr=False)
class JsonSchema:
    """The output is JSON that validates against a JSON schema (OpenAI's ``json_schema``).

    Args:
        schema: The schema, as a JSON object (a dict) or its JSON text. It is kept as its
            compact text, keys in their order, so one schema makes equal, equally hashed
            constraints however it was written (a dict, indented text, escaped text).

    Raises:
        TypeError, ValueError: see :func:`canonical_schema`.
    """

    kind: ClassVar[str] = "json"
    argument: ClassVar[str] = "schema"

    schema: str = attrs.field(converter=canonical_schema)

    @property
    def value(self) -> str:
        """The argument's value: the schema's compact JSON text."""
        return self.schema

    def parsed(self) -> dict[str, Any]:
        """The schema as a fresh dict (the caller may change it)."""
        value: dict[str, Any] = json.loads(self.schema)
        return value

    def __repr__(self) -> str:
        return f"JsonSchema({_short(self.schema)})"


@attrs.frozen
class AnyJsonObject:
    """The output is one JSON object, of any content (OpenAI's ``json_object``)."""

    kind: ClassVar[str] = "json_object"
    argument: ClassVar[str] = "json_object"

    @property
    def value(self) -> None:
        """The argument's value: none (any object will do)."""
        return None


# --- text -------------------------------------------------------------------------------------


def _text(name: str, limit: int) -> Any:
    """An attrs validator: a non-empty str of at most ``limit`` characters."""

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {_kind(value)}")
        if not value:
            raise ValueError(f"{name} must be non-empty, got ''")
        if len(value) > limit:
            raise ValueError(f"{name} must be <= {limit} characters long, got {len(value)}")
        _check_unicode(name, value)

    return check


@attrs.frozen(repr=False)
class Regex:
    """The output, as a whole, matches a regular expression.

    The syntax is the backend's (llguidance reads Rust's ``regex`` crate syntax: no
    look-around, no back-references); the match is anchored at both ends.

    Args:
        pattern: The expression, non-empty, at most :data:`MAX_PATTERN_LENGTH` characters.

    Raises:
        TypeError: not a str.
        ValueError: empty, too long, or a lone surrogate in it.
    """

    kind: ClassVar[str] = "regex"
    argument: ClassVar[str] = "pattern"

    pattern: str = attrs.field(validator=_text("pattern", MAX_PATTERN_LENGTH))

    @property
    def value(self) -> str:
        """The argument's value: the pattern."""
        return self.pattern

    def __repr__(self) -> str:
        return f"Regex({_short(self.pattern)})"


def _rules() -> Any:
    """An attrs validator: a grammar's chains (rules, ``$ref`` s) within their limits."""

    def check(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
        rules = sum(1 for _ in _RULE.finditer(value))
        if rules > MAX_GRAMMAR_RULES:
            raise ValueError(f"grammar must define at most {MAX_GRAMMAR_RULES} rules, got {rules}")
        refs = sum(1 for _ in _GRAMMAR_REF.finditer(value))
        if refs > MAX_SCHEMA_REFS:
            raise ValueError(
                f"grammar must hold at most {MAX_SCHEMA_REFS} $refs (in its %json schemas), "
                f"got {refs}"
            )

    return check


def _choices(value: object) -> tuple[str, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"choices must be a sequence of strings, got {_kind(value)}")
    strings = tuple(value)
    if not strings:
        raise ValueError("choices must hold at least one string, got none")
    if len(strings) > MAX_CHOICES:
        raise ValueError(f"choices must hold <= {MAX_CHOICES} strings, got {len(strings)}")
    for item in strings:
        if not isinstance(item, str):
            raise TypeError(f"choices must contain only strings, got {_kind(item)}")
        if not item:
            raise ValueError("choices must be non-empty strings, got ''")
        if len(item) > MAX_CHOICE_LENGTH:
            raise ValueError(
                f"choices must be <= {MAX_CHOICE_LENGTH} characters long, got one of {len(item)}"
            )
        _check_unicode("choices", item)
    unique = sorted(set(strings))
    total = sum(map(len, unique))
    if total > MAX_CHOICE_TOTAL_LENGTH:
        raise ValueError(
            f"choices must be <= {MAX_CHOICE_TOTAL_LENGTH} characters long together, got {total}"
        )
    return tuple(unique)


@attrs.frozen
class Choice:
    """The output is exactly one of some strings.

    Args:
        choices: The strings (an iterable, not a bare string): at least one, at most
            :data:`MAX_CHOICES`, each non-empty and at most :data:`MAX_CHOICE_LENGTH`
            characters, :data:`MAX_CHOICE_TOTAL_LENGTH` together (once each). Kept sorted
            and without duplicates (their order means nothing).

    Raises:
        TypeError: not an iterable of strings.
        ValueError: none, too many, an empty or too long string, too long together, or a
            lone surrogate in one.
    """

    kind: ClassVar[str] = "choice"
    argument: ClassVar[str] = "choices"

    choices: tuple[str, ...] = attrs.field(converter=_choices)

    @property
    def value(self) -> tuple[str, ...]:
        """The argument's value: the strings, sorted."""
        return self.choices


@attrs.frozen(repr=False)
class Grammar:
    """The output is a sentence of a context-free grammar.

    The syntax is the backend's: llguidance reads Lark (``start: ...``) and llama.cpp's GBNF
    (``root ::= ...``), which covers what vLLM accepts in ``structured_outputs.grammar``.

    Args:
        source: The grammar's text, non-empty, at most :data:`MAX_GRAMMAR_LENGTH` characters,
            defining at most :data:`MAX_GRAMMAR_RULES` rules and terminals (counted where a
            line starts with a name and ``:`` or ``::=``), with at most
            :data:`MAX_SCHEMA_REFS` ``$ref`` s in the JSON schemas it inlines (``%json``).

    Raises:
        TypeError: not a str.
        ValueError: empty, too long, too many rules or ``$ref`` s, or a lone surrogate.
    """

    kind: ClassVar[str] = "grammar"
    argument: ClassVar[str] = "grammar"

    source: str = attrs.field(validator=[_text("grammar", MAX_GRAMMAR_LENGTH), _rules()])

    @property
    def value(self) -> str:
        """The argument's value: the grammar's source."""
        return self.source

    def __repr__(self) -> str:
        return f"Grammar({_short(self.source)})"


#: One constraint on a request's output.
Constraint: TypeAlias = JsonSchema | AnyJsonObject | Regex | Choice | Grammar
#: The classes of :data:`Constraint`, for ``isinstance``.
CONSTRAINT_TYPES: tuple[type[Constraint], ...] = (JsonSchema, AnyJsonObject, Regex, Choice, Grammar)
#: What a constraint's argument is (its ``value``): text, strings, or nothing.
ConstraintValue: TypeAlias = str | tuple[str, ...] | None


def _any_json_object(value: object) -> AnyJsonObject:
    if value is not None:
        raise TypeError(f"a json_object constraint takes no argument, got {_kind(value)}")
    return AnyJsonObject()


#: How each kind of constraint is made from its argument's value.
_MAKERS: Mapping[str, Callable[[Any], Constraint]] = {
    JsonSchema.kind: JsonSchema,
    AnyJsonObject.kind: _any_json_object,
    Regex.kind: Regex,
    Choice.kind: Choice,
    Grammar.kind: Grammar,
}


def constraint_from(kind: str, value: object) -> Constraint:
    """The constraint of ``kind`` whose argument is ``value`` (the inverse of reading a
    constraint's ``kind`` and ``value``), checked as its class checks it.

    Args:
        kind: ``"json"``, ``"json_object"``, ``"regex"``, ``"choice"`` or ``"grammar"``.
        value: The argument: the schema (a dict or its JSON text), the pattern, the choices,
            the grammar's source; ``None`` for ``"json_object"``.

    Raises:
        ValueError: an unknown kind (``"constraint kind must be one of json, json_object,
            regex, choice, grammar, got str 'lark'"``), or what the class refuses.
        TypeError: an argument to ``"json_object"``, or what the class refuses.
    """
    make = _MAKERS.get(kind)
    if make is None:
        raise ValueError(f"constraint kind must be one of {', '.join(_MAKERS)}, got {_kind(kind)}")
    return make(value)


def check_constraint(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An attrs validator: a :data:`Constraint` or ``None``.

    Raises:
        TypeError: ``"constraint must be a JsonSchema, AnyJsonObject, Regex, Choice or
            Grammar (or None), got dict {...}"``.
    """
    if value is not None and not isinstance(value, CONSTRAINT_TYPES):
        names = [kind.__name__ for kind in CONSTRAINT_TYPES]
        raise TypeError(
            f"{attribute.name} must be a {', '.join(names[:-1])} or {names[-1]} (or None), "
            f"got {_kind(value)}"
        )


# --- matching ---------------------------------------------------------------------------------


def bitmask_words(vocab_size: int) -> int:
    """How many 32-bit words one bitmask row of ``vocab_size`` tokens takes."""
    return (vocab_size + 31) // 32


def _bytes_of(row: memoryview) -> memoryview:
    if row.readonly:
        raise ValueError("a bitmask row must be writable")
    if not row.c_contiguous:
        raise ValueError("a bitmask row must be contiguous")
    return row.cast("B") if row.format != "B" or row.ndim != 1 else row


def write_bitmask(allowed: Iterable[int], row: memoryview) -> None:
    """Write a set of token ids into a bitmask row (bit ``t % 8`` of byte ``t // 8``).

    Args:
        allowed: The ids whose bits are set; every other bit is cleared.
        row: One row, writable and contiguous, of any item format (``int32`` words from
            numpy or torch, or bytes); ``4 * bitmask_words(vocab_size)`` bytes long.

    Raises:
        ValueError: the row is read-only or not contiguous, or an id is outside the row.
    """
    target = _bytes_of(row)
    bits = bytearray(target.nbytes)
    for token in allowed:
        if not 0 <= token < 8 * len(bits):
            raise ValueError(f"token id {token} is outside a bitmask of {8 * len(bits)} bits")
        bits[token >> 3] |= 1 << (token & 7)
    target[:] = bits


def read_bitmask(row: memoryview | bytes) -> frozenset[int]:
    """The token ids whose bits are set in a bitmask row (see :func:`write_bitmask`)."""
    data = row if isinstance(row, bytes) else row.tobytes()
    return frozenset(
        (index << 3) | bit
        for index, byte in enumerate(data)
        if byte
        for bit in range(8)
        if byte >> bit & 1
    )


@runtime_checkable
class Matcher(Protocol):
    """One request's position in its constraint's language, token by token.

    The scheduling core drives it: the request advances its matcher with each token applied
    to it (a discarded sample never is: there is nothing to undo), and the engine asks which
    tokens may come next. EOS is one of the model's EOS ids, which the matcher was made
    with: it is allowed exactly when the output so far is complete (:attr:`accepting`).
    Once :attr:`terminated`, only EOS is allowed.

    A matcher is not thread-safe: one thread at a time (the bookkeeping stroke advances it,
    the forward stroke may fill its bitmask row, never both at once).
    """

    @property
    def vocab_size(self) -> int:
        """How many token ids the matcher knows (its bitmask row's bits, rounded up to 32)."""

    @property
    def num_tokens(self) -> int:
        """How many tokens it has advanced by."""

    @property
    def accepting(self) -> bool:
        """Whether the output so far is complete: EOS may come now (or has come)."""

    @property
    def terminated(self) -> bool:
        """Whether the output is over: EOS came, or nothing can extend the output.

        Terminated but not :attr:`accepting` is a dead end (the vocabulary cannot spell any
        continuation); the request cannot finish with ``stop`` and should fail.
        """

    def advance(self, token_id: int) -> bool:
        """Move past ``token_id`` if the output with it can still satisfy the constraint.

        Every id of :meth:`allowed_token_ids` is taken. A backend may leave out of that set
        some others that keep the output valid (llguidance allows only the tokenizer's own
        spelling of a text the grammar forces) and still take them here. A token that is
        refused (or not an id of the vocabulary) leaves the matcher unchanged and returns
        ``False``; EOS is refused unless :attr:`accepting`.
        """

    def allowed_token_ids(self) -> frozenset[int]:
        """The ids a sampler may pick now (EOS included iff :attr:`accepting`).

        Empty only at a dead end (see :attr:`terminated`).
        """

    def fill_bitmask(self, row: memoryview) -> None:
        """Write :meth:`allowed_token_ids` into one bitmask row (see :func:`write_bitmask`).

        Raises:
            ValueError: the row is read-only, not contiguous or of the wrong size.
        """

    def fork(self) -> Matcher:
        """An independent matcher at the same place: advancing it leaves this one where it
        is (speculative decoding follows a request's drafts with one, to cut a draft at
        the first token the constraint refuses and to fill the masks of drafted positions).
        """
