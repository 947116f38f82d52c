"""Schemas as the backend takes them: exact rewrites, dropped annotations, checked keywords,
and the server's strict rule; every output the engine lets finish validates against the
schema as it was given."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.engine import Engine, SamplingParams
from twostroke.engine.errors import ConstraintFailed, MatcherError
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.engine.structured import GrammarCompiler
from twostroke.engine.structured.schemas import for_backend, strict
from twostroke.states.constraints import JsonSchema
from twostroke.states.errors import ConstraintRejected


def test_unique_items_false_and_unknown_formats_are_dropped() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": False},
            "link": {"type": "string", "format": "uri-reference"},
            "when": {"type": "string", "format": "date-time"},
            "format": {"type": "string"},  # a property called format, not the keyword
        },
    }
    backend = for_backend(schema)
    properties = backend.schema["properties"]
    assert properties["tags"] == {"type": "array", "items": {"type": "string"}}
    assert properties["link"] == {"type": "string"}
    assert properties["when"]["format"] == "date-time"  # enforced by the backend
    assert properties["format"] == {"type": "string"}
    assert backend.checked == frozenset()
    assert schema["properties"]["link"]["format"] == "uri-reference"  # the given one unchanged


def test_dependencies_become_any_of() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]},
        "dependencies": {"b": {"properties": {"a": {"minimum": 3}}}},
    }
    rewritten = for_backend(schema).schema
    assert "dependentRequired" not in rewritten
    assert "dependencies" not in rewritten
    assert rewritten["allOf"] == [
        {"anyOf": [{"properties": {"a": False}}, {"required": ["a", "b"]}]},
        {
            "anyOf": [
                {"properties": {"b": False}},
                {"required": ["b"], "allOf": [{"properties": {"a": {"minimum": 3}}}]},
            ]
        },
    ]
    required = {**schema, "required": ["a"], "dependencies": {"a": ["b"]}}
    del required["dependentRequired"]
    assert for_backend(required).schema["allOf"] == [{"required": ["b"]}]


def test_not_required_becomes_absent_properties() -> None:
    one = for_backend({"allOf": [{"not": {"required": ["a"]}}]}).schema
    assert one == {"allOf": [{"allOf": [{"type": "object", "properties": {"a": False}}]}]}
    two = for_backend({"not": {"required": ["a", "b"]}}).schema
    assert two == {
        "allOf": [
            {
                "type": "object",
                "anyOf": [{"properties": {"a": False}}, {"properties": {"b": False}}],
            }
        ]
    }
    exclusive = for_backend({"not": {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}})
    assert exclusive.schema == {
        "allOf": [
            {"type": "object", "properties": {"a": False}},
            {"type": "object", "properties": {"b": False}},
        ]
    }
    assert exclusive.checked == frozenset()
    other = for_backend({"not": {"required": ["a"], "type": "object"}})
    assert other.schema == {}  # dropped, and checked
    assert other.checked == {"not"}


def test_checked_keywords() -> None:
    assert for_backend({"oneOf": [{"type": "integer"}, {"minimum": 0}]}).checked == {"oneOf"}
    unique = {"type": "array", "uniqueItems": True}
    assert for_backend(unique).checked == {"uniqueItems"}
    assert for_backend({**unique, "maxItems": 1}) == for_backend({"type": "array", "maxItems": 1})


#: Schemas the backend refused as given, each with what it takes now.
RELAXED: dict[str, dict[str, Any]] = {
    "dependentRequired": {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [3]}, "c": {"enum": [4]}},
        "dependentRequired": {"a": ["b"], "c": ["a"]},
        "additionalProperties": False,
    },
    "dependencies (schema)": {
        "type": "object",
        "properties": {"kind": {"enum": ["x", "y"]}, "size": {"type": "integer"}},
        "dependencies": {"size": {"properties": {"kind": {"const": "x"}}, "required": ["kind"]}},
        "additionalProperties": False,
    },
    "uniqueItems": {
        "type": "array",
        "items": {"enum": [1, 2, 3]},
        "uniqueItems": True,
        "minItems": 1,
        "maxItems": 4,
    },
    "oneOf, overlapping": {
        "oneOf": [
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "integer", "minimum": 5, "maximum": 20},
        ]
    },
    "unknown format": {"type": "string", "format": "uri-reference", "maxLength": 6},
    "not required": {
        "type": "object",
        "properties": {"a": {"const": 1}, "b": {"const": 2}},
        "not": {"required": ["a", "b"]},
        "additionalProperties": False,
    },
}


def _walk(compiled: Any, rng: random.Random) -> bytes | str | None:
    """A random output as a request would end: bytes (stop), its failure, or None (length)."""
    matcher = compiled.matcher()
    out: list[int] = []
    for _ in range(200):
        allowed = matcher.allowed_token_ids()
        if 256 in allowed and rng.random() < 0.5:
            return bytes(out)
        choices = sorted(allowed - {256})
        if not choices:
            return bytes(out) if matcher.accepting else matcher.failure
        token = rng.choice(choices)
        assert matcher.advance(token)
        out.append(token)
        if matcher.terminated:
            return bytes(out) if matcher.accepting else matcher.failure
    return None


@pytest.mark.parametrize("name", list(RELAXED))
def test_every_output_of_a_relaxed_schema_validates(
    byte_compiler: GrammarCompiler, name: str
) -> None:
    schema = RELAXED[name]
    compiled = byte_compiler.compile_now(JsonSchema(schema))
    validator = jsonschema.Draft202012Validator(schema)
    rng = random.Random(name)
    finished, refused = [], []
    for _ in range(150):
        outcome = _walk(compiled, rng)
        if isinstance(outcome, bytes):
            finished.append(json.loads(outcome))
        elif isinstance(outcome, str):
            refused.append(outcome)
    assert finished, "no output finished"
    invalid = [value for value in finished if not validator.is_valid(value)]
    assert invalid == []
    if compiled.check is None:  # exact: the backend alone decides
        assert refused == []
    for reason in refused:
        assert reason.startswith("the output does not validate at ")
        assert "checked after generation" in reason


def test_a_checked_output_that_does_not_validate_cannot_end(
    byte_compiler: GrammarCompiler,
) -> None:
    compiled = byte_compiler.compile_now(JsonSchema(RELAXED["uniqueItems"]))
    matcher = compiled.matcher()
    assert all(matcher.advance(byte) for byte in b"[1, 2, 1]")
    assert matcher.terminated
    assert not matcher.accepting
    assert matcher.allowed_token_ids() == frozenset()
    assert not matcher.advance(256)
    assert matcher.failure == (
        "the output does not validate at /: uniqueItems ([1, 2, 1] has non-unique elements); "
        "uniqueItems is checked after generation, not enforced while sampling"
    )
    fine = compiled.matcher()
    assert all(fine.advance(byte) for byte in b"[3, 1]")
    assert fine.accepting
    assert fine.advance(256)


def test_one_of_matching_two_branches_cannot_end(byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile_now(JsonSchema(RELAXED["oneOf, overlapping"]))
    both = compiled.matcher()
    assert all(both.advance(byte) for byte in b"7")
    assert not both.accepting
    assert 256 not in both.allowed_token_ids()
    one = compiled.matcher()
    assert all(one.advance(byte) for byte in b"3")
    assert one.accepting


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        # a key's pattern cannot be dropped: other keys would take additionalProperties
        (
            {"type": "object", "patternProperties": {"^(?!x)": {}}},
            "invalid regex: look-around, including look-ahead and look-behind, is not supported",
        ),
        ({"$dynamicRef": "#node"}, 'Unimplemented keys: ["$dynamicRef"]'),
    ],
)
def test_what_cannot_be_rewritten_nor_checked_is_still_refused(
    byte_compiler: GrammarCompiler, schema: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ConstraintRejected) as refused:
        byte_compiler.compile_now(JsonSchema(schema))
    assert refused.value.reason == reason


def test_a_checked_output_the_checker_cannot_read_cannot_end(
    byte_compiler: GrammarCompiler,
) -> None:
    # \p{L} is Rust's regex syntax (llguidance's), which Python's re (jsonschema's) refuses
    letters = {"type": "string", "pattern": "^\\p{L}+$"}
    schema = {"type": "array", "uniqueItems": True, "items": letters, "maxItems": 2}
    matcher = byte_compiler.compile_now(JsonSchema(schema)).matcher()
    assert all(matcher.advance(byte) for byte in b'["a"]')
    assert matcher.terminated
    assert not matcher.accepting
    assert matcher.failure == (
        "the output cannot be checked against the schema (error: bad escape \\p at position 1)"
    )


# --- strict -----------------------------------------------------------------------------------


def test_strict_closes_objects_that_say_nothing_of_other_keys() -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"x": {}}}},
            "either": {"anyOf": [{"properties": {"y": {}}}, {"type": "null"}]},
            "one": {"oneOf": [{"properties": {"y": {}}}, {"type": "null"}]},
            "neg": {"not": {"properties": {"z": {}}}},
            "joined": {"allOf": [{"properties": {"z": {}}}], "properties": {"w": {}}},
            "ref": {"$ref": "#/$defs/point"},
            "based": {"allOf": [{"$ref": "#/$defs/base"}]},
        },
        "$defs": {
            "point": {"properties": {"x": {}}},
            "base": {"properties": {"x": {}}},
        },
    }
    closed = strict(schema)
    properties = closed["properties"]
    assert closed["additionalProperties"] is False
    assert properties["where"]["additionalProperties"] is False
    assert properties["open"]["additionalProperties"] is True
    assert properties["list"]["items"]["additionalProperties"] is False
    assert properties["either"]["anyOf"][0]["additionalProperties"] is False
    # oneOf, not, allOf (and a subschema beside it), and $defs an allOf refers to: untouched
    assert properties["one"] == schema["properties"]["one"]  # type: ignore[index]
    assert properties["neg"] == schema["properties"]["neg"]  # type: ignore[index]
    assert properties["joined"] == schema["properties"]["joined"]  # type: ignore[index]
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert closed["$defs"]["base"] == {"properties": {"x": {}}}
    assert "additionalProperties" not in schema  # the given one unchanged


def test_every_strict_output_validates_against_the_schema_as_sent(
    byte_compiler: GrammarCompiler,
) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}, "b": {"type": "object", "properties": {}}},
        "required": ["a"],
    }
    compiled = byte_compiler.compile_now(JsonSchema(strict(schema)))
    validator = jsonschema.Draft202012Validator(schema)
    rng = random.Random(7)
    outputs = []
    for _ in range(60):
        try:
            outcome = _walk(compiled, rng)
        except MatcherError:  # a limit: the request would fail, not deliver
            continue
        if isinstance(outcome, bytes):
            value = json.loads(outcome)
            assert validator.is_valid(value), value
            assert set(value) <= {"a", "b"}
            assert set(value.get("b", {})) == set()
            outputs.append(value)
    assert outputs


def _writing(prompt: str, text: bytes) -> Any:
    """A toy model that writes ``text`` where its mask lets it (else the first allowed)."""

    def choose(token_ids: Sequence[int], allowed: frozenset[int]) -> int:
        written = len(token_ids) - len(prompt.encode())
        target = text[written] if written < len(text) else 256
        return target if target in allowed else min(allowed)

    return choose


@pytest.mark.anyio
@pytest.mark.parametrize(("text", "fails"), [(b'["a", "a"]', True), (b'["a", "b"]', False)])
async def test_a_request_whose_output_fails_the_check_fails_naming_the_keyword(
    text: bytes, fails: bool
) -> None:
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}
    params = SamplingParams(max_tokens=32, constraint=JsonSchema(schema))
    runner = ToyRunner(choose=_writing("Tags:", text))
    async with Engine.open(
        runner=runner, tokenizer=ByteTokenizer(), device="cpu", num_blocks=32, block_size=4
    ) as engine:
        if fails:
            with pytest.raises(ConstraintFailed) as failed:
                await engine.generate("Tags:", params)
            assert "uniqueItems is checked after generation" in failed.value.reason
        else:
            output = await engine.generate("Tags:", params)
            assert str(output.finish_reason) == "stop"
            assert json.loads(output.text) == ["a", "b"]


# --- properties: the rewrites keep the valid instances, strict narrows them -------------------

_NAMES = ("a", "b", "c")
_VALUES = st.sampled_from([0, 1, "x", None])


@st.composite
def _object_schemas(draw: st.DrawFn, depth: int = 2, refs: bool = True) -> dict[str, Any]:
    """Small object schemas with the keywords the rewrites and strict touch."""
    schema: dict[str, Any] = {}
    if draw(st.booleans()):
        schema["type"] = "object"
    names = draw(st.lists(st.sampled_from(_NAMES), unique=True, max_size=3))
    if names:
        schema["properties"] = {
            name: {"enum": draw(st.lists(_VALUES, min_size=1, max_size=2, unique=True))}
            for name in names
        }
    if draw(st.booleans()):
        schema["required"] = draw(st.lists(st.sampled_from(_NAMES), unique=True, max_size=2))
    if draw(st.booleans()):
        schema["additionalProperties"] = draw(st.booleans())
    lists = st.lists(st.sampled_from(_NAMES), unique=True, max_size=2)
    if draw(st.booleans()):
        schema["dependentRequired"] = draw(
            st.dictionaries(st.sampled_from(_NAMES), lists, max_size=2)
        )
    if depth and draw(st.booleans()):
        sub = _object_schemas(depth=depth - 1, refs=refs)
        schema["dependencies"] = draw(
            st.dictionaries(st.sampled_from(_NAMES), lists | sub, max_size=2)
        )
    if draw(st.booleans()):
        schema["not"] = {
            "required": draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=2))
        }
    if depth and draw(st.booleans()):
        keyword = draw(st.sampled_from(["anyOf", "allOf", "oneOf"]))
        member = _object_schemas(depth=depth - 1, refs=refs)
        if refs:
            member |= st.just({"$ref": "#/$defs/d"})
        schema[keyword] = draw(st.lists(member, min_size=1, max_size=2))
    if refs and draw(st.booleans()):
        schema[draw(st.sampled_from(["not", "if", "then"]))] = {"$ref": "#/$defs/d"}
    if draw(st.booleans()):
        schema["format"] = draw(st.sampled_from(["uri-reference", "date"]))
    if draw(st.booleans()):
        schema["unevaluatedProperties"] = draw(st.booleans() | st.just({"enum": [0]}))
    if draw(st.booleans()):
        schema[draw(st.sampled_from(["minProperties", "maxProperties"]))] = draw(st.integers(0, 2))
    if draw(st.booleans()):
        schema["propertyNames"] = {"enum": draw(st.lists(st.sampled_from(_NAMES), max_size=2))}
    return schema


@st.composite
def _schemas_with_defs(draw: st.DrawFn) -> dict[str, Any]:
    """An object schema whose subschemas may refer to ``#/$defs/d`` (from anywhere)."""
    schema = draw(_object_schemas())
    schema["$defs"] = {"d": draw(_object_schemas(depth=1, refs=False))}
    if draw(st.booleans()):
        schema.setdefault("properties", {})["e"] = {"$ref": "#/$defs/d"}
    return schema


_INSTANCES = st.one_of(
    st.dictionaries(
        st.sampled_from((*_NAMES, "d", "e")),
        _VALUES | st.dictionaries(st.sampled_from(_NAMES), _VALUES, max_size=2),
        max_size=4,
    ),
    _VALUES,
)


@given(schema=_schemas_with_defs(), instances=st.lists(_INSTANCES, min_size=1, max_size=8))
def test_the_rewrites_keep_the_valid_instances(
    schema: dict[str, Any], instances: list[Any]
) -> None:
    """With every keyword applied: ``dependencies`` as draft 7 reads it (2020-12 ignores
    it; here it becomes 2020-12's dependentRequired and dependentSchemas, joined with
    ``allOf``) and ``dependentRequired`` as 2020-12 does. (``format`` is not asserted: an
    annotation.)"""
    reference = jsonschema.Draft202012Validator(_as_2020(schema))
    backend = for_backend(schema)
    rewritten = jsonschema.Draft202012Validator(backend.schema)
    for instance in instances:
        if reference.is_valid(instance):  # relaxed or not, every valid instance is admitted
            assert rewritten.is_valid(instance), instance
        elif not backend.checked:  # exact: nothing the check would have to refuse
            assert not rewritten.is_valid(instance), instance


def _as_2020(schema: Any) -> Any:
    """Draft 7's ``dependencies`` as 2020-12's keywords, everywhere."""
    if isinstance(schema, list):
        return [_as_2020(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _as_2020(value) for key, value in schema.items() if key != "dependencies"}
    for name, then in schema.get("dependencies", {}).items():
        keyword = "dependentRequired" if isinstance(then, list) else "dependentSchemas"
        result.setdefault("allOf", []).append({keyword: {name: _as_2020(then)}})
    return result


@given(schema=_schemas_with_defs(), instances=st.lists(_INSTANCES, min_size=1, max_size=8))
def test_strict_only_narrows(schema: dict[str, Any], instances: list[Any]) -> None:
    given_ = jsonschema.Draft202012Validator(schema)
    narrowed = jsonschema.Draft202012Validator(strict(schema))
    for instance in instances:
        if narrowed.is_valid(instance):
            assert given_.is_valid(instance), instance


#: Per relaxed keyword: a schema, and an output its relaxation admits that does not validate.
RELAXED_INVALID: dict[str, tuple[dict[str, Any], bytes]] = {
    "not": ({"not": {"type": "string"}}, b'"x"'),
    "if": (
        {
            "type": "object",
            "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer"}},
            "required": ["k", "v"],
            "if": {"properties": {"k": {"const": "a"}}},
            "then": {"properties": {"v": {"minimum": 5}}},
            "else": {"properties": {"v": {"maximum": 0}}},
        },
        b'{"k": "a", "v": -1}',  # else's, where if holds
    ),
    "propertyNames": (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "maxProperties": 1},
        b'{"A": 1}',
    ),
    "unevaluatedProperties": (
        {"allOf": [{"properties": {"a": {"type": "integer"}}}], "unevaluatedProperties": False},
        b'{"a": 1, "b": 2}',
    ),
    "pattern": ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, b'"xa"'),
    "minProperties": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1},
        b"{}",
    ),
    "maxProperties": (
        {"type": "object", "properties": {"a": {"enum": [1]}}, "maxProperties": 1},
        b'{"a": 1, "b": 2}',
    ),
    "contains": ({"type": "array", "contains": {"const": 1}, "maxItems": 2}, b"[2]"),
    "unevaluatedItems": (
        {"type": "array", "allOf": [{"prefixItems": [{}]}], "unevaluatedItems": False},
        b"[1, 2]",
    ),
    "$ref": (
        {
            "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
            "properties": {"head": {"$ref": "#/$defs/node", "required": ["next"]}},
        },
        b'{"head": {}}',
    ),
}


@pytest.mark.parametrize("keyword", list(RELAXED_INVALID))
def test_each_relaxation_is_checked(byte_compiler: GrammarCompiler, keyword: str) -> None:
    schema, text = RELAXED_INVALID[keyword]
    compiled = byte_compiler.compile_now(JsonSchema(schema))
    assert compiled.check is not None
    assert compiled.check.checked == {keyword}
    matcher = compiled.matcher()
    assert all(matcher.advance(byte) for byte in text)  # the relaxation admits it ...
    assert not matcher.accepting  # ... but it cannot end
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


@pytest.mark.anyio
@pytest.mark.parametrize("keyword", list(RELAXED_INVALID))
async def test_a_relaxed_output_that_does_not_validate_fails_the_request(keyword: str) -> None:
    schema, text = RELAXED_INVALID[keyword]
    params = SamplingParams(max_tokens=64, constraint=JsonSchema(schema))
    runner = ToyRunner(choose=_writing("Out:", text))
    async with Engine.open(
        runner=runner, tokenizer=ByteTokenizer(), device="cpu", num_blocks=64, block_size=4
    ) as engine:
        with pytest.raises(
            ConstraintFailed, match=rf"{re.escape(keyword)} is checked after generation"
        ):
            await engine.generate("Out:", params)
