"""The typed middle of ``/v1/responses`` and ``/v1/messages``: answer events read from an
output however it is cut, folded by each endpoint's draft into the same answer whole or
streamed through its writer, and errors born naming the endpoint's own fields."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.engine.server.answer_events import AnswerEvent, AnswerReader, Usage
from twostroke.engine.server.event_writer import EventWriter
from twostroke.engine.server.message_events import PING, MessageDraft
from twostroke.engine.server.response_events import ResponseDraft
from twostroke.engine.server.structured import ToolCalls
from twostroke.engine.tools.formats import GENERIC

from .conftest import served

pytestmark = [pytest.mark.anyio]

CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
#: An output in the generic format: a sentence, then two calls.
OUTPUT = f"Let me check. <tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>"
WEATHER_TOOL = {"type": "object", "properties": {"city": {"type": "string"}}}


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


def _streamed(text: str, cuts: list[int], reason: str) -> list[AnswerEvent]:
    reader = AnswerReader(ToolCalls(GENERIC))
    pieces = _pieces(text, cuts) or [""]
    events: list[AnswerEvent] = []
    for piece in pieces[:-1]:
        events += reader.read(piece)
    return [*events, *reader.read(pieces[-1], reason)]


def _without_ids(value: Any) -> Any:
    """``value`` less the ids the server makes (items', calls' and blocks')."""
    if isinstance(value, list):
        return [_without_ids(item) for item in value]
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "call_id")}
    return value


@given(cuts=st.lists(st.integers(0, len(OUTPUT)), max_size=8),
       end=st.integers(0, len(OUTPUT)), reason=st.sampled_from(["stop", "length"]))  # fmt: skip
def test_an_output_cut_anywhere_folds_into_the_whole_outputs_answer(
    cuts: list[int], end: int, reason: str
) -> None:
    """However the engine's deltas cut an output (even inside a call, by the token limit),
    the events read piece by piece fold into the Response and the Message that the events
    read from the whole output fold into."""
    text = OUTPUT[:end]
    whole = AnswerReader(ToolCalls(GENERIC)).read(text, reason)
    streamed = _streamed(text, cuts, reason)
    assert [type(event) for event in streamed if not hasattr(event, "text")] == [
        type(event) for event in whole if not hasattr(event, "text")
    ]
    for make in (lambda: ResponseDraft("toy", {}), lambda: MessageDraft("toy")):
        one, other = make(), make()
        for event in streamed:
            one.apply([event])
        other.apply(whole)
        one.end()
        other.end()
        answer = one.response() if isinstance(one, ResponseDraft) else one.message()
        expected = other.response() if isinstance(other, ResponseDraft) else other.message()
        assert _without_ids(answer) == _without_ids(expected)


class _Client:
    """An ASGI ``send`` that keeps what the writer sends, as the named events it holds."""

    def __init__(self) -> None:
        self.body = b""
        self.ended = False

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.body":
            self.body += message["body"]
            self.ended = not message.get("more_body", False)

    def events(self) -> list[dict[str, Any]]:
        events = []
        for block in self.body.decode().split("\n\n"):
            if not block or block.startswith(":"):  # a keep-alive comment
                continue
            kind, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            events.append(event)
        return events


@pytest.mark.parametrize("cuts", [[], [3, 20, 40, 77, 90], list(range(0, len(OUTPUT), 2))])
async def test_the_streamed_writer_sends_what_the_whole_answers_fold_holds(
    cuts: list[int],
) -> None:
    """The last Responses event carries the Response, and the Messages events rebuild the
    Message, that folding the whole output's events gives."""
    usage = Usage(prompt_tokens=12, completion_tokens=30, cached_tokens=4)
    whole = [*AnswerReader(ToolCalls(GENERIC)).read(OUTPUT, "stop"), usage]
    streamed = [*_streamed(OUTPUT, cuts, "stop"), usage]

    folded = ResponseDraft("toy", {})
    folded.apply(whole)
    folded.end()
    client = _Client()
    writer = EventWriter(client, ResponseDraft("toy", {}))
    await writer.open()
    for event in streamed:
        await writer.write([event])
    await writer.keepalive()
    await writer.close()
    events = client.events()
    assert client.ended
    assert events[-1]["type"] == "response.completed"
    assert _without_ids(events[-1]["response"]) == _without_ids(
        folded.response() | {"created_at": events[-1]["response"]["created_at"]}
    )

    message = MessageDraft("toy")
    message.apply(whole)
    message.end()
    client = _Client()
    writer = EventWriter(client, MessageDraft("toy"), ping=PING)
    await writer.open()
    for event in streamed:
        await writer.write([event])
    await writer.close()
    events = client.events()
    blocks: dict[int, dict[str, Any]] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
            blocks[event["index"]]["text"] += event["delta"]["text"]
        elif event["type"] == "content_block_delta":
            block = blocks[event["index"]]
            block["partial"] = block.get("partial", "") + event["delta"]["partial_json"]
    for block in blocks.values():
        if "partial" in block:
            block["input"] = json.loads(block.pop("partial"))
    expected = message.message()
    assert _without_ids([blocks[index] for index in sorted(blocks)]) == _without_ids(
        expected["content"]
    )
    assert events[-2]["usage"] == expected["usage"]
    assert events[-2]["delta"]["stop_reason"] == expected["stop_reason"] == "tool_use"


async def test_an_error_names_the_endpoints_field_and_quotes_the_clients_words() -> None:
    """Errors are born in the endpoint's words: a client's own word that looks like a chat
    field (a function named ``stop`` or ``messages``) is quoted as sent, not renamed."""
    question = [{"role": "user", "content": "Hi"}]
    unsatisfiable = {"type": "integer", "minimum": 5, "maximum": 1}
    async with served() as server:
        messages = await server.http.post("/v1/messages", json={
            "model": "toy", "max_tokens": 4, "messages": question,
            "tools": [{"name": "get_weather", "input_schema": WEATHER_TOOL}],
            "tool_choice": {"type": "tool", "name": "stop"}})  # fmt: skip
        responses = await server.http.post("/v1/responses", json={
            "input": "Hi", "max_output_tokens": 4,
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL}],
            "tool_choice": {"type": "function", "name": "messages"}})  # fmt: skip
        schema = await server.http.post("/v1/messages", json={
            "model": "toy", "max_tokens": 4, "messages": question,
            "tools": [{"name": "count", "input_schema": unsatisfiable}],
            "tool_choice": {"type": "tool", "name": "count"}})  # fmt: skip
        stop = await server.http.post("/v1/messages", json={
            "model": "toy", "max_tokens": 4, "messages": question,
            "stop_sequences": ["x", ""]})  # fmt: skip
    assert messages.status_code == 400, messages.text
    assert messages.json()["error"]["message"] == (
        "tool_choice names function 'stop', which is not one of tools (get_weather)"
    )
    assert responses.status_code == 400, responses.text
    assert responses.json()["error"] == {
        "message": "tool_choice names function 'messages', which is not one of tools (get_weather)",
        "type": "invalid_request_error",
        "param": "tool_choice",
        "code": None,
    }
    assert schema.status_code == 400, schema.text
    assert schema.json()["error"]["message"].startswith("tools[0].input_schema: ")
    assert stop.status_code == 400, stop.text
    assert stop.json()["error"]["message"].startswith("stop_sequences strings must be non-empty")
