"""Structured output over HTTP: response_format, structured_outputs, tools; their refusals."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import anyio
import httpx
import jsonschema
import pytest

from twostroke.engine.config import ServerConfig
from twostroke.engine.server.structured import MAX_TOOLS
from twostroke.states.constraints import MAX_CHOICES

from .conftest import OPENAI_STREAMS_ON_TRIO, served

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

CHAT = [{"role": "user", "content": "What is the weather in Oslo?"}]
# The toy writes random bytes where a string may hold anything: bound the city's length.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "toy", "messages": CHAT, "max_tokens": 64} | fields


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "toy", "prompt": "Weather:", "max_tokens": 64} | fields


async def test_response_format_and_structured_outputs_constrain_both_endpoints() -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER,
                                                            "strict": True}}  # fmt: skip
    async with served() as server:
        for path, body in [
            ("/v1/chat/completions", _chat(response_format=schema_format)),
            ("/v1/completions", _completion(response_format=schema_format, n=2)),
            ("/v1/chat/completions", _chat(structured_outputs={"json": WEATHER})),
            ("/v1/completions", _completion(structured_outputs={"json": json.dumps(WEATHER)})),
        ]:
            reply = await server.http.post(path, json=body)
            assert reply.status_code == 200, reply.text
            for choice in reply.json()["choices"]:
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                assert choice["finish_reason"] == "stop", text
                jsonschema.validate(json.loads(text), WEATHER)
        reply = await server.http.post(
            "/v1/chat/completions", json=_chat(response_format={"type": "json_object"})
        )
        assert isinstance(json.loads(reply.json()["choices"][0]["message"]["content"]), dict)
        for field, check in [
            ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
            ({"choice": ["yes", "no"]}, lambda t: t in {"yes", "no"}),
            ({"grammar": 'start: "a" "b"+'}, lambda t: re.fullmatch("ab+", t)),
            ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ]:
            reply = await server.http.post(
                "/v1/completions", json=_completion(structured_outputs=field, max_tokens=24)
            )
            text = reply.json()["choices"][0]["text"]
            assert check(text), (field, text)


async def test_a_constrained_stream_is_the_complete_answer_in_pieces() -> None:
    async with served() as server:
        stream = await server.client.chat.completions.create(
            model="toy", messages=CHAT, max_tokens=64, stream=True,  # type: ignore[arg-type]
            extra_body={"structured_outputs": {"json": WEATHER}},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    jsonschema.validate(json.loads(text), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_tool_choice_named_and_required_answer_tool_calls() -> None:
    async with served() as server:
        named = await server.http.post("/v1/chat/completions", json=_chat(
            tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=160,
        ))  # fmt: skip
        required = await server.http.post(
            "/v1/chat/completions",
            json=_chat(
                tools=TOOLS, tool_choice="required", n=4, max_tokens=200, parallel_tool_calls=False
            ),
        )
    choice = named.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for choice in required.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]  # one: parallel_tool_calls is false
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


NAMED = {"type": "function", "function": {"name": "get_weather"}}

#: (path, body fields, param, message, code)
REFUSALS: list[tuple[str, dict[str, Any], str, str, str | None]] = [
    ("chat", {"tool_choice": "required"}, "tools", "tool_choice 'required' needs tools", None),
    ("chat", {"tools": TOOLS, "tool_choice": NAMED | {"function": {"name": "nope"}}},
     "tool_choice", "tool_choice names function 'nope', which is not one of tools", None),
    ("chat", {"tools": TOOLS, "structured_outputs": {"regex": "a"}}, "tools",
     "one field only, got structured_outputs and tools: use response_format", None),
    ("chat", {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "function":
        {"name": "f", "arguments": "{}"}}]}]}, "messages",
     "messages[0].tool_calls is only for assistant messages, got role 'user'", None),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function":
        {"name": "f", "arguments": "{nope"}}]}]}, "messages",
     "messages[0].tool_calls[0].function.arguments must be JSON text, got '{nope'", None),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"id": "", "function":
        {"name": "f", "arguments": "{}"}}]}]}, "messages",
     "messages[0].tool_calls[0].id must be 1 to 256 characters, got 0", None),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function":
        {"name": "f g", "arguments": "{}"}}]}]}, "messages",
     "messages[0].tool_calls[0].function.name must be 1 to 64 letters", None),
    ("chat", {"messages": [{"role": "tool", "content": "sunny"}]}, "messages",
     "messages[0] of role 'tool' needs tool_call_id (the call it answers)", None),
    ("chat", {"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages",
     "messages[0].tool_call_id is only for tool messages, got role 'user'", None),
    ("chat", {"tools": [TOOLS[0]] * (MAX_TOOLS + 1), "tool_choice": "required"}, "tools",
     f"tools must hold <= {MAX_TOOLS}, got {MAX_TOOLS + 1}", None),
    ("chat", {"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"},
     "tools[1].function.name", "'get_weather' is not unique", None),
    ("chat", {"tools": [{"type": "function", "function": {"name": "a b"}}],
              "tool_choice": "required"}, "tools[0].function.name", "must be 1 to 64", None),
    ("completions", {"response_format": {"type": "json_object"},
                     "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "one field only, got response_format and structured_outputs", None),
    ("completions", {"response_format": {"type": "xml"}}, "response_format", "Invalid enum "
     "value 'xml'", None),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
     "response_format.json_schema", "needs json_schema.schema", None),
    ("completions", {"structured_outputs": {}}, "structured_outputs", "must set exactly one "
     "of json, regex, choice, grammar and json_object, got 0", None),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "got 2 (regex, choice)", None),
    ("completions", {"structured_outputs": {"choice": ["a"] * 2 + [str(i) for i in
                                                                    range(MAX_CHOICES)]}},
     "structured_outputs.choice", f"choices must hold <= {MAX_CHOICES} strings",
     "constraint_rejected"),
    ("completions", {"structured_outputs": {"regex": "a" * 5000}}, "structured_outputs.regex",
     "pattern must be <= 4096 characters long, got 5000", "constraint_rejected"),
    ("completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json",
     "schema is not valid JSON", "constraint_rejected"),
    ("completions", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "is not supported by this server", None),
    ("completions", {"guided_json": WEATHER}, "guided_json", "use structured_outputs", None),
    # llguidance raised ValueError on a lone surrogate, which ended the engine
    ("completions", {"structured_outputs": {"json": '{"type": "string", "description": '
                                                    '"\\ud800"}'}},
     "structured_outputs.json", "schema must be valid Unicode, got a lone surrogate "
     "'\\ud800' at /description", "constraint_rejected"),
    # the client's backend options would override the server's format
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "x-guidance": {"whitespace_pattern": "[ ]*"}}}}},
     "response_format.json_schema.schema", "schema must not hold x-guidance (the backend's "
     "options: the server sets them), got it at /x-guidance", "constraint_rejected"),
]  # fmt: skip

#: Refused by the backend once the engine compiles them: through the handle, still 400s.
BACKEND_REFUSALS: list[tuple[str, dict[str, Any], str, str]] = [
    ("completions", {"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex",
     "structured_outputs.regex: invalid regex: look-around, including look-ahead and "
     "look-behind, is not supported"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object", "$dynamicRef": "#node"}}}},
     "response_format.json_schema.schema",
     'response_format.json_schema.schema: Unimplemented keys: ["$dynamicRef"]'),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "integer", "minimum": 5, "maximum": 1}}}], "tool_choice": "required"}, "tools",
     "tools: the parameters of function 'f': failed to compile JSON schema: Unsatisfiable "
     "schema: minimum (5) is greater than maximum (1)"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "integer", "minimum": 5, "maximum": 1}}}], "tool_choice": NAMED | {
        "function": {"name": "f"}}}, "tools[0].function.parameters",
     "tools[0].function.parameters: the parameters of function 'f': failed to compile JSON "
     "schema: Unsatisfiable schema: minimum (5) is greater than maximum (1)"),
    ("completions", {"structured_outputs": {"grammar": "start: value"}},
     "structured_outputs.grammar",
     'structured_outputs.grammar: line 1, column 8: unknown name: "value"'),
    # llguidance raised ValueError on a 401-digit bound (a 515-byte body), which ended the
    # engine: every request after it failed
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "integer", "minimum": int("9" * 401)}}}], "tool_choice": NAMED | {
        "function": {"name": "f"}}}, "tools[0].function.parameters",
     "tools[0].function.parameters: the parameters of function 'f': failed to parse \"%json\": "
     "number out of range"),
    ("completions", {"structured_outputs": {"json": {"type": "integer",
                                                     "minimum": int("9" * 401)}}},
     "structured_outputs.json", "structured_outputs.json: number out of range at line 1 "
     "column 429"),
]  # fmt: skip


async def test_malformed_constraints_are_400s_naming_the_field_and_the_reason() -> None:
    async with served() as server:
        for path, fields, param, message, code in REFUSALS:
            body = (_chat if path == "chat" else _completion)(**fields)
            reply = await server.http.post(f"/v1/{path.replace('chat', 'chat/completions')}",
                                           json=body)  # fmt: skip
            assert reply.status_code == 400, (fields, reply.text)
            error = reply.json()["error"]
            assert error["param"] == param, (fields, error)
            assert message in error["message"], (fields, error)
            assert error["code"] == code, (fields, error)
        assert server.engine.submitted == []  # all refused from the body alone


@pytest.mark.parametrize("stream", [False, True])
async def test_a_constraint_the_backend_refuses_is_a_400_not_a_500(stream: bool) -> None:
    async with served() as server:
        for path, fields, param, message in BACKEND_REFUSALS:
            body = (_chat if path == "chat" else _completion)(**fields, stream=stream)
            reply = await server.http.post(f"/v1/{path.replace('chat', 'chat/completions')}",
                                           json=body)  # fmt: skip
            assert reply.status_code == 400, (fields, reply.text)
            assert reply.json()["error"] == {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": "constraint_rejected",
            }
        reply = await server.http.post("/v1/completions", json=_completion(max_tokens=2))
        assert reply.status_code == 200  # and serves on


async def test_a_constrained_stream_held_for_its_first_output_still_keeps_alive() -> None:
    """Keep-alive comments while the constraint compiles open the response; then the chunks."""
    async with served(server_config=ServerConfig(keepalive=0.001)) as server:
        body = _chat(structured_outputs={"choice": ["yes", "no"]}, stream=True)
        raw = b""
        async with server.http.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            async for chunk in reply.aiter_bytes():
                raw += chunk
    assert raw.endswith(b"data: [DONE]\n\n")
    events = [line[6:] for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    first, *rest = (json.loads(event)["choices"][0] for event in events)
    assert first["delta"] == {"role": "assistant", "content": ""}  # the opening comes first
    assert "".join(choice["delta"].get("content", "") for choice in rest) in {"yes", "no"}


async def test_requests_still_compiling_count_against_max_waiting_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--max-waiting-requests 2 refused none of 8 constrained requests compiling at once."""
    from twostroke.engine.structured import compiler

    gate, real = threading.Event(), compiler._compile

    def gated(*args: Any) -> Any:
        gate.wait(timeout=60)  # a bound, not a sleep: the test opens it
        return real(*args)

    monkeypatch.setattr(compiler, "_compile", gated)
    body = _completion(structured_outputs={"choice": ["yes", "no"]}, max_tokens=4)
    async with served(server_config=ServerConfig(max_waiting_requests=2)) as server:
        answers: list[httpx.Response] = []

        async def post() -> None:
            answers.append(await server.http.post("/v1/completions", json=body))

        async with anyio.create_task_group() as group:
            for _ in range(2):
                group.start_soon(post)
            await server.engine.wait_submitted(2)
            assert server.engine.statistics().num_waiting == 2  # both compiling
            refused = await server.http.post("/v1/completions", json=body)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "engine_overloaded"
            gate.set()
        assert [answer.status_code for answer in answers] == [200, 200]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_constraint_that_breaks_a_backend_limit_mid_output_is_a_400_naming_it(
    stream: bool,
) -> None:
    """It was a 500 "a step of this request failed", with no reason."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    body = _completion(structured_outputs={"json": wide}, max_tokens=8, stream=stream)
    async with served() as server:
        reply = await server.http.post("/v1/completions", json=body)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"] == {
            "message": "structured_outputs.json: the backend gave up at output token 1: a row "
            "of the parse reached 2407 Earley items, past max_items_in_row (2000)",
            "type": "invalid_request_error",
            "param": "structured_outputs.json",
            "code": "constraint_failed",
        }
        reply = await server.http.post("/v1/completions", json=_completion(max_tokens=2))
        assert reply.status_code == 200  # and serves on
