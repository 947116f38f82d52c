"""Constraints as values (canonical, hashable, messages pinned), and the bitmask layout."""

from __future__ import annotations

import array
import json
import re
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.states.constraints import (
    CONSTRAINT_TYPES,
    MAX_CHOICE_LENGTH,
    MAX_CHOICE_TOTAL_LENGTH,
    MAX_CHOICES,
    MAX_GRAMMAR_LENGTH,
    MAX_GRAMMAR_RULES,
    MAX_PATTERN_LENGTH,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_LENGTH,
    MAX_SCHEMA_REFS,
    AnyJsonObject,
    Choice,
    Constraint,
    Grammar,
    JsonSchema,
    Matcher,
    Regex,
    bitmask_words,
    canonical_schema,
    constraint_from,
    read_bitmask,
    write_bitmask,
)
from twostroke.states.errors import ConstraintRejected, RequestRejected
from twostroke.states.params import SamplingParams
from twostroke.states.testing import ReferenceMatcher

TOOL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search"]},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    "required": ["name", "arguments"],
}


# --- JSON schemas -----------------------------------------------------------------------------


def test_a_schema_is_kept_as_compact_json_with_its_keys_in_order() -> None:
    schema = JsonSchema({"type": "object", "properties": {"b": {}, "a": {"minimum": 1.5}}})
    assert schema.schema == '{"type":"object","properties":{"b":{},"a":{"minimum":1.5}}}'
    assert schema.kind == "json"
    assert schema.argument == "schema"


def test_one_schema_is_one_value_with_one_hash_however_written() -> None:
    as_text = json.dumps(TOOL, indent=4, ensure_ascii=True)
    constraints = [JsonSchema(TOOL), JsonSchema(as_text), JsonSchema(json.loads(as_text))]
    assert len(set(constraints)) == 1
    assert len({hash(constraint) for constraint in constraints}) == 1
    params = {SamplingParams(constraint=constraint) for constraint in constraints}
    assert len(params) == 1
    assert JsonSchema(TOOL) != JsonSchema({**TOOL, "required": ["name"]})


def test_the_order_of_properties_makes_another_constraint() -> None:
    """The output's keys come in the order of ``properties``: reordering changes the output."""
    reordered = json.loads(json.dumps(TOOL), object_pairs_hook=lambda pairs: dict(pairs[::-1]))
    assert reordered == TOOL
    assert JsonSchema(reordered) != JsonSchema(TOOL)


def test_tuples_are_json_arrays_and_non_ascii_text_stays_text() -> None:
    schema = JsonSchema({"enum": ("Zürich", "東京", None, True, 2)})
    assert schema.schema == '{"enum":["Zürich","東京",null,true,2]}'
    assert schema == JsonSchema('{"enum": ["Z\\u00fcrich", "東京", null, true, 2]}')


def test_parsed_gives_a_fresh_dict() -> None:
    schema = JsonSchema(TOOL)
    parsed = schema.parsed()
    assert parsed == TOOL
    parsed["type"] = "array"
    assert schema.parsed() == TOOL


def test_the_caller_changing_its_dict_changes_nothing() -> None:
    mine = {"type": "object", "properties": {}}
    schema = JsonSchema(mine)
    mine["type"] = "array"
    assert schema.parsed()["type"] == "object"


def test_values_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        JsonSchema(TOOL).schema = "{}"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Choice(["a"]).choices = ("b",)  # type: ignore[misc]


def test_long_values_have_short_reprs() -> None:
    assert repr(JsonSchema({"type": "string"})) == """JsonSchema('{"type":"string"}')"""
    long = repr(JsonSchema(TOOL))
    assert long.startswith('JsonSchema(\'{"type":"object","properties"')
    assert long.endswith(f"... ({len(JsonSchema(TOOL).schema)} characters))")
    assert repr(Regex("[a-z]+")) == "Regex('[a-z]+')"
    assert repr(Regex("a" * 61)) == f"Regex({'a' * 60!r}... (61 characters))"
    assert repr(Grammar('start: "yes"')) == """Grammar('start: "yes"')"""
    assert repr(Choice(["b", "a"])) == "Choice(choices=('a', 'b'))"
    assert repr(AnyJsonObject()) == "AnyJsonObject()"


BAD_SCHEMAS = [
    (3, TypeError, "schema must be a JSON object (a dict) or its JSON text, got int 3"),
    (["a"], TypeError, "schema must be a JSON object (a dict) or its JSON text, got list ['a']"),
    (b"{}", TypeError, "schema must be a JSON object (a dict) or its JSON text, got bytes b'{}'"),
    ("[1, 2]", TypeError, "schema must be a JSON object, got list [1, 2]"),
    ("true", TypeError, "schema must be a JSON object, got bool True"),
    (
        "{'type': 'object'}",
        ValueError,
        "schema is not valid JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)",
    ),
    ("", ValueError, "schema is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ('{"minimum": NaN}', ValueError, "schema must hold finite numbers only, got NaN"),
    ('{"maximum": -Infinity}', ValueError, "schema must hold finite numbers only, got -Infinity"),
    (
        {"minimum": float("inf")},
        ValueError,
        "schema must hold finite numbers only, got inf at /minimum",
    ),
    (
        {"properties": {"a/b": {"enum": [float("nan")]}}},
        ValueError,
        "schema must hold finite numbers only, got nan at /properties/a~1b/enum/0",
    ),
    (
        {"properties": {1: {}}},
        TypeError,
        "schema's keys must be strings, got int 1 at /properties",
    ),
    (
        {"enum": [{"a~b": {1, 2}}]},
        TypeError,
        "schema must hold only JSON values (dict, list, str, int, float, bool, None), "
        "got set {1, 2} at /enum/0/a~0b",
    ),
    (
        {"default": b"x"},
        TypeError,
        "schema must hold only JSON values (dict, list, str, int, float, bool, None), "
        "got bytes b'x' at /default",
    ),
    # A lone surrogate is text no encoding can write: llguidance raised ValueError on it,
    # which ended the engine that compiled it.
    (
        '{"type": "string", "description": "\\ud800"}',
        ValueError,
        "schema must be valid Unicode, got a lone surrogate '\\ud800' at /description",
    ),
    (
        {"properties": {"a\udfff": {}}},
        ValueError,
        "schema must be valid Unicode, got a lone surrogate '\\udfff' in a key at /properties",
    ),
    # The backend's own options would override the server's (free whitespace, coerce_one_of).
    (
        {"type": "object", "x-guidance": {"whitespace_flexible": True}},
        ValueError,
        "schema must not hold x-guidance (the backend's options: the server sets them), "
        "got it at /x-guidance",
    ),
    (
        {"$defs": {"a": {"x-guidance": {"coerce_one_of": True}}}, "$ref": "#/$defs/a"},
        ValueError,
        "schema must not hold x-guidance (the backend's options: the server sets them), "
        "got it at /$defs/a/x-guidance",
    ),
]


@pytest.mark.parametrize(("value", "error", "message"), BAD_SCHEMAS)
def test_bad_schemas_raise_naming_the_rule(
    value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        JsonSchema(value)


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_schemas_nest_at_most_max_schema_depth() -> None:
    JsonSchema(_nested(MAX_SCHEMA_DEPTH))
    with pytest.raises(ValueError, match=f"^schema must nest at most {MAX_SCHEMA_DEPTH} deep, "):
        JsonSchema(_nested(MAX_SCHEMA_DEPTH + 1))
    deep_list: Any = ["x"]
    for _ in range(MAX_SCHEMA_DEPTH):
        deep_list = [deep_list]
    with pytest.raises(ValueError, match=r"^schema must nest at most 64 deep, got deeper at /"):
        JsonSchema({"enum": deep_list})


def test_a_text_nested_past_the_parser_is_a_value_error() -> None:
    # json.loads itself gives up (RecursionError) long before the text is too long.
    with pytest.raises(ValueError, match=f"^schema must nest at most {MAX_SCHEMA_DEPTH} deep$"):
        JsonSchema('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")


def test_schemas_are_at_most_max_schema_length_characters() -> None:
    filler = "x" * (MAX_SCHEMA_LENGTH - len('{"description":""}'))
    JsonSchema({"description": filler})
    with pytest.raises(
        ValueError,
        match=f"^schema must be <= {MAX_SCHEMA_LENGTH} characters as compact JSON, "
        f"got {MAX_SCHEMA_LENGTH + 1}$",
    ):
        JsonSchema({"description": filler + "x"})
    # a text far too long is refused before it is parsed
    huge = " " * (4 * MAX_SCHEMA_LENGTH) + "{}"
    with pytest.raises(ValueError, match=f"got a text of {len(huge)}$"):
        JsonSchema(huge)
    # spaces do not count: the limit is on the compact text
    assert JsonSchema(" " * (MAX_SCHEMA_LENGTH + 1) + "{}") == JsonSchema({})


def _ref_chain(length: int) -> dict[str, Any]:
    """``length`` definitions, each a ``$ref`` to the next: a chain the backend follows."""
    defs: dict[str, Any] = {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(length)}
    defs[str(length)] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/0"}


def test_schemas_hold_at_most_max_schema_refs() -> None:
    """A chain of 3,500 ``$ref`` s (113 KB) overflowed the compiling thread's stack."""
    JsonSchema(_ref_chain(MAX_SCHEMA_REFS - 1))
    with pytest.raises(
        ValueError,
        match=f"^schema must hold at most {MAX_SCHEMA_REFS} \\$refs, got {MAX_SCHEMA_REFS + 1}$",
    ):
        JsonSchema(_ref_chain(MAX_SCHEMA_REFS))
    with pytest.raises(ValueError, match=r"got 3501$"):
        JsonSchema(_ref_chain(3_500))


def test_canonical_schema_is_the_converter() -> None:
    assert canonical_schema('{ "b" : 1 , "a" : [ ] }') == '{"b":1,"a":[]}'


# --- the other kinds ----------------------------------------------------------------------------


def test_any_json_object_is_one_value() -> None:
    assert AnyJsonObject() == AnyJsonObject()
    assert hash(AnyJsonObject()) == hash(AnyJsonObject())
    assert (AnyJsonObject.kind, AnyJsonObject.argument) == ("json_object", "json_object")


def test_choices_are_sorted_and_deduplicated() -> None:
    choice = Choice(iter(["no", "yes", "no", "maybe"]))
    assert choice.choices == ("maybe", "no", "yes")
    assert choice == Choice(("yes", "maybe", "no"))
    assert hash(choice) == hash(Choice(["yes", "no", "maybe", "yes"]))
    assert (Choice.kind, Choice.argument) == ("choice", "choices")


def test_regex_and_grammar_keep_their_text() -> None:
    assert Regex(r"\d{4}").pattern == r"\d{4}"
    assert Regex("a+") == Regex("a+") != Regex("a*")
    assert (Regex.kind, Regex.argument) == ("regex", "pattern")
    grammar = Grammar('root ::= "yes" | "no"')
    assert grammar.source == 'root ::= "yes" | "no"'
    assert (Grammar.kind, Grammar.argument) == ("grammar", "grammar")


# --- kind and value -----------------------------------------------------------------------------

EVERY_KIND = [
    (JsonSchema({"type": "object"}), "json", '{"type":"object"}'),
    (AnyJsonObject(), "json_object", None),
    (Regex("a+"), "regex", "a+"),
    (Choice(["yes", "no"]), "choice", ("no", "yes")),
    (Grammar('start: "a"'), "grammar", 'start: "a"'),
]


@pytest.mark.parametrize(("constraint", "kind", "value"), EVERY_KIND, ids=lambda c: repr(c)[:12])
def test_a_constraint_is_its_kind_and_its_value(
    constraint: Constraint, kind: str, value: object
) -> None:
    assert (constraint.kind, constraint.value) == (kind, value)
    assert constraint_from(kind, value) == constraint
    assert {type(c) for c, _, _ in EVERY_KIND} == set(CONSTRAINT_TYPES)


def test_constraint_from_checks_the_kind_and_the_value_as_the_class_does() -> None:
    message = (
        "constraint kind must be one of json, json_object, regex, choice, grammar, got str 'lark'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        constraint_from("lark", "start: x")
    message = "a json_object constraint takes no argument, got str 'x'"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        constraint_from("json_object", "x")
    with pytest.raises(ValueError, match=r"^pattern must be non-empty, got ''$"):
        constraint_from("regex", "")
    with pytest.raises(TypeError, match=r"^schema must be a JSON object, got list"):
        constraint_from("json", "[1]")
    assert constraint_from("choice", ["b", "a", "b"]) == Choice(["a", "b"])


def test_texts_at_their_limit_are_taken() -> None:
    assert len(Regex("a" * MAX_PATTERN_LENGTH).pattern) == MAX_PATTERN_LENGTH
    assert len(Grammar("x" * MAX_GRAMMAR_LENGTH).source) == MAX_GRAMMAR_LENGTH
    assert len(Choice([f"c{i}" for i in range(MAX_CHOICES)]).choices) == MAX_CHOICES
    assert Choice(["x" * MAX_CHOICE_LENGTH]).choices == ("x" * MAX_CHOICE_LENGTH,)
    together = [f"{i:04}" + "x" * (MAX_CHOICE_LENGTH - 4) for i in range(32)]
    assert sum(map(len, Choice(together).choices)) == MAX_CHOICE_TOTAL_LENGTH
    rules = "".join(f"r{i}: r{i + 1}\n" for i in range(MAX_GRAMMAR_RULES - 2))
    Grammar(f'start: r0\n{rules}r{MAX_GRAMMAR_RULES - 2}: "a"')
    # rules are definitions at the start of a line, not every colon
    Grammar('start: "a:b" | /c:d/\n  | "e" // f: g\n# h: i')


BAD_VALUES = [
    (Regex, 3, TypeError, "pattern must be a str, got int 3"),
    (Regex, "", ValueError, "pattern must be non-empty, got ''"),
    (
        Regex,
        "a" * (MAX_PATTERN_LENGTH + 1),
        ValueError,
        f"pattern must be <= {MAX_PATTERN_LENGTH} characters long, got {MAX_PATTERN_LENGTH + 1}",
    ),
    (Grammar, None, TypeError, "grammar must be a str, got NoneType None"),
    (Grammar, "", ValueError, "grammar must be non-empty, got ''"),
    (
        Grammar,
        "x" * (MAX_GRAMMAR_LENGTH + 1),
        ValueError,
        f"grammar must be <= {MAX_GRAMMAR_LENGTH} characters long, got {MAX_GRAMMAR_LENGTH + 1}",
    ),
    (Choice, "yes", TypeError, "choices must be a sequence of strings, got str 'yes'"),
    (Choice, b"yes", TypeError, "choices must be a sequence of strings, got bytes b'yes'"),
    (Choice, 7, TypeError, "choices must be a sequence of strings, got int 7"),
    (Choice, [], ValueError, "choices must hold at least one string, got none"),
    (Choice, ["a", 1], TypeError, "choices must contain only strings, got int 1"),
    (Choice, ["a", ""], ValueError, "choices must be non-empty strings, got ''"),
    (
        Choice,
        ["a"] * (MAX_CHOICES + 1),
        ValueError,
        f"choices must hold <= {MAX_CHOICES} strings, got {MAX_CHOICES + 1}",
    ),
    (
        Choice,
        ["x" * (MAX_CHOICE_LENGTH + 1)],
        ValueError,
        f"choices must be <= {MAX_CHOICE_LENGTH} characters long, "
        f"got one of {MAX_CHOICE_LENGTH + 1}",
    ),
    (
        Choice,
        [f"{i:04}" + "x" * (MAX_CHOICE_LENGTH - 4) for i in range(33)],
        ValueError,
        f"choices must be <= {MAX_CHOICE_TOTAL_LENGTH} characters long together, "
        f"got {33 * MAX_CHOICE_LENGTH}",
    ),
    (
        Regex,
        "a\ud800",
        ValueError,
        "pattern must be valid Unicode, got a lone surrogate '\\ud800' at character 1",
    ),
    (
        Grammar,
        'start: "\udbff"',
        ValueError,
        "grammar must be valid Unicode, got a lone surrogate '\\udbff' at character 8",
    ),
    (
        Choice,
        ["yes", "n\udc00"],
        ValueError,
        "choices must be valid Unicode, got a lone surrogate '\\udc00' at character 1",
    ),
    (
        Grammar,
        "start: r0\n"
        + "".join(f"r{i}: r{i + 1}\n" for i in range(MAX_GRAMMAR_RULES))
        + 'r9999: "a"',
        ValueError,
        f"grammar must define at most {MAX_GRAMMAR_RULES} rules, got {MAX_GRAMMAR_RULES + 2}",
    ),
    (
        Grammar,
        "root ::= r0\n"
        + "".join(f"r{i} ::= r{i + 1}\n" for i in range(MAX_GRAMMAR_RULES))
        + 'r9999 ::= "a"',
        ValueError,
        f"grammar must define at most {MAX_GRAMMAR_RULES} rules, got {MAX_GRAMMAR_RULES + 2}",
    ),
    (
        Grammar,
        "start: %json " + json.dumps(_ref_chain(MAX_SCHEMA_REFS)),
        ValueError,
        f"grammar must hold at most {MAX_SCHEMA_REFS} $refs (in its %json schemas), "
        f"got {MAX_SCHEMA_REFS + 1}",
    ),
]


@pytest.mark.parametrize(("kind", "value", "error", "message"), BAD_VALUES)
def test_bad_values_raise_naming_the_field_and_the_rule(
    kind: type, value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        kind(value)


# --- SamplingParams.constraint ----------------------------------------------------------------


def test_sampling_params_take_one_constraint_or_none() -> None:
    assert SamplingParams().constraint is None
    for constraint in (JsonSchema(TOOL), AnyJsonObject(), Regex("a"), Choice(["a"]), Grammar("g")):
        assert isinstance(constraint, CONSTRAINT_TYPES)
        assert SamplingParams(constraint=constraint).constraint is constraint
    with pytest.raises(
        TypeError,
        match=r"^"
        + re.escape(
            "constraint must be a JsonSchema, AnyJsonObject, Regex, Choice or Grammar "
            "(or None), got dict {'type': 'object'}"
        )
        + "$",
    ):
        SamplingParams(constraint={"type": "object"})  # type: ignore[arg-type]


def test_constraint_rejected_names_the_field_and_the_reason() -> None:
    error = ConstraintRejected("constraint.pattern", "invalid regex: unclosed group")
    assert isinstance(error, RequestRejected)
    assert isinstance(error, ValueError)
    assert str(error) == "constraint.pattern: invalid regex: unclosed group"
    assert (error.field, error.reason) == ("constraint.pattern", "invalid regex: unclosed group")


def test_constraint_rejected_survives_pickling() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(ConstraintRejected("constraint.schema", "too slow")))
    assert (error.field, error.reason, str(error)) == (
        "constraint.schema",
        "too slow",
        "constraint.schema: too slow",
    )


# --- bitmasks -----------------------------------------------------------------------------------


def test_bitmask_words() -> None:
    assert [bitmask_words(n) for n in (1, 31, 32, 33, 49_152, 49_153)] == [1, 1, 1, 2, 1536, 1537]


def test_a_bitmask_is_little_endian_int32_words() -> None:
    """The layout llguidance, xgrammar and vLLM share: bit t % 32 of word t // 32."""
    words = array.array("i", [0] * bitmask_words(70))
    write_bitmask({0, 31, 32, 69}, memoryview(words))
    assert list(words) == [1 | -(2**31), 1, 1 << 5]
    assert read_bitmask(memoryview(words)) == {0, 31, 32, 69}
    write_bitmask(set(), memoryview(words))
    assert list(words) == [0, 0, 0]


@given(st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1)))))
def test_bitmasks_round_trip(case: tuple[int, set[int]]) -> None:
    vocab_size, allowed = case
    row = bytearray(4 * bitmask_words(vocab_size))
    write_bitmask(allowed, memoryview(row))
    assert read_bitmask(memoryview(row)) == allowed
    assert read_bitmask(bytes(row)) == allowed
    assert all(row[token >> 3] >> (token & 7) & 1 for token in allowed)


def test_write_bitmask_checks_its_row() -> None:
    with pytest.raises(ValueError, match=r"^a bitmask row must be writable$"):
        write_bitmask({1}, memoryview(bytes(4)))
    with pytest.raises(ValueError, match=r"^a bitmask row must be contiguous$"):
        write_bitmask({1}, memoryview(bytearray(8))[::2])
    with pytest.raises(ValueError, match=r"^token id 32 is outside a bitmask of 32 bits$"):
        write_bitmask({32}, memoryview(bytearray(4)))
    with pytest.raises(ValueError, match=r"^token id -1 is outside a bitmask of 32 bits$"):
        write_bitmask({-1}, memoryview(bytearray(4)))


def test_the_reference_matcher_is_a_matcher() -> None:
    matcher = ReferenceMatcher(Choice(["a"]), ["a", "<eos>"], eos_token_ids=[1])
    assert isinstance(matcher, Matcher)
    assert not isinstance(object(), Matcher)


def test_a_matcher_only_goes_forward() -> None:
    """No rollback: a matcher advances only by tokens applied to its request, and a discarded
    sample never is (tests/states/test_scheduler_constraints.py shows it for the lookahead).
    Drafts are followed on a fork, which leaves the request's own matcher where it is."""
    members = {name for name in vars(Matcher) if not name.startswith("_")}
    assert members == {
        "vocab_size",
        "num_tokens",
        "accepting",
        "terminated",
        "advance",
        "allowed_token_ids",
        "fill_bitmask",
        "fork",
    }
