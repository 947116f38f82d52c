"""Strict schemas over HTTP (ServerConfig.strict_schemas): a schema without
additionalProperties is closed by default, as sent when the server is told so."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from twostroke.engine.config import ServerConfig

from .conftest import OPENAI_STREAMS_ON_TRIO, served
from .scripted import ScriptedRunner

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

#: As LangChain's bind_tools sends a model with extra="forbid": no additionalProperties.
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
#: What SmolLM2 wrote (issue 36): a key of its own after the required ones.
EXTRA = '{"city": "Oslo", "unit": "celsius", "description": "around the recent upsurge"}'
#: The same as a call in the generic tool format (the toy's template has none of its own).
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {EXTRA}}}\n</tool_call>'


def _bodies() -> list[dict[str, Any]]:
    chat = {"model": "toy", "messages": [{"role": "user", "content": "Oslo?"}], "max_tokens": 200}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    return [chat | {"response_format": fmt}, chat | {"tools": tools, "tool_choice": named}]


def _output(reply: dict[str, Any]) -> dict[str, Any]:
    message = reply["choices"][0]["message"]
    text = message["content"] or message["tool_calls"][0]["function"]["arguments"]
    value: dict[str, Any] = json.loads(text)
    return value


@pytest.mark.parametrize("strict", [True, False])
async def test_a_schema_without_additional_properties_is_closed_unless_told(
    strict: bool,
) -> None:
    runner = ScriptedRunner(lambda prompt: CALL if "get_weather" in prompt else EXTRA)
    async with served(runner=runner, server_config=ServerConfig(strict_schemas=strict)) as server:
        for body in _bodies():
            reply = await server.http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            output = _output(reply.json())
            jsonschema.validate(output, WEATHER)  # the schema as sent, either way
            if strict:
                assert output == {"city": "Oslo", "unit": "celsius"}
            else:
                assert output == json.loads(EXTRA)


def test_the_flag_parses_true_and_false() -> None:
    from twostroke.engine.config import parse_server_limit

    assert ServerConfig().strict_schemas is True
    assert parse_server_limit("strict_schemas", "false") is False
    assert parse_server_limit("strict_schemas", "True") is True
    with pytest.raises(ValueError, match=r"^strict_schemas must be true or false, got 'no'$"):
        parse_server_limit("strict_schemas", "no")
    with pytest.raises(TypeError, match=r"^strict_schemas must be a bool, got int 1$"):
        ServerConfig(strict_schemas=1)  # type: ignore[arg-type]
