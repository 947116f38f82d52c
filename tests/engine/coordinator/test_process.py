"""Process replicas: real children for the end-to-end test, tiny fake ones for the failures.

A real replica child imports torch (seconds), so one test does all that needs real ones:
bit-identical outputs, an asynchronous rejection, a cancellation storm, and a SIGKILL
mid-stream. The lifecycle failures (a child that ignores shutdown, writes garbage, stops
mid-frame, or dies at start) use a few lines of Python that write prepared bytes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tracemalloc
from typing import Any

import anyio
import pytest

from twostroke.engine import (
    Choice,
    ConstraintRejected,
    Coordinator,
    EngineDead,
    FinishReason,
    Regex,
    ReplicaFailed,
    RequestCancelled,
    RequestOutput,
    RequestRejected,
    SamplingParams,
)
from twostroke.engine.coordinator import process
from twostroke.engine.coordinator.frames import Ready, encode_frame

from .test_local import bare_outputs, comparable, workload
from .test_replica_client import FAKE_REPLICA

pytestmark = pytest.mark.anyio

#: A pool with room for long requests (the toy's outputs do not depend on the pool).
POOL = {"device": "cpu", "num_blocks": 4096, "block_size": 4}
#: The end-to-end test's grace period: the one timer a dead child's requests could wait on
#: (a supervisor that stopped a failed child as it stops a live one), far longer than the
#: default, so that waiting on it and noticing the death at once are seconds apart.
GRACE_PERIOD = 60.0


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_process_replicas_serve_cancel_and_survive_a_sigkill() -> None:
    requests = workload(12)
    expected = await bare_outputs(requests)
    long = SamplingParams(max_tokens=4000, ignore_eos=True)
    async with Coordinator.open(
        model="toy", replicas=2, placement="process", grace_period=GRACE_PERIOD, **POOL
    ) as c:
        pids = [replica.pid for replica in c.statistics().replicas]
        assert all(pid is not None and not gone(pid) for pid in pids)

        # Outputs equal a bare engine's, bit for bit.
        outputs: list[RequestOutput | None] = [None] * len(requests)

        async def one(index: int) -> None:
            outputs[index] = await c.generate(*requests[index])

        async with anyio.create_task_group() as task_group:
            for index in range(len(requests)):
                task_group.start_soon(one, index)
        assert [comparable(o) for o in outputs if o] == [comparable(o) for o in expected]

        # The replica rejects a prompt too long for the context: the same error, later.
        # (A byte a token: max_model_len characters fit the text bound, not the context.)
        too_long = "x" * c.max_model_len
        handle = c.submit(too_long, SamplingParams(max_tokens=4))
        with pytest.raises(RequestRejected, match="must be <= max_model_len") as rejected:
            await handle.result()
        numbers = rejected.value.num_prompt_tokens, rejected.value.max_tokens
        assert (*numbers, rejected.value.max_model_len) == (len(too_long), 4, c.max_model_len)
        with pytest.raises(RequestRejected, match="must be <= max_model_len"):
            async with c.stream(too_long, SamplingParams(max_tokens=4)):
                raise AssertionError("a rejected request must not stream")

        # A constraint crosses the wire; the replica compiles it, and its refusal comes back.
        answer = await c.generate("pick", SamplingParams(constraint=Choice(["yes", "no"])))
        assert (answer.text, str(answer.finish_reason)) in {("yes", "stop"), ("no", "stop")}
        with pytest.raises(ConstraintRejected, match=r"^constraint\.pattern: invalid regex: "):
            await c.generate("hi", SamplingParams(constraint=Regex("(?<=a)b")))

        # A cancellation storm: every way to cancel, then no block is held anywhere.
        async def cancelled(way: int) -> None:
            handle = c.submit(f"storm {way}", long)
            if way % 3 == 1:
                await handle.next_delta()
            elif way % 3 == 2:
                async with c.stream(f"storm {way}", long) as deltas:
                    await deltas.next_delta()
            handle.cancel()
            with pytest.raises(RequestCancelled):
                await handle.result()

        async with anyio.create_task_group() as task_group:
            for way in range(24):
                task_group.start_soon(cancelled, way)
        await c.wait_idle()
        for replica in c.statistics().replicas:
            assert replica.engine is not None
            assert replica.engine.num_free_blocks == replica.engine.num_blocks
            assert replica.engine.num_open_requests == 0

        # SIGKILL one replica mid-stream: only its requests fail, as soon as its pipe ends.
        prompts = [f"stream {i}" for i in range(6)]
        streams = [c.submit(prompt, long) for prompt in prompts]
        for handle in streams:
            await handle.next_delta()
        replica_of = [c._relay.open[handle.request_id].replica for handle in streams]
        on_zero = [h for h, r in zip(streams, replica_of, strict=True) if r == 0]
        on_one = [h for h, r in zip(streams, replica_of, strict=True) if r == 1]
        assert on_zero
        assert on_one
        # Same prompt as a stream on replica 0: prefix affinity sends it there, and it is
        # still in the outbox (no checkpoint since) when the replica is killed.
        fresh = c.submit(prompts[replica_of.index(0)], SamplingParams(max_tokens=1))
        assert c._relay.open[fresh.request_id].replica == 0
        os.kill(pids[0], signal.SIGKILL)
        killed = anyio.current_time()
        for handle in on_zero:
            with pytest.raises(ReplicaFailed, match=r"replica 0 failed: .*signal SIGKILL"):
                await handle.result()
        elapsed = anyio.current_time() - killed
        print(f"SIGKILL to ReplicaFailed of {len(on_zero)} streams: {elapsed * 1000:.0f} ms")
        # Noticed at the pipe's end, not after a timer: tens of milliseconds on a quiet
        # machine, 1,024 ms once under load (this bound was 1 s then). A supervisor that
        # waited out the grace period would take GRACE_PERIOD (60 s) or more; half of it
        # leaves a margin of 30 times the slowest seen for a machine busy on both cores.
        assert elapsed < GRACE_PERIOD / 2
        # It had no token when its replica died: resubmitted to the survivor.
        assert (await fresh.result()).usage.completion_tokens == 1
        for handle in on_one:
            await handle.next_delta()  # the survivor keeps serving
            handle.cancel()
        stats = c.statistics()
        assert [r.alive for r in stats.replicas] == [False, True]
        assert stats.num_resubmitted >= 1
        after = await c.generate("after the kill", SamplingParams(max_tokens=5))
        assert after.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert all(gone(pid) for pid in pids if pid is not None)


FAKE_CHILD = """
import os, sys, time
os.write(1, bytes.fromhex(sys.argv[1]))
if sys.argv[2] == "exit":
    print("boom: the replica could not start", file=sys.stderr)
    sys.exit(3)
if sys.argv[2] == "hang":
    time.sleep(60)
"""


def fake_children(monkeypatch: pytest.MonkeyPatch, output: bytes, mode: str) -> None:
    """Replica children that write ``output`` and then exit (or hang, ignoring input)."""
    command = [sys.executable, "-c", FAKE_CHILD, output.hex(), mode]
    monkeypatch.setattr(process, "replica_command", lambda: command)


READY = encode_frame(Ready(pid=0, model_name="fake", max_model_len=128))


def pids_of(coordinator: Coordinator) -> list[int]:
    return [replica.pid for replica in coordinator.statistics().replicas if replica.pid]


async def test_a_child_that_ignores_shutdown_is_killed_after_the_grace_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_children(monkeypatch, READY, "hang")
    async with Coordinator.open(replicas=2, placement="process", grace_period=0.1) as c:
        assert c.model_name == "fake"
        pids = pids_of(c)
        assert len(pids) == 2
    assert all(gone(pid) for pid in pids)


async def test_cancelling_the_block_reaps_every_child(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_children(monkeypatch, READY, "hang")
    pids: list[int] = []
    with anyio.CancelScope() as scope:
        async with Coordinator.open(replicas=2, placement="process", grace_period=0.1) as c:
            pids = pids_of(c)
            scope.cancel()
            await anyio.sleep_forever()
    assert len(pids) == 2
    assert all(gone(pid) for pid in pids)


@pytest.mark.parametrize(
    ("output", "mode", "message"),
    [
        (
            READY + b"\x00\x00\x00\x05hello",
            "hang",
            r"malformed frame 1 from replica 0 \(5 bytes\)",
        ),
        (
            READY + b"\x00\x00\x00\x10abc",
            "end",
            r"truncated frame 1 from replica 0: the stream ended after 3 of its 16 bytes; "
            r"its process \d+ ended with exit code 0",
        ),
    ],
    ids=["malformed", "truncated"],
)
async def test_bad_output_fails_the_replica_with_what_was_wrong(
    monkeypatch: pytest.MonkeyPatch, output: bytes, mode: str, message: str
) -> None:
    fake_children(monkeypatch, output, mode)
    with pytest.raises(EngineDead) as caught:
        async with Coordinator.open(replicas=1, placement="process", grace_period=0.1) as c:
            pids = pids_of(c)
            await anyio.sleep_forever()  # cancelled when the last replica dies
    cause: Any = caught.value.__cause__
    assert isinstance(cause, ReplicaFailed)
    assert cause.replica == 0
    assert re.search(message, str(cause)), str(cause)
    assert all(gone(pid) for pid in pids)


async def test_a_child_that_dies_at_start_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_children(monkeypatch, b"", "exit")
    with pytest.raises(ReplicaFailed, match="exit code 3") as caught:
        async with Coordinator.open(replicas=2, placement="process"):
            raise AssertionError("must not start")
    assert "boom: the replica could not start" in str(caught.value)


def test_stderr_lines_are_cut_at_the_limit_however_the_bytes_arrive() -> None:
    data = b"short\n" + b"x" * 25 + "\nhé\n".encode() + b"y" * 12
    for size in (1, 3, 7, len(data)):
        lines = process.StderrLines(limit=10)
        found: list[str] = []
        for start in range(0, len(data), size):
            found.extend(lines.feed(data[start : start + size]))
        last = lines.close()
        assert found == ["short", "x" * 10 + "... [15 more bytes of this line cut]", "hé"]
        assert last == "y" * 10 + "... [2 more bytes of this line cut]"
        assert lines.close() is None


NO_NEWLINE = """
import os, sys
block = b"z" * (1 << 20)
for _ in range(int(sys.argv[1])):
    os.write(2, block)
os.write(2, b"\\nboom: the replica could not start\\n")
sys.exit(3)
"""


async def test_a_child_writing_megabytes_without_a_newline_costs_a_bounded_buffer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mebibytes = 16
    command = [sys.executable, "-c", NO_NEWLINE, str(mebibytes)]
    monkeypatch.setattr(process, "replica_command", lambda: command)
    tracemalloc.start()
    try:
        with pytest.raises(ReplicaFailed, match="exit code 3") as caught:
            async with Coordinator.open(replicas=1, placement="process"):
                raise AssertionError("must not start")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"forwarding {mebibytes} MiB of stderr peaked at {peak} bytes"
    cut = (mebibytes << 20) - process.MAX_STDERR_LINE_BYTES
    marker = f"... [{cut} more bytes of this line cut]"
    assert marker in str(caught.value)
    assert "boom: the replica could not start" in str(caught.value)
    forwarded = capsys.readouterr().err.splitlines()
    assert forwarded == [
        "[replica 0] " + "z" * process.MAX_STDERR_LINE_BYTES + marker,
        "[replica 0] boom: the replica could not start",
    ]


CTRL_C = """
import os, signal, sys
import anyio
from twostroke.engine import Coordinator
from twostroke.engine.coordinator import process

process.replica_command = lambda: [sys.executable, "-c", sys.argv[1]]

async def main():
    async with Coordinator.open(replicas=2, placement="process", grace_period=5) as c:
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            pids = [replica.pid for replica in c.statistics().replicas]
            print(*pids, flush=True)
            async for _ in signals:
                break
        # A round trip through every replica after the signal: one that got it is dead.
        await c.wait_idle()
        print(*[replica.alive for replica in c.statistics().replicas], flush=True)

anyio.run(main, backend=sys.argv[2])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_reaches_the_coordinator_and_not_its_children(backend: str) -> None:
    """SIGINT to the coordinator's process group, as a terminal's Ctrl-C sends it."""
    driver = subprocess.Popen(
        [sys.executable, "-c", CTRL_C, FAKE_REPLICA, backend],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, like a shell's job
    )
    try:
        assert driver.stdout is not None
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 2, driver.communicate(timeout=60)
        for pid in pids:
            assert os.getsid(pid) == pid  # each child leads a session of its own
        os.killpg(driver.pid, signal.SIGINT)
        out, err = driver.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    assert (driver.returncode, out) == (0, "True True\n"), err
    assert all(gone(pid) for pid in pids)
