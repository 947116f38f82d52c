"""Completion: set once, awaited by many, polled on a documented schedule, cancel-safe."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import anyio
import attrs
import pytest
import trio
import trio.testing

from twostroke.gpu.completion import (
    Completion,
    CompletionAlreadySet,
    CompletionNotDone,
    CompletionState,
    Launched,
    PollSchedule,
    ReadyEvent,
)
from twostroke.gpu.fake import CountdownEvent


@attrs.define(eq=False)
class SwitchEvent:
    """An event the test fires by hand."""

    fired: bool = False

    def query(self) -> bool:
        return self.fired


class Buffer:
    """Stands in for a device tensor that a step in flight uses (weak-referenceable)."""


def ready(value: Any) -> Launched[Any]:
    return Launched(event=ReadyEvent(), readback=lambda: value)


# --- Launched and PollSchedule values ------------------------------------------------------


def test_launched_validates_its_fields() -> None:
    with pytest.raises(TypeError, match=r"^event must have a query\(\) method, got int 3$"):
        Launched(event=3, readback=lambda: 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^readback must be callable, got str 'x'$"):
        Launched(event=ReadyEvent(), readback="x")  # type: ignore[arg-type]
    launched = Launched(event=ReadyEvent(), readback=lambda: 0, keepalive=[1, 2])
    assert launched.keepalive == (1, 2)


def test_poll_schedule_is_spin_then_capped_doubling() -> None:
    schedule = PollSchedule()
    delays = [schedule.delay(i) for i in range(12)]
    assert delays == pytest.approx(
        [0, 0, 0, 20e-6, 40e-6, 80e-6, 160e-6, 320e-6, 500e-6, 500e-6, 500e-6, 500e-6]
    )
    assert schedule.delay(10_000) == 500e-6


def test_poll_schedule_validates() -> None:
    with pytest.raises(ValueError, match=r"^spin_polls must be >= 0, got -1$"):
        PollSchedule(spin_polls=-1)
    with pytest.raises(ValueError, match=r"^first_backoff must be finite and > 0, got 0$"):
        PollSchedule(first_backoff=0)
    with pytest.raises(TypeError, match=r"^max_backoff must be a number, got str '1'$"):
        PollSchedule(max_backoff="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^max_backoff must be >= first_backoff \(0.001\), got"):
        PollSchedule(first_backoff=1e-3, max_backoff=1e-4)


# --- set once, result, exceptions ------------------------------------------------------------


@pytest.mark.anyio
async def test_ready_event_gives_the_readback() -> None:
    completion: Completion[int] = Completion()
    completion.set_launched(ready(7))
    assert await completion == 7
    assert await completion.wait() == 7
    assert completion.statistics().state is CompletionState.DONE


def test_result_before_done_raises() -> None:
    completion: Completion[int] = Completion()
    assert not completion.done()
    with pytest.raises(
        CompletionNotDone,
        match=r"^result\(\) needs a done completion, but this one is pending: await it",
    ):
        completion.result()
    event = SwitchEvent()
    completion.set_launched(Launched(event=event, readback=lambda: 1))
    with pytest.raises(CompletionNotDone, match=r"but this one is launched: "):
        completion.result()
    event.fired = True
    assert completion.result() == 1


def test_second_set_raises_and_changes_nothing() -> None:
    completion: Completion[int] = Completion()
    completion.set_launched(ready(1))
    with pytest.raises(
        CompletionAlreadySet,
        match=r"^a completion can be set only once, but set_exception\(\) was called on one "
        r"that is already launched$",
    ):
        completion.set_exception(ValueError("late"))
    with pytest.raises(CompletionAlreadySet, match=r"set_launched\(\) was called"):
        completion.set_launched(ready(2))
    assert completion.result() == 1
    with pytest.raises(CompletionAlreadySet, match=r"already done$"):
        completion.set_launched(ready(2))


def test_set_rejects_wrong_types() -> None:
    completion: Completion[int] = Completion()
    with pytest.raises(TypeError, match=r"^set_launched expects a Launched, got int 5$"):
        completion.set_launched(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^set_exception expects an exception instance, got"):
        completion.set_exception(ValueError)  # type: ignore[arg-type]
    assert completion.statistics().state is CompletionState.PENDING


@pytest.mark.anyio
async def test_exception_propagates_as_is() -> None:
    completion: Completion[int] = Completion()
    error = ValueError("step failed")
    completion.set_exception(error)
    assert completion.done()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^step failed$") as info:
            await completion
        assert info.value is error
    assert completion.statistics().state is CompletionState.FAILED


@pytest.mark.anyio
async def test_readback_error_is_stored_and_readback_runs_once() -> None:
    calls = []
    error = RuntimeError("copy failed")

    def readback() -> int:
        calls.append(1)
        raise error

    completion: Completion[int] = Completion()
    completion.set_launched(Launched(event=ReadyEvent(), readback=readback))
    for _ in range(2):
        with pytest.raises(RuntimeError) as info:
            await completion
        assert info.value is error
    with pytest.raises(RuntimeError):
        completion.result()
    assert len(calls) == 1
    assert completion.statistics().state is CompletionState.FAILED


# --- several waiters, cancellation, ownership ------------------------------------------------


@pytest.mark.anyio
async def test_readback_runs_once_for_several_waiters() -> None:
    calls: list[int] = []
    results: list[str] = []
    completion: Completion[str] = Completion()

    async def waiter() -> None:
        results.append(await completion)

    def readback() -> str:
        calls.append(1)
        return "tokens"

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert completion.statistics().waiters == 3
        completion.set_launched(Launched(event=CountdownEvent(2), readback=readback))
    assert results == ["tokens"] * 3
    assert len(calls) == 1
    assert completion.statistics().waiters == 0


@pytest.mark.anyio
async def test_cancelled_waiter_leaves_completion_usable() -> None:
    completion: Completion[int] = Completion()
    event = SwitchEvent()
    buffer = Buffer()
    alive = weakref.ref(buffer)

    async def cancelled_waiter(scope: anyio.CancelScope) -> None:
        with scope:
            await completion
        assert scope.cancelled_caught

    async with anyio.create_task_group() as tg:
        # Cancelled while waiting for set_*.
        scope = anyio.CancelScope()
        tg.start_soon(cancelled_waiter, scope)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
    assert completion.statistics().waiters == 0
    completion.set_launched(Launched(event=event, readback=lambda: 5, keepalive=(buffer,)))
    del buffer

    # Cancelled while polling an event that has not fired: the buffers stay owned.
    with anyio.move_on_after(0) as scope:
        await completion
    assert scope.cancelled_caught
    gc.collect()
    assert alive() is not None
    assert completion.statistics().state is CompletionState.LAUNCHED

    event.fired = True
    assert await completion == 5
    assert completion.statistics().waiters == 0


@pytest.mark.anyio
async def test_keepalive_released_once_the_event_fired() -> None:
    buffer = Buffer()
    alive = weakref.ref(buffer)
    completion: Completion[int] = Completion()
    completion.set_launched(
        Launched(event=CountdownEvent(3), readback=lambda: 9, keepalive=(buffer, [buffer]))
    )
    del buffer
    assert not completion.done()  # query 1 of 3
    gc.collect()
    assert alive() is not None
    assert await completion == 9
    gc.collect()
    assert alive() is None


# --- polling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fires_on_query", [1, 2, 4, 5, 12])
@pytest.mark.anyio
async def test_poll_count_matches_the_event(fires_on_query: int) -> None:
    event = CountdownEvent(fires_on_query)
    completion: Completion[int] = Completion()
    completion.set_launched(Launched(event=event, readback=lambda: 1))
    assert await completion == 1
    assert event.queries == fires_on_query
    assert completion.statistics().polls == fires_on_query
    assert await completion == 1
    assert event.queries == fires_on_query  # never queried again once fired


@attrs.define(eq=False)
class AwaitableEvent:
    """An event that can be awaited until it fired (``SupportsFired``); fired by hand."""

    fired: anyio.Event = attrs.field(factory=anyio.Event)
    awaited: int = 0

    def query(self) -> bool:
        return self.fired.is_set()

    async def until_fired(self) -> None:
        self.awaited += 1
        await self.fired.wait()


@pytest.mark.anyio
async def test_an_event_that_can_be_awaited_is_awaited_instead_of_polled() -> None:
    event = AwaitableEvent()
    completion: Completion[int] = Completion()
    completion.set_launched(Launched(event=event, readback=lambda: 3))
    async with anyio.create_task_group() as tg:
        tg.start_soon(completion.wait)
        await anyio.wait_all_tasks_blocked()
        # The waiter asked once and sleeps on the event, not on a poll timer.
        assert completion.statistics().polls == 1
        assert event.awaited == 1
        event.fired.set()
    assert completion.statistics().polls == 2
    assert await completion == 3


@pytest.mark.anyio
async def test_until_fired_returning_early_falls_back_to_polling() -> None:
    @attrs.define(eq=False)
    class Early:
        countdown: CountdownEvent

        def query(self) -> bool:
            return self.countdown.query()

        async def until_fired(self) -> None:
            await anyio.lowlevel.checkpoint()  # a hint only: the event is not fired yet

    event = Early(CountdownEvent(4))
    completion: Completion[int] = Completion()
    completion.set_launched(Launched(event=event, readback=lambda: 9))
    assert await completion == 9
    assert event.countdown.queries == 4


class TestVirtualTime:
    """Trio only: ``MockClock`` makes the schedule's sleeps exact and free."""

    @pytest.fixture
    def anyio_backend(self) -> Any:
        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})

    @pytest.mark.parametrize("fires_on_query", [1, 3, 4, 6, 9, 15])
    @pytest.mark.anyio
    async def test_elapsed_time_follows_the_schedule(self, fires_on_query: int) -> None:
        schedule = PollSchedule()
        event = CountdownEvent(fires_on_query)
        completion: Completion[int] = Completion()
        completion.set_launched(Launched(event=event, readback=lambda: 1))
        start = anyio.current_time()
        assert await completion == 1
        expected = sum(schedule.delay(i) for i in range(fires_on_query - 1))
        assert anyio.current_time() - start == pytest.approx(expected, abs=1e-12)
        assert event.queries == fires_on_query
        stats = completion.statistics()
        assert stats.done_at is not None
        assert stats.settled_at is not None
        assert stats.done_at - stats.settled_at == pytest.approx(expected, abs=1e-12)

    @pytest.mark.anyio
    async def test_custom_schedule(self) -> None:
        schedule = PollSchedule(spin_polls=0, first_backoff=1.0, max_backoff=3.0)
        completion: Completion[int] = Completion(poll=schedule)
        completion.set_launched(Launched(event=CountdownEvent(5), readback=lambda: 1))
        await completion
        assert anyio.current_time() == pytest.approx(1 + 2 + 3 + 3)

    @pytest.mark.anyio
    async def test_await_is_a_checkpoint_even_when_done(self) -> None:
        completion: Completion[int] = Completion()
        completion.set_launched(ready(3))
        assert completion.done()
        with trio.testing.assert_checkpoints():
            assert await completion == 3
        with trio.testing.assert_checkpoints():
            assert await completion.wait() == 3
        failed: Completion[int] = Completion()
        failed.set_exception(KeyError("k"))
        with trio.testing.assert_checkpoints(), pytest.raises(KeyError):
            await failed

    @pytest.mark.anyio
    async def test_waits_for_set_without_polling(self) -> None:
        completion: Completion[int] = Completion()
        async with anyio.create_task_group() as tg:
            tg.start_soon(completion.wait)
            await anyio.sleep(10)  # virtual: the waiter sleeps on the "set" event meanwhile
            assert completion.statistics().polls == 0
            completion.set_launched(ready(1))
        assert completion.statistics().polls == 1
        assert anyio.current_time() == pytest.approx(10)

    @pytest.mark.anyio
    async def test_cancelled_while_polling(self) -> None:
        completion: Completion[int] = Completion()
        event = SwitchEvent()
        completion.set_launched(Launched(event=event, readback=lambda: 2))
        with anyio.move_on_after(0.01) as scope:
            await completion
        assert scope.cancelled_caught
        polls = completion.statistics().polls
        assert polls > 3  # it went past the spin into the backoff
        event.fired = True
        assert await completion == 2
        assert completion.statistics().polls == polls + 1
