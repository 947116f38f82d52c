"""The coordinator's side of a replica: a faulty replica fails only itself.

The fake replicas here are a few lines of Python that speak the frame protocol with raw
msgpack (no torch, no engine): they accept and finish every request at once, and misbehave
as the ``fault`` option of their ``Start`` frame says. The frame limit is tested against a
real toy replica served in this process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs
import pytest

from twostroke.engine import Coordinator, RequestRejected, SamplingParams
from twostroke.engine.coordinator import process
from twostroke.engine.coordinator.frames import MAX_FRAME_BYTES, Start, encoded_size
from twostroke.engine.coordinator.relay import ReplicaState, RequestRelay
from twostroke.engine.coordinator.replica_client import RemoteReplica
from twostroke.engine.coordinator.replica_server import FdReceiveStream, FdSendStream, serve
from twostroke.engine.coordinator.wire_outputs import wire_logprobs
from twostroke.engine.outputs import Delta
from twostroke.engine.statistics import EngineStatistics
from twostroke.states.constraints import Choice
from twostroke.states.routing import Router
from twostroke.states.statistics import zero

from ..conftest import toy_engine

pytestmark = pytest.mark.anyio

#: The start of a fake replica's program: ``send(*frame)`` and ``frames()``, the frame
#: protocol in raw msgpack over stdin and stdout (no torch, no engine).
RAW_WIRE = r"""
import os, msgspec

def send(*frame):
    body = msgspec.msgpack.encode(list(frame))
    os.write(1, len(body).to_bytes(4, "big") + body)

def frames():
    buffer = b""
    while chunk := os.read(0, 65536):
        buffer += chunk
        while len(buffer) >= 4 and len(buffer) >= 4 + int.from_bytes(buffer[:4], "big"):
            end = 4 + int.from_bytes(buffer[:4], "big")
            yield msgspec.msgpack.decode(buffer[4:end])
            buffer = buffer[end:]
"""

FAKE_REPLICA = (
    RAW_WIRE
    + r"""
options = {}
for frame in frames():
    if frame[0] == "start":
        options = frame[2]
        send("ready", os.getpid(), "fake", 128)
        if options.get("fault") == "stats":
            send("stats", options["stats"])
    elif frame[0] == "add":
        reason = "bogus" if options.get("fault") == "finish" else "length"
        send("accepted", frame[1], [1, 2])
        send("finished", frame[1], [7], "x", reason, 2, 0.0, 0, None, 0)
    elif frame[0] == "call":
        value = "garbage" if options.get("fault") == "reply" else options.get("stats", {})
        send("reply", frame[1], value, None, "")
    elif frame[0] == "shutdown":
        break
"""
)


@pytest.fixture
def fake_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    command = [sys.executable, "-c", FAKE_REPLICA]
    monkeypatch.setattr(process, "replica_command", lambda: command)


def newer_statistics() -> dict[str, Any]:
    """What a replica of a later version reports: every field of today, and one more."""
    values: dict[str, Any] = {
        field.name: list(start) if isinstance(start := zero(field), tuple) else 0
        for field in attrs.fields(EngineStatistics)
    }
    values.update(num_steps=3, num_blocks=64, forward_seconds=0.25, num_warp_drives=2)
    values["warp_drives"] = {"by_deck": [1, 2], "state": "engaged"}  # of another kind too
    return values


async def generate_four(coordinator: Coordinator) -> list[Any]:
    """Four requests (both replicas get some: the router rotates between equal loads)."""
    outputs: list[Any] = []

    async def one(prompt: str) -> None:
        outputs.append(await coordinator.generate(prompt, SamplingParams(max_tokens=1)))

    async with anyio.create_task_group() as task_group:
        for prompt in ("aaaa", "bbbb", "cccc", "dddd"):
            task_group.start_soon(one, prompt)
    return outputs


@pytest.mark.usefixtures("fake_replicas")
async def test_a_bad_value_in_a_well_formed_frame_fails_only_that_replica() -> None:
    options = [{}, {"fault": "finish"}]  # replica 1 finishes with a finish reason of "bogus"
    async with Coordinator.open(
        replicas=2, placement="process", grace_period=0.1, replica_options=options
    ) as coordinator:
        outputs = await generate_four(coordinator)
        # The request on replica 1 had no token when it failed: it moved to replica 0.
        assert [output.token_ids for output in outputs] == [(7,)] * 4
        stats = coordinator.statistics()
        assert [replica.alive for replica in stats.replicas] == [True, False]
        assert stats.num_resubmitted >= 1
        failure = stats.replicas[1].failure
        assert failure is not None
        assert "malformed frame" in failure
        assert "Invalid enum value 'bogus'" in failure
        coordinator.check_invariants()


@pytest.mark.usefixtures("fake_replicas")
async def test_any_error_while_handling_a_replicas_frame_fails_only_that_replica() -> None:
    options = [{"fault": "reply"}, {}]  # replica 0 answers wait_idle with no statistics
    async with Coordinator.open(
        replicas=2, placement="process", grace_period=0.1, replica_options=options
    ) as coordinator:
        await coordinator.wait_idle()
        stats = coordinator.statistics()
        assert [replica.alive for replica in stats.replicas] == [False, True]
        assert stats.replicas[0].failure is not None
        assert (
            "replica 0 sent a frame the coordinator could not handle (Reply): TypeError: "
            "statistics must be a mapping, got str"
        ) in stats.replicas[0].failure
        outputs = await generate_four(coordinator)
        assert [output.token_ids for output in outputs] == [(7,)] * 4


@pytest.mark.usefixtures("fake_replicas")
async def test_statistics_of_a_newer_replica_ignore_the_fields_this_version_lacks() -> None:
    options = [{"fault": "stats", "stats": newer_statistics()}] * 2
    async with Coordinator.open(
        replicas=2, placement="process", grace_period=0.1, replica_options=options
    ) as coordinator:
        await generate_four(coordinator)
        await coordinator.wait_idle()  # a Reply with the same statistics from each
        stats = coordinator.statistics()
        assert [replica.alive for replica in stats.replicas] == [True, True]
        assert stats.num_steps == 6
        assert stats.num_blocks == 128
        assert stats.forward_seconds == 0.5
        engine = stats.replicas[0].engine
        assert engine is not None
        assert not hasattr(engine, "num_warp_drives")


#: A frame limit small enough that a few tokens with logprobs overflow it, and above the
#: replica's statistics (a Stats frame: about 640 bytes).
LIMIT = 1024


class CountingSendStream(FdSendStream):
    """The coordinator's end of the pipe to the replica, counting the bytes it sends."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.num_bytes = 0

    async def send(self, item: bytes) -> None:
        self.num_bytes += len(item)
        await super().send(item)


@asynccontextmanager
async def wired(
    limit: int, sent: list[CountingSendStream] | None = None
) -> AsyncIterator[tuple[RemoteReplica, RequestRelay]]:
    """A toy replica served in this process, and the coordinator's side of its pipes (the
    stream it sends on appended to ``sent``)."""
    to_replica, from_replica = os.pipe(), os.pipe()
    states: list[ReplicaState] = []
    relay = RequestRelay(Router(1), states, on_death=lambda: None)
    start = Start("toy", {"device": "cpu", "num_blocks": 1024, "block_size": 4})
    replica = RemoteReplica(0, relay, start, max_frame_bytes=limit)
    states.append(ReplicaState(replica))

    async def replica_side() -> None:
        try:
            receive = FdReceiveStream(to_replica[0])
            await serve(receive, FdSendStream(from_replica[1]), max_frame_bytes=limit)
        finally:
            os.close(from_replica[1])  # the coordinator's side sees the output end

    async def coordinator_side() -> None:
        receive = FdReceiveStream(from_replica[0])
        send = CountingSendStream(to_replica[1])
        if sent is not None:
            sent.append(send)
        assert await replica.serve(receive, send) is None

    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(replica_side)
            task_group.start_soon(coordinator_side)
            await replica.ready.wait()
            yield replica, relay
            replica.close(cancel=True)
    finally:
        for fd in (*to_replica, from_replica[0]):
            os.close(fd)


async def test_output_longer_than_a_frame_arrives_whole_in_frames_within_the_limit() -> None:
    sampling = SamplingParams(max_tokens=240, ignore_eos=True, logprobs=5, temperature=0)
    prompts = [f"p{i}" for i in range(24)]
    async with toy_engine(num_blocks=1024) as engine:
        expected = [await engine.generate(prompt, sampling) for prompt in prompts]
    # Every output overflows one frame, and so do one step's deltas of all of them.
    assert all(encoded_size(wire_logprobs(out.logprobs)) > 4 * LIMIT for out in expected)
    async with wired(LIMIT) as (_, relay):
        handles = [relay.submit(prompt, sampling) for prompt in prompts]
        streamed: list[list[Delta]] = [[] for _ in handles]

        async def drain(index: int) -> None:
            async for delta in handles[index]:
                streamed[index].append(delta)

        async with anyio.create_task_group() as task_group:
            for index in range(len(handles)):
                task_group.start_soon(drain, index)
        outputs = [await handle.result() for handle in handles]
        assert relay.replicas[0].failure is None
    for output, deltas, bare in zip(outputs, streamed, expected, strict=True):
        assert (output.token_ids, output.text, output.logprobs) == (
            bare.token_ids,
            bare.text,
            bare.logprobs,
        )
        assert tuple(i for delta in deltas for i in delta.token_ids) == bare.token_ids
        assert "".join(delta.text for delta in deltas) == bare.text
        reasons = [delta.finish_reason for delta in deltas if delta.finish_reason is not None]
        assert reasons == [bare.finish_reason]


async def test_a_request_or_call_too_large_for_a_frame_is_refused_before_it_is_sent() -> None:
    async with wired(LIMIT) as (replica, relay):
        with pytest.raises(RequestRejected, match=r"too large to send to a replica: a Add frame"):
            relay.submit("x" * LIMIT, SamplingParams(max_tokens=1))
        assert not relay.open
        with pytest.raises(ValueError, match=r"^the tokenize argument is too large to send"):
            await replica.call("tokenize", "x" * LIMIT)
        # The replica refuses a reply over the limit (600 ids of 2 bytes each) in its stead.
        with pytest.raises(ValueError, match=r"^the reply does not fit: a Reply frame of \d+"):
            await replica.call("tokenize", "é" * 300)
        assert await replica.call("tokenize", "ab") == [97, 98]
        output = await relay.submit("hello", SamplingParams(max_tokens=3)).result()
        assert len(output.token_ids) == 3
        assert relay.replicas[0].failure is None


async def test_a_constraint_goes_to_a_replica_once_whatever_the_requests_naming_it() -> None:
    """A 2 MB choice with n=128 was 128 copies, one per choice's frame (541 MiB)."""
    choice = Choice([f"{i:03}" + "x" * 4_000 for i in range(30)])  # 120 KB
    sent: list[CountingSendStream] = []
    async with wired(MAX_FRAME_BYTES, sent) as (_, relay):
        (stream,) = sent
        sampling = SamplingParams(max_tokens=2, constraint=choice)
        before = stream.num_bytes
        handles = [relay.submit(f"p{i}", sampling) for i in range(16)]
        for handle in handles:
            text = (await handle.result()).text  # two tokens of one of the choices
            assert any(string.startswith(text) for string in choice.choices), text
        once = stream.num_bytes - before
        assert 120_000 < once < 2 * 120_000  # one copy and 16 small frames
        # All ended: the replica forgot it; the next request defines it again.
        before = stream.num_bytes
        text = (await relay.submit("again", sampling).result()).text
        assert any(string.startswith(text) for string in choice.choices), text
        assert stream.num_bytes - before > 120_000
        assert relay.replicas[0].failure is None
