"""What a fresh JSONSchemaBench sample found (issue 53): each case cut down to a minimal schema
and a valid instance from the schemas that showed it, and each held to the rule that a valid
instance is accepted and every output that ends validates.

The sample and how to redraw it: docs/structured-output.md, "Coverage on real schemas".
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.structured import GrammarCompiler
from twostroke.engine.structured.schemas import for_backend
from twostroke.states.constraints import JsonSchema

DRAFT_7 = "http://json-schema.org/draft-07/schema#"
DRAFT_4 = "http://json-schema.org/draft-04/schema"


def _accepted(compiler: GrammarCompiler, schema: dict[str, Any], text: str) -> bool:
    """Whether a fresh matcher takes ``text`` byte by byte and accepts at its end."""
    matcher = compiler.compile_now(JsonSchema(schema)).matcher()
    return all(matcher.advance(byte) for byte in ByteTokenizer().encode(text)) and bool(
        matcher.accepting
    )


#: Before 2019-09, keys beside a ``$ref`` are ignored (drupal-libraries and yamllint of
#: JsonSchemaStore refused their valid instances; a circular target was relaxed and checked
#: where it can be compiled exactly).
REF_SIBLINGS: dict[str, tuple[dict[str, Any], Any]] = {
    "closed properties beside a $ref (draft 7)": (
        {
            "$schema": DRAFT_7,
            "definitions": {"file": {"type": "object", "properties": {"weight": {}}}},
            "type": "object",
            "additionalProperties": {
                "$ref": "#/definitions/file",
                "properties": {"cache": {"type": "boolean"}},
                "additionalProperties": False,
            },
        },
        {"a.js": {"weight": 1, "cache": True}},
    ),
    "a circular $ref beside keys (draft 4)": (
        {
            "$schema": DRAFT_4,
            "definitions": {
                "node": {
                    "type": "object",
                    "properties": {"next": {"$ref": "#/definitions/node", "type": "object"}},
                }
            },
            "$ref": "#/definitions/node",
            "required": ["next"],
        },
        {"next": {"next": {}}},
    ),
}


@pytest.mark.parametrize("case", list(REF_SIBLINGS))
def test_keys_beside_a_ref_are_ignored_before_2019_09(
    byte_compiler: GrammarCompiler, case: str
) -> None:
    schema, instance = REF_SIBLINGS[case]
    assert jsonschema.validators.validator_for(schema)(schema).is_valid(instance)
    assert _accepted(byte_compiler, schema, json.dumps(instance))
    assert for_backend(schema).checked == frozenset()  # exact: nothing left to check


def test_keys_beside_a_ref_still_hold_from_2019_09(byte_compiler: GrammarCompiler) -> None:
    draft_7 = REF_SIBLINGS["closed properties beside a $ref (draft 7)"][0]
    schema = {**draft_7, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    instance = {"a.js": {"weight": 1, "cache": True}}
    assert not jsonschema.Draft202012Validator(schema).is_valid(instance)
    assert not _accepted(byte_compiler, schema, json.dumps(instance))
    assert _accepted(byte_compiler, schema, json.dumps({"a.js": {"cache": True}}))


#: Schemas the backend refused, each with a valid instance, and the keywords left to the
#: check (none: the rewrite is exact).
ONCE_REFUSED: dict[str, tuple[dict[str, Any], Any, frozenset[str]]] = {
    # chrome-manifest: llguidance refuses patterns that are not disjoint, and ".*" meets all.
    "a pattern that matches every key beside another": (
        {
            "type": "object",
            "patternProperties": {
                ".*": {"type": "object", "properties": {"description": {"type": "string"}}},
                "^_execute$": {"type": "object", "properties": {"key": {"type": "string"}}},
            },
        },
        {"_execute": {"key": "k"}, "open": {"description": "d"}},
        frozenset({"patternProperties"}),
    ),
    # WashingtonPost's ANS: a declared property that ".*" also matches is intersected with
    # it, and llguidance refuses to intersect circular references.
    "a pattern that matches every key, circular, beside a declared property": (
        {
            "definitions": {
                "item": {
                    "type": "object",
                    "properties": {"promo": {"$ref": "#/definitions/promo"}},
                },
                "promo": {
                    "type": "object",
                    "properties": {
                        "basic": {"anyOf": [{"$ref": "#/definitions/item"}, {"type": "null"}]}
                    },
                    "patternProperties": {
                        ".*": {"anyOf": [{"$ref": "#/definitions/item"}, {"type": "null"}]}
                    },
                },
            },
            "$ref": "#/definitions/item",
        },
        {"promo": {"basic": {"promo": {}}, "other": None}},
        frozenset({"patternProperties"}),
    ),
    # Github_hard o13457: a $ref into a key that is no keyword ("parts"): its `not` was left
    # as it was, and llguidance refused it.
    "a not under a $ref target outside the keywords": (
        {
            "type": "object",
            "properties": {"get": {"$ref": "#/parts/get"}},
            "parts": {"get": {"type": "object", "not": {"anyOf": [{"required": ["a", "b"]}]}}},
        },
        {"get": {"a": 1}},
        frozenset(),
    ),
    # 3.0.schema: maxProperties beside branches that bring optional properties.
    "maxProperties beside oneOf branches with optional properties": (
        {
            "type": "object",
            "maxProperties": 1,
            "oneOf": [
                {"properties": {"a": {"type": "integer"}, "c": {}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ],
        },
        {"a": 1},
        frozenset({"maxProperties", "oneOf"}),
    ),
    # catalogue-entry-schema, Github_hard o76776: "$" inside a pattern is an assertion
    # llguidance's regexes do not have.
    "an end anchor inside a pattern": (
        {"type": "string", "pattern": "^([^,]+(,|$)){3,}$"},
        "a,b,c",
        frozenset({"pattern"}),
    ),
}


@pytest.mark.parametrize("case", list(ONCE_REFUSED))
def test_once_refused_schemas_compile_and_take_their_valid_instance(
    byte_compiler: GrammarCompiler, case: str
) -> None:
    schema, instance, checked = ONCE_REFUSED[case]
    assert jsonschema.validators.validator_for(schema)(schema).is_valid(instance)
    assert _accepted(byte_compiler, schema, json.dumps(instance))
    check = byte_compiler.compile_now(JsonSchema(schema)).check
    assert (check.checked if check is not None else frozenset()) == checked


def test_a_ref_into_a_dropped_key_beside_a_ref_still_names_its_target(
    byte_compiler: GrammarCompiler,
) -> None:
    schema = {
        "$schema": DRAFT_7,
        "definitions": {"any": {"type": "object"}},
        "properties": {
            "x": {"$ref": "#/definitions/any", "properties": {"n": {"type": "integer"}}},
            "y": {"$ref": "#/properties/x/properties/n"},  # into a key the draft ignores
        },
    }
    validator = jsonschema.Draft7Validator(schema)
    assert validator.is_valid({"x": {"n": "a"}, "y": 3})
    assert not validator.is_valid({"y": "a"})
    assert _accepted(byte_compiler, schema, '{"x": {"n": "a"}, "y": 3}')
    assert not _accepted(byte_compiler, schema, '{"y": "a"}')


def test_an_output_the_dropped_pattern_refuses_cannot_end(byte_compiler: GrammarCompiler) -> None:
    schema, _, _ = ONCE_REFUSED["a pattern that matches every key beside another"]
    matcher = byte_compiler.compile_now(JsonSchema(schema)).matcher()
    assert all(matcher.advance(byte) for byte in b'{"_execute": {"key": 1}}')
    assert matcher.terminated
    assert not matcher.accepting
    assert matcher.failure == (
        "the output does not validate at /_execute/key: type (1 is not of type 'string'); "
        "patternProperties is checked after generation, not enforced while sampling"
    )
