"""A replica's side of the wire, in this process: ``serve`` over a pair of pipes."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs
import pytest

from twostroke.engine.coordinator.frames import (
    Accepted,
    Add,
    Call,
    Cancel,
    DefineConstraint,
    DeltaItem,
    Deltas,
    Failed,
    Finished,
    FinishedPart,
    ForgetConstraint,
    FrameDecoder,
    FrameError,
    FrameReader,
    FrameTooLarge,
    FromReplica,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    Start,
    StartFailed,
    Stats,
    WireConstraint,
    encode_frame,
)
from twostroke.engine.coordinator.replica_server import (
    FdReceiveStream,
    FdSendStream,
    delta_frames,
    finished_frames,
    serve,
)
from twostroke.engine.coordinator.wire_constraints import wire_constraint
from twostroke.states.constraints import Regex
from twostroke.states.params import SamplingParams

from ..conftest import toy_engine

pytestmark = pytest.mark.anyio

TOY = Start("toy", {"device": "cpu", "num_blocks": 64, "block_size": 4})
#: Room for one long request (that a cancel reaches long before it could finish).
BIG = Start("toy", {"device": "cpu", "num_blocks": 1024, "block_size": 4})


class Peer:
    """The coordinator's end of the pipes."""

    def __init__(self, send: FdSendStream, frames: FrameReader) -> None:
        self.send_stream = send
        self.frames = frames

    async def send(self, *frames: Any) -> None:
        await self.send_stream.send(b"".join(encode_frame(frame) for frame in frames))

    async def until(self, kind: type, request_id: int | None = None) -> list[Any]:
        """Frames up to and including the first ``kind`` (for ``request_id``); stats dropped."""
        seen = []
        async for frame in self.frames:
            if isinstance(frame, Stats):
                continue
            seen.append(frame)
            if getattr(frame, "request_id", request_id) != request_id:
                continue
            if isinstance(frame, kind):
                return seen
            assert not isinstance(frame, Rejected | Failed | Finished), (
                f"expected a {kind.__name__}, got {frame}"
            )
        raise AssertionError(f"the replica's output ended before a {kind.__name__}: {seen}")


@asynccontextmanager
async def replica() -> AsyncIterator[tuple[Peer, list[BaseException]]]:
    """A replica served in a task, and the coordinator's end; errors of ``serve`` collected."""
    to_replica = os.pipe()
    from_replica = os.pipe()
    errors: list[BaseException] = []

    async def run() -> None:
        try:
            await serve(FdReceiveStream(to_replica[0]), FdSendStream(from_replica[1]))
        except Exception as exc:
            errors.append(exc)
        finally:
            os.close(from_replica[1])  # the coordinator's end sees the output end

    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run)
            send = FdSendStream(to_replica[1])
            frames = FrameReader(FdReceiveStream(from_replica[0]), FromReplica, "replica 0")
            yield Peer(send, frames), errors
    finally:
        for fd in (*to_replica, from_replica[0]):
            with contextlib.suppress(OSError):  # a test may have closed its end already
                os.close(fd)


def params(**fields: Any) -> dict[str, Any]:
    return attrs.asdict(SamplingParams(**fields))


async def bare_output(prompt: str, sampling: SamplingParams) -> Any:
    async with toy_engine() as engine:
        return await engine.generate(prompt, sampling)


async def test_a_replica_serves_requests_in_frames_and_stops_when_told() -> None:
    sampling = SamplingParams(max_tokens=12, temperature=0, logprobs=1)
    expected = await bare_output("hello", sampling)
    async with replica() as (peer, errors):
        await peer.send(TOY)
        (ready,) = await peer.until(Ready)
        assert ready.pid == os.getpid()
        assert ready.model_name == "toy"
        await peer.send(Add(1, "hello", attrs.asdict(sampling)))
        frames = await peer.until(Finished, 1)
        assert frames[0] == Accepted(1, list(expected.prompt_token_ids))
        items = [item for frame in frames if isinstance(frame, Deltas) for item in frame.items]
        assert [i for item in items for i in item.token_ids] == list(expected.token_ids)
        assert "".join(item.text for item in items) == expected.text
        finished = frames[-1]
        assert (finished.token_ids, finished.text) == (list(expected.token_ids), expected.text)
        assert finished.finish_reason == expected.finish_reason.value
        assert len(finished.logprobs) == len(expected.token_ids)
        await peer.send(Add(2, "x" * 4095, params(max_tokens=4)))
        (rejected,) = await peer.until(Rejected, 2)
        assert rejected.kind == "RequestRejected"
        assert "max_model_len" in rejected.message
        numbers = (rejected.num_prompt_tokens, rejected.max_tokens, rejected.max_model_len)
        assert numbers == (4095, 4, 4096)
        await peer.send(Add(3, [300], params()))
        (rejected,) = await peer.until(Rejected, 3)
        assert rejected == Rejected(
            3, "ValueError", "prompt token ids must be in [0, 257), got 300 at index 0"
        )
        await peer.send(Call(0, "tokenize", "ab"), Call(1, "nonsense", None))
        replies = [(await peer.until(Reply))[-1] for _ in range(2)]  # calls run concurrently
        assert sorted(replies, key=lambda reply: reply.call_id) == [
            Reply(0, [97, 98], None, ""),
            Reply(1, None, "ValueError", "unknown replica call 'nonsense'"),
        ]
        await peer.send(Call(2, "wait_idle", None))
        idle = (await peer.until(Reply))[-1]
        assert idle.value["num_free_blocks"] == idle.value["num_blocks"] == 64
        await peer.send(Shutdown(cancel=False))
        assert [frame async for frame in peer.frames if not isinstance(frame, Stats)] == []
    assert errors == []


async def test_a_replica_compiles_the_constraint_a_request_names() -> None:
    async with replica() as (peer, errors):
        await peer.send(TOY)
        await peer.until(Ready)
        await peer.send(
            DefineConstraint(0, wire_constraint(Regex("[0-9]{3}-[a-z]"))),
            DefineConstraint(1, wire_constraint(Regex("(?<=a)b"))),
            DefineConstraint(2, WireConstraint("json", "[1]")),
            Add(1, "hi", params(), 0),
            Add(2, "hi", params(), 1),
            Add(3, "hi", params(), 2),
        )
        ends: dict[int, Any] = {}
        async for frame in peer.frames:  # the three end in any order
            if isinstance(frame, Finished | Failed | Rejected):
                ends[frame.request_id] = frame
                if len(ends) == 3:
                    break
        assert re.fullmatch("[0-9]{3}-[a-z]", ends[1].text)
        assert ends[1].finish_reason == "stop"
        assert ends[2] == Failed(
            2, "ConstraintRejected", "constraint.pattern: invalid regex: look-around, including "
            "look-ahead and look-behind, is not supported",
        )  # fmt: skip
        assert ends[3] == Rejected(3, "TypeError", "schema must be a JSON object, got list [1]")
        await peer.send(Shutdown(cancel=False))
    assert errors == []


async def test_a_cancel_that_overtakes_its_add_is_honoured_and_a_late_one_ignored() -> None:
    async with replica() as (peer, errors):
        await peer.send(BIG)
        await peer.until(Ready)
        await peer.send(Cancel(7), Add(7, "hello", params(max_tokens=8)))
        assert await peer.until(Failed, 7) == [
            Failed(7, "RequestCancelled", "request 7 was cancelled")
        ]
        await peer.send(Add(8, "hello", params(max_tokens=2, ignore_eos=True)))
        await peer.until(Finished, 8)
        await peer.send(Cancel(8), Add(9, "long", params(max_tokens=4000, ignore_eos=True)))
        await peer.until(Accepted, 9)
        await peer.send(Cancel(9))
        frames = await peer.until(Failed, 9)
        assert frames[-1] == Failed(9, "RequestCancelled", "request 9 was cancelled")
        await peer.send(Call(0, "wait_idle", None))
        idle = (await peer.until(Reply))[-1]
        assert idle.value["num_free_blocks"] == idle.value["num_blocks"]
        await peer.send(Shutdown(cancel=True))
    assert errors == []


async def test_end_of_input_cancels_open_requests_and_ends_the_replica() -> None:
    async with replica() as (peer, errors):
        await peer.send(BIG)
        await peer.until(Ready)
        await peer.send(Add(1, "long", params(max_tokens=4000, ignore_eos=True)))
        await peer.until(Accepted, 1)
        await peer.send_stream.aclose()
        os.close(peer.send_stream._fd)
        frames = await peer.until(Failed, 1)
        assert frames[-1] == Failed(1, "RequestCancelled", "request 1 was cancelled")
    assert errors == []


async def test_a_replica_that_cannot_start_says_why() -> None:
    async with replica() as (peer, errors):
        await peer.send(Start("toy", {"device": "cpu", "block_size": 0}))
        (failed,) = await peer.until(StartFailed)
        assert failed == StartFailed("ValueError", "block_size must be >= 1, got 0")
    assert errors == []


async def test_a_malformed_or_unexpected_frame_from_the_coordinator_ends_the_replica() -> None:
    async with replica() as (peer, errors):
        await peer.send_stream.send(b"\x00\x00\x00\x02\xc1\xc1")
    assert len(errors) == 1
    assert isinstance(errors[0], FrameError)
    assert str(errors[0]).startswith("malformed frame 0 from the coordinator (2 bytes): ")
    async with replica() as (peer, errors):
        await peer.send(Cancel(1))
    assert len(errors) == 1
    assert isinstance(errors[0], FrameError)
    assert str(errors[0]) == (
        "the first frame from the coordinator must be Start, got Cancel(request_id=1)"
    )
    async with replica() as (peer, errors):
        await peer.send(TOY, TOY)
        await peer.until(Ready)
    assert len(errors) == 1
    assert isinstance(errors[0], FrameError)
    assert str(errors[0]).startswith("unexpected frame from the coordinator: Start(")


def test_deltas_over_the_frame_limit_are_spread_over_frames_and_lose_nothing() -> None:
    limit = 256
    logprobs: list[Any] = [(i, -0.5, [(i, -0.5)]) for i in range(200)]
    long = DeltaItem(1, "é" * 150, list(range(200)), logprobs, "stop")
    short = [DeltaItem(r, "ab", [97, 98], None, None) for r in range(2, 40)]
    items = [long, *short]
    chunks = delta_frames(items, limit)
    assert len(chunks) > 5
    decoder: FrameDecoder[Any] = FrameDecoder(FromReplica, "replica 0", limit=limit)
    received = [item for chunk in chunks for frame in decoder.feed(chunk) for item in frame.items]
    joined: dict[int, list[DeltaItem]] = {}
    for item in received:
        joined.setdefault(item.request_id, []).append(item)
    assert list(joined) == [item.request_id for item in items]  # in order
    for item in items:
        parts = joined[item.request_id]
        assert "".join(part.text for part in parts) == item.text
        assert [i for part in parts for i in part.token_ids] == item.token_ids
        if item.logprobs is not None:
            assert [e for part in parts for e in part.logprobs or ()] == item.logprobs
        assert [part.finish_reason for part in parts] == [None] * (len(parts) - 1) + [
            item.finish_reason
        ]
    assert len(joined[1]) > 1
    # What fits goes in one frame, encoded once.
    assert delta_frames(short[:3], limit) == [encode_frame(Deltas(short[:3]))]


def test_a_finished_output_over_the_frame_limit_comes_in_parts() -> None:
    limit = 200
    finished = Finished(4, list(range(300)), "x" * 500, "length", 7, 0.5, 0, None, 2)
    chunks = finished_frames(finished, limit)
    decoder: FrameDecoder[Any] = FrameDecoder(FromReplica, "replica 0", limit=limit)
    frames = [frame for chunk in chunks for frame in decoder.feed(chunk)]
    *parts, last = frames
    assert parts
    assert all(isinstance(part, FinishedPart) and part.request_id == 4 for part in parts)
    assert isinstance(last, Finished)
    assert [i for frame in frames for i in frame.token_ids] == finished.token_ids
    assert "".join(frame.text for frame in frames) == finished.text
    assert (last.finish_reason, last.prompt_tokens, last.cached_prompt_tokens) == ("length", 7, 2)
    with pytest.raises(FrameTooLarge, match=r"^a one-token output frame of \d+ bytes is more"):
        finished_frames(finished, 20)


async def test_requests_name_a_constraint_defined_once_until_it_is_forgotten() -> None:
    fields = params(max_tokens=4)
    async with replica() as (peer, errors):
        await peer.send(TOY)
        await peer.until(Ready)
        await peer.send(
            DefineConstraint(0, WireConstraint("regex", "[0-9]{3}")),
            DefineConstraint(1, WireConstraint("json", "[1]")),  # each request naming it: refused
            Add(1, "hi", fields, 0),
            Add(2, "ho", fields, 0),
            Add(3, "hi", fields, 1),
            Add(4, "hi", fields, 7),
        )
        ends: dict[int, Any] = {}
        async for frame in peer.frames:
            if isinstance(frame, Finished | Failed | Rejected):
                ends[frame.request_id] = frame
                if len(ends) == 4:
                    break
        assert re.fullmatch("[0-9]{3}", ends[1].text)
        assert re.fullmatch("[0-9]{3}", ends[2].text)
        assert ends[3] == Rejected(3, "TypeError", "schema must be a JSON object, got list [1]")
        assert ends[4] == Rejected(4, "ValueError", "constraint 7 was never defined (or forgotten)")
        await peer.send(ForgetConstraint(0), Add(5, "hi", fields, 0))
        (*_, rejected) = await peer.until(Rejected, 5)
        assert rejected.message == "constraint 0 was never defined (or forgotten)"
        await peer.send(Shutdown(cancel=False))
    assert errors == []
