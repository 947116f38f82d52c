"""Realistic JSON schemas for structured-output workloads, with a valid output of each.

:data:`TOOL_CALL_SCHEMA` is what a chat client sends for tool calls: an OpenAI-style array of
calls with nested objects, enums, arrays, patterns, ``$defs``/``$ref`` and ``anyOf``. It is
the schema of scripts/structured_backends.py, which chose the backend by it
(docs/structured-output.md), and of the tests on SmolLM2's vocabulary.
:func:`bench_schema` is the schema of ``twostroke bench --structured-fraction``'s requests;
:data:`BENCH_TOOLS` are the tools ``twostroke bench --tools-fraction``'s requests offer.
"""

from __future__ import annotations

from typing import Any

from twostroke.states.validators import check_int_at_least

__all__ = ["BENCH_TOOLS", "TOOL_CALL_SAMPLE", "TOOL_CALL_SCHEMA", "bench_schema"]

#: The tools of ``twostroke bench --tools-fraction``'s requests (OpenAI's function objects):
#: two functions an assistant is typically given, with enums, a pattern and nested objects.
BENCH_TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Flights between two airports on a day",
            "parameters": {
                "type": "object",
                "properties": {
                    "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "date": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"},
                    "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["from", "to", "date"],
                "additionalProperties": False,
            },
        },
    },
)

#: An OpenAI-style tool call: nested objects, enums, arrays, a pattern, $defs and anyOf.
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool_calls": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^call_[A-Za-z0-9]{8}$"},
                    "type": {"const": "function"},
                    "function": {
                        "anyOf": [
                            {"$ref": "#/$defs/get_weather"},
                            {"$ref": "#/$defs/search_flights"},
                        ]
                    },
                },
                "required": ["id", "type", "function"],
                "additionalProperties": False,
            },
        },
        "reasoning": {"type": "string", "maxLength": 200},
    },
    "required": ["tool_calls"],
    "additionalProperties": False,
    "$defs": {
        "get_weather": {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string", "minLength": 1, "maxLength": 64},
                        "unit": {"enum": ["celsius", "fahrenheit", "kelvin"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                        "include_hourly": {"type": "boolean"},
                    },
                    "required": ["location", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        "search_flights": {
            "type": "object",
            "properties": {
                "name": {"const": "search_flights"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "passengers": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "properties": {
                                    "name": {"type": "string"},
                                    "age": {"type": "integer", "minimum": 0},
                                    "class": {"enum": ["economy", "business", "first"]},
                                },
                                "required": ["name", "class"],
                                "additionalProperties": False,
                            },
                        },
                        "max_price": {"type": "number", "minimum": 0},
                    },
                    "required": ["origin", "destination", "passengers"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    },
}

#: A valid output of :data:`TOOL_CALL_SCHEMA` (about 160 SmolLM2 tokens).
TOOL_CALL_SAMPLE: dict[str, Any] = {
    "tool_calls": [
        {
            "id": "call_A1b2C3d4",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": {
                    "location": "Reykjavík, Iceland",
                    "unit": "celsius",
                    "days": 3,
                    "include_hourly": False,
                },
            },
        },
        {
            "id": "call_Zz9Yy8Xx",
            "type": "function",
            "function": {
                "name": "search_flights",
                "arguments": {
                    "origin": "KEF",
                    "destination": "CDG",
                    "passengers": [
                        {"name": "Ada Lovelace", "age": 36, "class": "business"},
                        {"name": "Charles Babbage", "class": "economy"},
                    ],
                    "max_price": 1250.5,
                },
            },
        },
    ],
    "reasoning": "The user wants the weather in Reykjavik and a flight to Paris for two.",
}


def bench_schema(min_items: int) -> dict[str, object]:
    """The JSON schema of the bench's structured requests: a typed record whose list of
    keywords holds at least ``min_items`` entries.

    A record of the kind applications extract (a title, a rating, a flag, an enum and a list
    of strings, no other keys), so the matcher does the work a real schema gives it. Each
    keyword is at least 8 characters between quotes, and no token of a BPE vocabulary spans a
    quote, a comma and a word, so every keyword costs at least one token: with ``min_items``
    at least the request's ``max_tokens`` the output cannot complete first, and a constrained
    request generates exactly as many tokens as the same request unconstrained.

    Raises:
        ValueError: ``min_items`` < 1.
        TypeError: ``min_items`` is not an int.
    """
    check_int_at_least("min_items", min_items, 1)
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 80},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "recommended": {"type": "boolean"},
            "language": {"enum": ["en", "de", "fr", "other"]},
            "keywords": {
                "type": "array",
                "items": {"type": "string", "minLength": 8, "maxLength": 40},
                "minItems": min_items,
            },
        },
        "required": ["title", "rating", "recommended", "language", "keywords"],
        "additionalProperties": False,
    }
