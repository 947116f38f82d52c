"""ForwardThread: one owned thread runs every call in order, and is joined when its block exits."""

from __future__ import annotations

import functools
import re
import threading

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

from twostroke.gpu.forward_thread import ForwardThread, ForwardThreadClosed
from twostroke.gpu.threads import torch_threads

# A bound for the thread handshakes below, only reached if the code under test is broken.
DEADLOCK = 10.0


def live_threads(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == name]


@pytest.mark.anyio
async def test_every_call_runs_on_one_thread_that_the_block_joins() -> None:
    forward = ForwardThread("test forward a")
    assert not forward.running
    assert forward.ident is None
    async with forward:
        assert forward.running
        idents = [await forward.run(threading.get_ident) for _ in range(3)]
        assert idents == [forward.ident] * 3
        assert forward.ident != threading.get_ident()
        (thread,) = live_threads("test forward a")
    assert not thread.is_alive()  # joined, not merely told to stop
    assert not forward.running
    assert live_threads("test forward a") == []
    assert repr(forward) == "<ForwardThread 'test forward a' stopped>"


@pytest.mark.anyio
async def test_calls_run_one_at_a_time_in_call_order() -> None:
    token = anyio.lowlevel.current_token()
    release = threading.Event()
    entered = anyio.Event()
    order: list[int] = []

    def work(i: int) -> int:
        order.append(i)
        if i == 0:
            anyio.from_thread.run_sync(entered.set, token=token)
            assert release.wait(DEADLOCK)
        return i * 10

    results: dict[int, int] = {}

    async def call(
        forward: ForwardThread, i: int, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        task_status.started()  # not a checkpoint: run() queues the call before the next start
        results[i] = await forward.run(lambda: work(i))

    async with ForwardThread("test forward b") as forward, anyio.create_task_group() as tg:
        await tg.start(call, forward, 0)
        await entered.wait()
        for i in range(1, 4):
            await tg.start(call, forward, i)
        await anyio.wait_all_tasks_blocked()
        assert order == [0]
        release.set()
    assert order == [0, 1, 2, 3]
    assert results == {0: 0, 1: 10, 2: 20, 3: 30}


@pytest.mark.anyio
async def test_an_exception_of_the_work_is_raised_by_run_and_the_thread_goes_on() -> None:
    error = ValueError("bad step")

    def fail() -> None:
        raise error

    async with ForwardThread("test forward c") as forward:
        with pytest.raises(ValueError, match=r"^bad step$") as info:
            await forward.run(fail)
        assert info.value is error
        assert await forward.run(lambda: 7) == 7


@pytest.mark.anyio
async def test_a_cancelled_caller_waits_for_its_call_to_finish() -> None:
    token = anyio.lowlevel.current_token()
    release = threading.Event()
    entered = anyio.Event()
    finished: list[bool] = []

    def work() -> None:
        anyio.from_thread.run_sync(entered.set, token=token)
        assert release.wait(DEADLOCK)
        finished.append(True)

    scope = anyio.CancelScope()

    async def caller(forward: ForwardThread) -> None:
        with scope:
            await forward.run(work)
            pytest.fail("run() must raise the cancellation after the work finished")

    async with ForwardThread("test forward d") as forward, anyio.create_task_group() as tg:
        tg.start_soon(caller, forward)
        await entered.wait()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert finished == []  # the caller is still waiting for the work
        release.set()
    assert scope.cancelled_caught
    assert finished == [True]


@pytest.mark.anyio
async def test_the_thread_is_joined_when_the_block_raises_or_is_cancelled() -> None:
    forward = ForwardThread("test forward e")
    with pytest.raises(KeyError, match="boom"):
        async with forward:
            raise KeyError("boom")
    assert live_threads("test forward e") == []
    with anyio.CancelScope() as scope:
        async with forward:
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert live_threads("test forward e") == []


@pytest.mark.anyio
async def test_torch_runs_with_the_entering_threads_count() -> None:
    # torch fixes a thread's OpenMP team size when the thread first runs torch: the forward
    # thread adopts the count of whoever entered the block.
    with torch_threads(1):
        async with ForwardThread("test forward f") as forward:
            assert await forward.run(torch.get_num_threads) == 1


@pytest.mark.anyio
async def test_run_outside_the_block_and_entering_twice_are_refused() -> None:
    forward = ForwardThread("test forward g")
    message = "<ForwardThread 'test forward g' stopped> takes work only inside its async with block"
    with pytest.raises(ForwardThreadClosed, match=f"^{re.escape(message)}$"):
        await forward.run(lambda: None)
    async with forward:
        message = "<ForwardThread 'test forward g' running> is running already: enter it only once"
        with pytest.raises(ForwardThreadClosed, match=f"^{re.escape(message)}$"):
            await forward.__aenter__()
        assert await forward.run(lambda: 1) == 1
    with pytest.raises(ForwardThreadClosed, match="takes work only inside"):
        await forward.run(lambda: None)


@pytest.mark.anyio
async def test_submit_queues_without_waiting_and_tickets_report_the_outcome() -> None:
    release = threading.Event()
    order: list[int] = []
    events: list[tuple[str, int]] = []

    def work(i: int) -> int:
        events.append(("start", i))
        try:
            if i == 0:
                assert release.wait(DEADLOCK)
            if i == 1:
                raise ValueError("call 1 broke")
            order.append(i)
            return i * 10
        finally:
            events.append(("end", i))

    async with ForwardThread("test forward h") as forward:
        tickets = [forward.submit(functools.partial(work, i)) for i in range(3)]
        assert [t.done() for t in tickets] == [False] * 3  # call 0 holds the thread
        assert ("start", 2) not in events
        with pytest.raises(RuntimeError, match="has not run yet"):
            tickets[2].outcome()
        release.set()
        for ticket in tickets:
            await ticket.wait()
        assert tickets[0].outcome() == 0
        with pytest.raises(ValueError, match="call 1 broke"):
            tickets[1].outcome()
        assert tickets[2].outcome() == 20
        await tickets[2].wait()  # done: returns at once
    assert order == [0, 2]
    # One after another, in order: each call ends before the next starts.
    assert events == [(kind, i) for i in range(3) for kind in ("start", "end")]
    with pytest.raises(ForwardThreadClosed, match="takes work only inside"):
        forward.submit(lambda: None)


@pytest.mark.anyio
async def test_a_cancelled_ticket_wait_returns_at_once_and_the_call_still_runs() -> None:
    release = threading.Event()
    async with ForwardThread("test forward i") as forward:
        ticket = forward.submit(lambda: release.wait(DEADLOCK))
        with anyio.CancelScope() as scope:
            scope.cancel()
            await ticket.wait()
        assert scope.cancelled_caught
        assert not ticket.done()
        release.set()
        await ticket.wait()
        assert ticket.outcome() is True


def test_the_name_must_be_a_string() -> None:
    with pytest.raises(TypeError, match=r"^name must be a str, got int 3$"):
        ForwardThread(3)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_an_abandoned_thread_is_not_joined_and_ends_with_its_call() -> None:
    """A call that never returns (a hung device) must not hold the owner's block forever."""
    release = threading.Event()
    started = threading.Event()
    forward = ForwardThread("test forward abandoned")
    try:
        async with forward:
            ticket = forward.submit(lambda: (started.set(), release.wait(DEADLOCK))[1])
            with anyio.fail_after(DEADLOCK):
                await anyio.to_thread.run_sync(started.wait)
            forward.abandon()
        # Left at once, the call still running on its thread.
        assert not ticket.done()
        (thread,) = live_threads("test forward abandoned")
        assert thread.is_alive()
        assert not forward.running
    finally:
        release.set()
    with anyio.fail_after(DEADLOCK):
        await anyio.to_thread.run_sync(thread.join)
    assert ticket.outcome() is True  # it ran to the end, then stopped: nothing else queued
