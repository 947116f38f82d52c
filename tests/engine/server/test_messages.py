"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` through the official ``anthropic``
client: text, streams (the SDK's helper and raw events), a tool round trip, stop sequences,
token counts, and Anthropic-shaped errors."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import pytest
from anthropic import AsyncAnthropic, DefaultAsyncHttpxClient

from twostroke.engine.config import ServerConfig
from twostroke.engine.errors import EngineOverloaded
from twostroke.engine.runners.toy import ToyRunner
from twostroke.engine.server.answer_events import Finished, TextDelta
from twostroke.engine.server.message_events import MessageDraft

from .conftest import API_KEY, CLIENT_TLS, OPENAI_STREAMS_ON_TRIO, http_client, served
from .scripted import ScriptedRunner

pytestmark = [
    pytest.mark.anyio,
    OPENAI_STREAMS_ON_TRIO,
    pytest.mark.filterwarnings(
        r"ignore:Async generator 'anthropic\..*' was garbage collected:ResourceWarning"
    ),
]

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Bergen"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
ANSWER = "It is mild in Oslo."


def agent(prompt: str) -> str:
    """A sentence and a call of the weather tool (the generic format), then, once the tool's
    result is in the prompt, the answer and a stop sequence's text after it."""
    if "12 degrees" in prompt:
        return ANSWER + " END and more"
    return f"Let me check. <tool_call>\n{CALL}\n</tool_call>"


def client(base_url: str, **options: Any) -> AsyncAnthropic:
    """The official client of a test server, without retries (a retry would hide a failure)."""
    options.setdefault("api_key", API_KEY)
    http = DefaultAsyncHttpxClient(verify=CLIENT_TLS)
    return AsyncAnthropic(base_url=base_url, max_retries=0, http_client=http, **options)


async def test_a_message_is_the_chat_answer_as_a_text_block_with_usage() -> None:
    async with served(runner=ToyRunner(eos_rate=0.1)) as server:
        async with client(server.base_url) as claude:
            message = await claude.messages.create(
                model="toy", max_tokens=64, system=[{"type": "text", "text": "Be brief."}],
                messages=[{"role": "user", "content": "Tell me about engines."}],
                # Sampling fields the SDK 2.x no longer names (newer models take none).
                extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
            )  # fmt: skip
        chat = await server.http.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Tell me about engines."}],
            "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 20})  # fmt: skip
        (prompt, params), (chat_prompt, chat_params) = server.engine.submitted
    assert (prompt, params) == (chat_prompt, chat_params)
    assert (message.type, message.role) == ("message", "assistant")
    assert message.id.startswith("msg_")
    answer = chat.json()["choices"][0]
    (block,) = message.content
    assert block.type == "text"
    assert block.text == answer["message"]["content"]  # the same seedless toy answers alike
    reason = {"stop": "end_turn", "length": "max_tokens"}[answer["finish_reason"]]
    assert (message.stop_reason, message.stop_sequence) == (reason, None)
    usage = chat.json()["usage"]
    assert message.usage.output_tokens == usage["completion_tokens"]
    cached = message.usage.cache_read_input_tokens or 0
    assert message.usage.input_tokens + cached == usage["prompt_tokens"]


async def test_max_tokens_ends_the_message_with_stop_reason_max_tokens() -> None:
    async with served(runner=ToyRunner(eos_rate=0.0)) as server, client(server.base_url) as c:
        message = await c.messages.create(
            model="toy", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_sequence_is_named_and_taken_off_the_text(stream: bool) -> None:
    history: list[Any] = [{"role": "user", "content": "12 degrees"}]
    async with served(runner=ScriptedRunner(agent)) as server, client(server.base_url) as c:
        if stream:
            async with c.messages.stream(model="toy", max_tokens=64, messages=history,
                                         stop_sequences=["nothing", " END"]) as events:  # fmt: skip
                texts = [text async for text in events.text_stream]
                message = await events.get_final_message()
            assert "".join(texts) == ANSWER
        else:
            message = await c.messages.create(model="toy", max_tokens=64, messages=history,
                                              stop_sequences=["nothing", " END"])  # fmt: skip
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " END")
    assert [block.text for block in message.content] == [ANSWER]  # type: ignore[union-attr]


async def test_a_stream_is_anthropics_event_sequence() -> None:
    async with served(runner=ToyRunner(eos_rate=0.1)) as server, client(server.base_url) as c:
        whole = await c.messages.create(
            model="toy", max_tokens=32, messages=[{"role": "user", "content": "Go"}]
        )
        raw = await c.messages.create(
            model="toy", max_tokens=32, messages=[{"role": "user", "content": "Go"}],
            stream=True,
        )  # fmt: skip
        events = [event async for event in raw]
        body = {"model": "toy", "max_tokens": 4, "messages": [{"role": "user", "content": "Go"}],
                "stream": True}  # fmt: skip
        async with server.http.stream("POST", "/v1/messages", json=body) as reply:
            lines = [line async for line in reply.aiter_lines() if line.startswith("event: ")]
    # The SDK drops ping events; the wire has one after message_start, as Anthropic's has.
    assert lines[:3] == ["event: message_start", "event: ping", "event: content_block_start"]
    assert lines[-1] == "event: message_stop"
    kinds = [event.type for event in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    text = "".join(event.delta.text for event in events if event.type == "content_block_delta")
    assert text == whole.content[0].text  # type: ignore[union-attr]
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason
    assert delta.usage.output_tokens == whole.usage.output_tokens
    assert events[0].message.usage.input_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_round_trip_tool_use_then_tool_result(stream: bool) -> None:
    async def create(c: AsyncAnthropic, messages: list[Any]) -> Any:
        if not stream:
            return await c.messages.create(model="toy", max_tokens=128, messages=messages,
                                           tools=TOOLS)  # fmt: skip
        async with c.messages.stream(model="toy", max_tokens=128, messages=messages,
                                     tools=TOOLS) as events:  # fmt: skip
            return await events.get_final_message()

    ask: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    async with served(runner=ScriptedRunner(agent)) as server, client(server.base_url) as c:
        first = await create(c, ask)
        text, call = first.content
        assert first.stop_reason == "tool_use"
        assert (text.type, text.text) == ("text", "Let me check. ")
        assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Oslo"})
        result = {"type": "tool_result", "tool_use_id": call.id,
                  "content": [{"type": "text", "text": "12 degrees"}]}  # fmt: skip
        history = [*ask, {"role": "assistant", "content": first.content},
                   {"role": "user", "content": [result]}]  # fmt: skip
        second = await create(c, history)
        (_, _), (prompt, _) = server.engine.submitted
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == ANSWER + " END and more"
    roles = [message["role"] for message in prompt]
    assert roles == ["system", "user", "assistant", "tool"]  # tools shown in the system turn
    assert json.loads(prompt[2]["content"].split("<tool_call>")[1].split("</tool_call>")[0]) \
        == json.loads(CALL)  # fmt: skip
    assert "12 degrees" in prompt[3]["content"]


async def test_tool_choice_tool_forces_a_call_of_that_tool() -> None:
    async with served() as server, client(server.base_url) as c:
        message = await c.messages.create(
            model="toy", max_tokens=128, tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": "Weather?"}],
        )  # fmt: skip
        ((_, params),) = server.engine.submitted
    assert params.constraint is not None
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather"
    assert call.input["city"] in ("Oslo", "Bergen")
    assert message.stop_reason == "tool_use"


async def test_count_tokens_counts_the_prompt_a_message_would_have() -> None:
    messages: list[Any] = [{"role": "user", "content": "How many tokens?"}]
    async with served() as server, client(server.base_url) as c:
        counted = await c.messages.count_tokens(
            model="toy", messages=messages, system="Be brief.", tools=TOOLS
        )
        with_tools = await server.http.post("/tokenize", json={"messages": [
            {"role": "system", "content": "Be brief."}, *messages]})  # fmt: skip
        message = await c.messages.create(model="toy", max_tokens=1, messages=messages,
                                          system="Be brief.", tools=TOOLS)  # fmt: skip
    assert counted.input_tokens > with_tools.json()["count"]  # the tools are in the prompt
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


async def test_a_missing_max_tokens_is_a_400_invalid_request_error() -> None:
    async with served() as server, client(server.base_url) as c:
        with pytest.raises(anthropic.BadRequestError, match="max_tokens") as caught:
            # Through the client's own POST: its messages.create needs max_tokens itself.
            body = {"model": "toy", "messages": [{"role": "user", "content": "Hi"}]}
            await c.post("/v1/messages", cast_to=anthropic.types.Message, body=body)
    body = caught.value.body
    assert body == {"type": "error", "error": {"type": "invalid_request_error",
                    "message": "Object missing required field `max_tokens`"}}  # fmt: skip


async def test_a_wrong_key_is_a_401_authentication_error_by_x_api_key() -> None:
    async with served() as server:
        body = {"model": "toy", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        async with http_client(server.base_url) as http:
            wrong = await http.post("/v1/messages", json=body, headers={"x-api-key": "sk-no"})
            right = await http.post("/v1/messages", json=body, headers={"x-api-key": API_KEY})
        async with client(server.base_url, api_key="sk-no") as c:
            with pytest.raises(anthropic.AuthenticationError, match="Incorrect API key"):
                await c.messages.create(**body)
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert wrong.json()["type"] == "error"
    assert right.status_code == 200, right.text


@pytest.mark.parametrize(("body", "status", "kind", "message"), [
    ({"model": "gpt", "max_tokens": 4}, 404, "not_found_error", "The model `gpt` does not exist"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens must be >= 1, got 0"),
    ({"max_tokens": 4, "temperature": 1.5}, 400, "invalid_request_error",
     r"temperature must be in \[0, 1.0\], got 1.5"),
    ({"max_tokens": 4, "stop_sequences": [""]}, 400, "invalid_request_error",
     "stop_sequences strings must be non-empty"),
    ({"max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools\\[0\\].type must be 'custom' or absent"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "messages\\[0\\].content\\[0\\]: a user message may hold text and tool_result blocks"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}, 400,
     "invalid_request_error", "no tool_use block with id 'toolu_1' comes before"),
    ({"max_tokens": 4, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, 400,
     "invalid_request_error", "tool_choice names function 'nope', which is not one of tools"),
])  # fmt: skip
async def test_refusals_are_anthropic_shaped(
    body: dict[str, Any], status: int, kind: str, message: str
) -> None:
    request = {"model": "toy", "messages": [{"role": "user", "content": "Hi"}], **body}
    async with served() as server:
        reply = await server.http.post("/v1/messages", json=request)
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert (error["type"], error["error"]["type"]) == ("error", kind)
    assert re.search(message, error["error"]["message"]), error


async def test_a_guard_refusal_and_a_body_too_large_are_anthropic_shaped() -> None:
    async with served(server_config=ServerConfig(max_body_bytes=1000)) as server:
        text = await server.http.post("/v1/messages", content=b"{}",
                                      headers={"content-type": "text/plain"})  # fmt: skip
        large = await server.http.post("/v1/messages", json={"pad": "x" * 2000})
        unknown = await server.http.post("/v1/messages/batches", json={})
    assert text.status_code == 415
    assert text.json()["error"]["type"] == "invalid_request_error"
    assert large.status_code == 413
    assert large.json() == {"type": "error", "error": {"type": "request_too_large",
                            "message": large.json()["error"]["message"]}}  # fmt: skip
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"


async def test_a_full_queue_is_a_529_overloaded_error() -> None:
    body = {"model": "toy", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    async with served() as server:
        server.engine.failure = EngineOverloaded("the waiting queue is full")
        reply = await server.http.post("/v1/messages", json=body)
        server.engine.failure = None
    assert reply.status_code == 529, reply.text
    assert reply.json()["error"]["type"] == "overloaded_error"


def test_a_draft_holds_back_a_stop_sequence_split_over_chunks() -> None:
    draft = MessageDraft("toy", ["</a>"])
    events = draft.begin()
    for piece in ["Hello </", "a", ">"]:
        events += draft.apply([TextDelta(piece)])
    events += draft.apply([Finished("stop")])
    events += draft.end()
    sent = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert sent == "Hello "
    assert (draft.stop_reason, draft.stop_sequence) == ("stop_sequence", "</a>")
