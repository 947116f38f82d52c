"""The coordinator's side of a replica: a faulty replica fails only itself.

The replicas here are a few lines of Python that speak the frame protocol with raw msgpack
(no torch, no engine): they accept and finish every request at once, and misbehave as the
``fault`` option of their ``Start`` frame says.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio
import attrs
import pytest

from twostroke.engine import Coordinator, SamplingParams
from twostroke.engine.coordinator import process
from twostroke.engine.statistics import EngineStatistics

pytestmark = pytest.mark.anyio

FAKE_REPLICA = r"""
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
        send("reply", frame[1], options.get("stats", {}), None, "")
    elif frame[0] == "shutdown":
        break
"""


@pytest.fixture
def fake_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    command = [sys.executable, "-c", FAKE_REPLICA]
    monkeypatch.setattr(process, "replica_command", lambda: command)


def newer_statistics() -> dict[str, Any]:
    """What a replica of a later version reports: every field of today, and one more."""
    values: dict[str, Any] = {field.name: 0 for field in attrs.fields(EngineStatistics)}
    values.update(num_steps=3, num_blocks=64, forward_seconds=0.25, num_warp_drives=2)
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
