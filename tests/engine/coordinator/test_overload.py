"""A replica whose waiting queue is full refuses with ``EngineOverloaded``, over frames too.

The fake replica is a few lines of Python speaking the frame protocol with raw msgpack (no
torch, no engine): it refuses every request as an engine with a full queue does.
"""

from __future__ import annotations

import sys

import pytest

from twostroke.engine import Coordinator, EngineOverloaded, SamplingParams
from twostroke.engine.coordinator import process

from .test_replica_client import RAW_WIRE

pytestmark = pytest.mark.anyio

MESSAGE = (
    "the waiting queue is full: 2 requests wait for admission and max_waiting_requests is 2; "
    "retry later"
)

FULL_REPLICA = (
    RAW_WIRE
    + rf"""
for frame in frames():
    if frame[0] == "start":
        send("ready", os.getpid(), "fake", 128)
    elif frame[0] == "add":
        send("rejected", frame[1], "EngineOverloaded", {MESSAGE!r})
    elif frame[0] == "shutdown":
        break
"""
)


async def test_a_process_replica_with_a_full_queue_refuses_with_engine_overloaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    command = [sys.executable, "-c", FULL_REPLICA]
    monkeypatch.setattr(process, "replica_command", lambda: command)
    async with Coordinator.open(replicas=1, placement="process", grace_period=0.1) as coordinator:
        with pytest.raises(EngineOverloaded, match=f"^{MESSAGE}$"):
            await coordinator.generate("x", SamplingParams(max_tokens=1))
        stats = coordinator.statistics()
        assert [replica.alive for replica in stats.replicas] == [True]  # only refused
        assert stats.num_open_requests == 0
        coordinator.check_invariants()
