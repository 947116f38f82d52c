"""Stored responses through the official client: ``previous_response_id``, ``retrieve``,
``delete``, ``input_items.list``; the store's file surviving a restart, one API key's
responses hidden from another, and the store's bounds in count, bytes and age."""

from __future__ import annotations

import pathlib
import sqlite3
from typing import Any

import anyio
import attrs
import msgspec
import openai
import pytest

from twostroke.engine.config import ServerConfig
from twostroke.engine.runners.toy import ToyRunner
from twostroke.engine.server.response_store import MEMORY, ResponseStore, owner_of

from .conftest import OPENAI_STREAMS_ON_TRIO, served

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

MISSING = "resp_" + "0" * 32
#: A server whose responses are stored in memory.
STORE = ServerConfig(responses_store=MEMORY)


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def store(path: str = MEMORY, **bounds: Any) -> ResponseStore:
    limits = {"max_count": 100, "max_bytes": 10**7, "max_age": 3600.0} | bounds
    return ResponseStore(path, **limits)


@pytest.mark.parametrize("stream", [False, True])
async def test_previous_response_id_continues_the_stored_conversation(stream: bool) -> None:
    """The second turn's prompt is the first's input, its output, then the new input; the
    first's instructions are not carried over, as OpenAI's are not."""

    async def create(client: Any, **fields: Any) -> Any:
        if not stream:
            return await client.responses.create(model="toy", max_output_tokens=200, **fields)
        async with client.responses.stream(model="toy", max_output_tokens=200, **fields) as events:
            return await events.get_final_response()

    async with served(runner=ToyRunner(eos_rate=0.2), server_config=STORE) as server:
        first = await create(server.client, input="Hello", instructions="Be brief.")
        second = await create(server.client, input="And then?", previous_response_id=first.id)
        (_, _), (prompt, _) = server.engine.submitted
        assert first.store is True
        assert second.previous_response_id == first.id
        assert prompt == [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ]
        again = await server.client.responses.retrieve(second.id)
        # The stream's final response is the SDK's ParsedResponse, whose output parts have
        # a `parsed` field of their own: compared without them.
        assert again.model_dump(exclude={"output"}) == second.model_dump(exclude={"output"})
        assert again.output_text == second.output_text
        items = await server.client.responses.input_items.list(second.id, order="asc")
        assert [(item.type, item.role) for item in items.data] == [  # type: ignore[union-attr]
            ("message", "user"), ("message", "assistant"), ("message", "user")]  # fmt: skip
        assert items.data[1].id == first.output[0].id


async def test_a_tool_call_output_continues_its_call_from_the_stored_response() -> None:
    """An agent's second turn sends only the call's output: its call is in the previous
    response's output."""
    tools: Any = [{"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}]  # fmt: skip
    async with served(runner=ToyRunner(eos_rate=0.1), server_config=STORE) as server:
        first = await server.client.responses.create(
            model="toy", input="Time?", tools=tools, tool_choice="required"
        )
        call = first.output[-1]
        assert call.type == "function_call"
        second = await server.client.responses.create(
            model="toy", max_output_tokens=4, previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "noon"}],
        )  # fmt: skip
        (_, _), (prompt, _) = server.engine.submitted
    assert second.status in ("completed", "incomplete")
    assert prompt[-1]["role"] == "tool"
    assert "noon" in prompt[-1]["content"]


async def test_input_items_are_paged_as_openai_lists_them() -> None:
    async with served(server_config=STORE) as server:
        items = [{"role": "user", "content": f"turn {index}"} for index in range(5)]
        response = await server.client.responses.create(
            model="toy", input=items, max_output_tokens=2
        )
        newest = await server.client.responses.input_items.list(response.id, limit=2)
        assert [item.content[0].text for item in newest.data] == ["turn 4", "turn 3"]  # type: ignore[union-attr]
        assert newest.has_more is True
        assert (newest.first_id, newest.last_id) == (newest.data[0].id, newest.data[1].id)
        rest = await server.client.responses.input_items.list(
            response.id, limit=100, after=newest.last_id
        )
        assert [item.content[0].text for item in rest.data] == ["turn 2", "turn 1", "turn 0"]  # type: ignore[union-attr]
        assert rest.has_more is False
        every = [item.id async for item in server.client.responses.input_items.list(
            response.id, limit=2, order="asc")]  # fmt: skip
        assert every == [item.id for item in (newest.data + rest.data)[::-1]]
        for query, param, message in [
            ("limit=0", "limit", "limit must be an integer from 1 to 100, got '0'"),
            ("limit=101", "limit", "limit must be an integer from 1 to 100, got '101'"),
            ("order=up", "order", "order must be 'asc' or 'desc', got 'up'"),
            ("after=x';--", "after", "after must be an item id"),
            (f"after=msg_{'a' * 32}", "after", "after names no input item of this response"),
        ]:
            reply = await server.http.get(f"/v1/responses/{response.id}/input_items?{query}")
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == param
            assert message in reply.json()["error"]["message"]


async def test_delete_removes_a_response_and_store_false_stores_nothing() -> None:
    async with served(server_config=STORE) as server:
        kept = await server.client.responses.create(model="toy", input="Hi", max_output_tokens=2)
        assert (await server.client.responses.delete(kept.id)) is None  # the SDK's answer
        with pytest.raises(openai.NotFoundError, match=f"No response found with id '{kept.id}'"):
            await server.client.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError, match="No response found"):
            await server.client.responses.delete(kept.id)
        unstored = await server.client.responses.create(
            model="toy", input="Hi", max_output_tokens=2, store=False
        )
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError, match="No response found"):
            await server.client.responses.retrieve(unstored.id)
        with pytest.raises(openai.BadRequestError, match="Previous response with id") as caught:
            await server.client.responses.create(
                model="toy", input="Hi", previous_response_id=unstored.id
            )
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.param == "previous_response_id"


#: Ids that must be refused for their shape before the database is asked.
HOSTILE_IDS = ["resp_1", "resp_" + "A" * 32, "resp_" + "0" * 33, "x" * 10_000,
               "resp_' OR 1=1 --", "msg_" + "0" * 32]  # fmt: skip


async def test_a_malformed_id_is_refused_before_the_database_is_asked(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "file").write_text("")  # a file where the store's folder would be
    refused = store(str(tmp_path / "file" / "responses.sqlite3"))
    async with served(serve_options={"response_store": refused}) as server:
        for wanted in HOSTILE_IDS:
            reply = await server.http.post("/v1/responses", json={
                "input": "Hi", "previous_response_id": wanted, "store": False})  # fmt: skip
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert (error["param"], error["code"]) == ("previous_response_id", "invalid_value")
            assert "must be 'resp_' and 32 lowercase hex digits" in error["message"]
            for method in ("GET", "DELETE"):
                reply = await server.http.request(method, f"/v1/responses/{wanted}")
                assert reply.status_code in (400, 404), reply.text  # a '/' is another route
                if reply.status_code == 400:
                    assert reply.json()["error"]["param"] == "response_id"
        # A well-formed id does reach the store, which cannot open: a 500 that says so.
        reply = await server.http.get(f"/v1/responses/{MISSING}")
        assert reply.status_code == 500
        assert reply.json()["error"]["code"] == "response_store_failed"
        assert server.engine.submitted == []


async def test_a_response_survives_a_restart_on_the_same_file(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "state" / "responses.sqlite3")
    config = ServerConfig(responses_store=path)
    async with served(server_config=config) as server:
        first = await server.client.responses.create(model="toy", input="Hi", max_output_tokens=3)
    async with served(server_config=config) as server:  # a new server, a new engine
        again = await server.client.responses.retrieve(first.id)
        second = await server.client.responses.create(
            model="toy", input="More", max_output_tokens=3, previous_response_id=first.id
        )
        (prompt, _), = server.engine.submitted  # fmt: skip
    assert again.model_dump() == first.model_dump()
    assert second.previous_response_id == first.id
    assert [message["content"] for message in prompt] == ["Hi", first.output_text, "More"]
    assert oct((await anyio.Path(path).stat()).st_mode & 0o777) == "0o600"


async def test_one_api_keys_responses_are_invisible_to_another(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    config = ServerConfig(responses_store=path)
    async with served(api_key="sk-alice", server_config=config) as server:
        alice = await server.client.responses.create(model="toy", input="Hi", max_output_tokens=2)
    for other in ("sk-bob", None):  # another key, and no key at all
        async with served(api_key=other, server_config=config) as server:
            with pytest.raises(openai.NotFoundError, match="No response found"):
                await server.client.responses.retrieve(alice.id)
            with pytest.raises(openai.NotFoundError, match="No response found"):
                await server.client.responses.input_items.list(alice.id)
            with pytest.raises(openai.NotFoundError, match="No response found"):
                await server.client.responses.delete(alice.id)
            with pytest.raises(openai.BadRequestError, match="Previous response with id"):
                await server.client.responses.create(
                    model="toy", input="Hi", previous_response_id=alice.id
                )
    async with served(api_key="sk-alice", server_config=config) as server:
        assert (await server.client.responses.retrieve(alice.id)).id == alice.id
    # The key itself is nowhere in the file, only its hash.
    with sqlite3.connect(path) as db:
        owners = {owner for (owner,) in db.execute("SELECT owner FROM responses")}
    db.close()
    assert owners == {owner_of("sk-alice")}
    assert b"sk-alice" not in await anyio.Path(path).read_bytes()


async def test_the_oldest_response_is_evicted_past_the_count() -> None:
    async with served(
        server_config=ServerConfig(responses_store=MEMORY, responses_max_count=2)
    ) as server:
        made = [await server.client.responses.create(model="toy", input=f"{index}",
                                                     max_output_tokens=2)
                for index in range(3)]  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            await server.client.responses.retrieve(made[0].id)
        for response in made[1:]:
            assert (await server.client.responses.retrieve(response.id)).id == response.id


def response(number: int, size: int = 10) -> dict[str, Any]:
    return {"id": f"resp_{number:032x}", "output": [], "text": "x" * size}


async def test_the_store_evicts_the_oldest_past_its_bytes_and_refuses_one_too_large() -> None:
    size = len(msgspec.json.encode(response(0, 100))) + len(b"[]")  # each one's bytes
    kept = store(max_bytes=2 * size + size // 2)
    try:
        for number in range(4):
            assert await kept.put("", response(number, 100), [])
        present = [await kept.get("", response(number)["id"]) is not None for number in range(4)]
        assert present == [False, False, True, True]  # two fit, not three
        assert not await kept.put("", response(9, 3 * size), [])  # alone larger than the bound
        assert await kept.get("", response(9)["id"]) is None
        assert await kept.get("", response(3)["id"]) is not None  # nothing evicted for it
    finally:
        await kept.aclose()


async def test_a_response_past_its_age_is_gone_for_every_reader() -> None:
    clock = FakeClock()
    kept = ResponseStore(MEMORY, max_count=10, max_bytes=10**6, max_age=60.0, clock=clock)
    try:
        await kept.put("", response(1), [{"id": "msg_" + "1" * 32}])
        clock.now += 60.0
        assert await kept.get("", response(1)["id"]) is not None  # 60 s old: still kept
        clock.now += 0.5
        assert await kept.get("", response(1)["id"]) is None  # past its age, not yet dropped
        assert not await kept.delete("", response(1)["id"])
        await kept.put("", response(2), [])  # a write drops what has expired
        assert await kept.get("", response(2)["id"]) is not None
        clock.now -= 1000.0  # even a clock set back does not bring it back: it was dropped
        assert await kept.get("", response(1)["id"]) is None
    finally:
        await kept.aclose()


async def test_the_store_checks_its_bounds() -> None:
    with pytest.raises(ValueError, match="max_count must be >= 1, got 0"):
        store(max_count=0)
    with pytest.raises(ValueError, match="max_age must be > 0 seconds, got 0"):
        store(max_age=0)


async def test_a_stored_conversation_stays_pinned_for_its_next_turn() -> None:
    """A stored response's KV is pinned for ``responses_cache_ttl`` (its next turn prefills
    only its new input even after other traffic); one with ``store: false`` pins nothing, nor
    does a server configured with a ttl of 0."""
    ask = {"model": "toy", "input": "Tell me about the sea. " * 8, "max_output_tokens": 8}
    unpinned = attrs.evolve(STORE, responses_cache_ttl=0)
    for config, store, pins in (
        (STORE, False, False),
        (STORE, True, True),
        (unpinned, True, False),
    ):
        async with served(runner=ToyRunner(eos_rate=0), server_config=config) as server:
            first = await server.client.responses.create(store=store, **ask)
            engine = server.engine.engine
            with anyio.fail_after(20):
                await engine.wait_idle()
            assert (engine.statistics().num_pinned_blocks > 0) is pins
            if store:
                await server.client.responses.create(
                    model="toy", input="And then?", previous_response_id=first.id,
                    max_output_tokens=8,
                )  # fmt: skip
                (_, (_, params)) = server.engine.submitted
                assert params.cache_ttl == config.responses_cache_ttl
