"""Completions: the awaitable result of one step launched on a device.

The forward stroke launches a step and sends its :class:`Completion` to the bookkeeping stroke
at once; bookkeeping awaits it. On CUDA the step is a queue of kernels ending in a recorded
event, on the CPU it is work a worker thread already finished, in tests it is a deadline in
virtual time. All three hand over a :class:`Launched` (an event to query and a ``readback`` for
the result), so one awaitable serves them all.

Waiting polls ``event.query()`` between checkpoints instead of blocking a thread on the event
or calling ``synchronize()``: polling works the same on asyncio and trio, never blocks the loop
and is cancellable at every poll (see :class:`PollSchedule` for the intervals and their cost).
An event that can tell when it fired without being polled (:class:`SupportsFired`: the CPU's
steps queued on a forward thread, which wake the loop through a waiter thread) is awaited that
way first, so a step of tens of milliseconds costs one wake-up instead of dozens of polls.

A completion is used from the event loop's thread only: ``set_*``, ``done``, ``result`` and
``wait`` are not thread-safe (a device resolves it after its worker thread returned).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator, Iterable
from typing import Any, Generic, Protocol, TypeVar

import anyio
import attrs

from twostroke.gpu.validators import check_int_at_least, check_seconds

__all__ = [
    "Completion",
    "CompletionAlreadySet",
    "CompletionError",
    "CompletionNotDone",
    "CompletionState",
    "CompletionStatistics",
    "Launched",
    "PollSchedule",
    "ReadyEvent",
    "SupportsFired",
    "SupportsQuery",
]

T = TypeVar("T")


class SupportsQuery(Protocol):
    """An event that can be asked, without blocking, whether the work before it has finished.

    ``torch.cuda.Event`` has this shape, and so do :class:`ReadyEvent` and the test events.
    """

    def query(self) -> bool:
        """Return whether the event has fired; never blocks."""
        ...


class SupportsFired(SupportsQuery, Protocol):
    """An event that can also be awaited until it fired, instead of being polled.

    :meth:`Completion.wait` queries the event, awaits :meth:`until_fired` once if it has not
    fired, then polls ``query()`` as for any event. So ``until_fired`` may return early (or
    have nothing left to wait for, like a step queued on a host thread whose launch is done
    but whose device work is not): it is a hint that saves polls, never the source of truth.
    """

    async def until_fired(self) -> None:
        """Return when the event has fired, or may have; cancellable."""
        ...


@attrs.frozen
class ReadyEvent:
    """An event that has always fired: for work that already ran synchronously (the CPU)."""

    def query(self) -> bool:
        """Return ``True``: the work ran before this event was made."""
        return True


def _check_event(_: object, __: object, value: Any) -> None:
    if not callable(getattr(value, "query", None)):
        raise TypeError(f"event must have a query() method, got {type(value).__name__} {value!r}")


def _check_readback(_: object, __: object, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"readback must be callable, got {type(value).__name__} {value!r}")


def _to_tuple(value: Iterable[object]) -> tuple[object, ...]:
    return tuple(value)


@attrs.frozen
class Launched(Generic[T]):
    """Work handed to a device, with what it takes to read its result back.

    The work is done when ``event.query()`` is true; then ``readback()`` gives the result
    (for instance ``.tolist()`` of a pinned host tensor that a non-blocking copy filled).
    ``readback`` is called at most once, on the event loop's thread, and only after the event
    fired, so it must not block on the device.

    Attributes:
        event: Fires when the work (and any copy to the host) is finished.
        readback: Builds the result from host memory once the event fired.
        keepalive: References to every buffer the work still reads or writes. The completion
            holds them until it sees the event fired, so no buffer is freed or refilled while
            the device may still use it (Megatron-LM #5715 refilled a pinned buffer that a
            copy still read), even if everyone awaiting the completion was cancelled.
    """

    event: SupportsQuery = attrs.field(validator=_check_event)
    readback: Callable[[], T] = attrs.field(validator=_check_readback)
    keepalive: tuple[object, ...] = attrs.field(default=(), converter=_to_tuple)


def _check_delay(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    check_seconds(attribute.name, value, positive=True)


def _check_spin_polls(_: object, __: object, value: object) -> None:
    check_int_at_least("spin_polls", value, 0)


@attrs.frozen
class PollSchedule:
    """How :meth:`Completion.wait` spaces its queries of an event that has not fired yet.

    After each unsuccessful query the waiter sleeps :meth:`delay` seconds: ``0`` (a bare
    checkpoint) for the first ``spin_polls`` queries, then ``first_backoff`` doubling up to
    ``max_backoff``. With the defaults: 0, 0, 0, then 20, 40, 80, 160, 320 µs, then 500 µs
    for as long as it takes.

    Why these numbers: a step that is already finished or about to be (the CPU's ready events,
    a GPU that ran ahead of the host) costs only loop iterations, which also let the other
    tasks run. Past that, doubling keeps the latency a waiter adds below the time it has
    already waited, and the 500 µs cap bounds it well under a decode step (a few ms on a GPU,
    tens of ms on a CPU) while waking the loop at most 2000 times a second per waiter, which
    costs a few percent of one core at most.

    Measured (2-core CPU, Python 3.11): epoll-based loops (asyncio, trio, uvloop) round a
    timeout up to a whole millisecond, so every sleep of the backoff lasts about 1 ms in wall
    time and the effective cap is 1 ms: an event that fires during a 5 ms step is seen
    0.5-0.75 ms later on average, after about 9 queries. That latency is hidden when steps
    overlap (step N+1 is queued before step N is awaited); only the serial schedule pays it.
    An already-fired event costs one query and one checkpoint (~16 µs per ``await``).

    Attributes:
        spin_polls: Queries followed by a bare checkpoint before the backoff starts.
        first_backoff: The first sleep of the backoff, in seconds.
        max_backoff: The longest sleep, in seconds.
    """

    spin_polls: int = attrs.field(default=3, validator=_check_spin_polls)
    first_backoff: float = attrs.field(default=20e-6, validator=_check_delay)
    max_backoff: float = attrs.field(default=500e-6, validator=_check_delay)

    def __attrs_post_init__(self) -> None:
        if self.max_backoff < self.first_backoff:
            raise ValueError(
                f"max_backoff must be >= first_backoff ({self.first_backoff!r}), "
                f"got {self.max_backoff!r}"
            )

    def delay(self, poll: int) -> float:
        """The sleep after unsuccessful query number ``poll`` (counted from 0), in seconds.

        Args:
            poll: How many unsuccessful queries this waiter made before this one.

        Returns:
            ``0.0`` during the spin, then the capped exponential backoff.
        """
        if poll < self.spin_polls:
            return 0.0
        doublings = poll - self.spin_polls
        # Past ~40 doublings any sane cap is reached; clamping keeps 2**n a small float.
        return min(self.first_backoff * 2.0 ** min(doublings, 64), self.max_backoff)


class CompletionError(RuntimeError):
    """A completion was used out of protocol (a bug in the caller, not a failed step)."""


class CompletionAlreadySet(CompletionError):
    """``set_launched`` or ``set_exception`` was called on a completion already set."""


class CompletionNotDone(CompletionError):
    """``result()`` was called before the completion was done."""


class CompletionState(enum.Enum):
    """Where a completion is in its life; it only ever moves down this list (or to FAILED)."""

    PENDING = "pending"  #: Nothing set yet.
    LAUNCHED = "launched"  #: Work handed over; its event has not been seen fired.
    FIRED = "fired"  #: Event seen fired; the result was not read back yet.
    DONE = "done"  #: Result read back and cached.
    FAILED = "failed"  #: ``set_exception`` was called, or ``readback`` raised.


@attrs.frozen
class CompletionStatistics:
    """A snapshot of one completion, for tests and for measuring the cost of polling.

    Attributes:
        state: Where the completion is in its life.
        polls: How many times ``event.query()`` was called, by every waiter together.
        waiters: Tasks inside :meth:`Completion.wait` right now.
        settled_at: Loop time (``anyio.current_time()``) of ``set_launched`` or
            ``set_exception``; ``None`` if not set yet or set outside an event loop.
        done_at: Loop time at which the completion was first seen done (so ``done_at -
            settled_at`` bounds the step's device time plus the polling latency); ``None`` if
            not done yet or first seen outside an event loop.
    """

    state: CompletionState
    polls: int
    waiters: int
    settled_at: float | None
    done_at: float | None


def _now() -> float | None:
    try:
        return anyio.current_time()
    except anyio.NoEventLoopError:
        return None


class Completion(Generic[T]):
    """Settable-once awaitable result of one launched step.

    A device resolves it once, with :meth:`set_launched` or :meth:`set_exception`; any number
    of tasks may ``await`` it (or call :meth:`wait`), before or after that. Cancelling a
    waiter abandons that wait only: the completion stays valid for the others and keeps the
    step's buffers alive until its event fires.

    Args:
        poll: How waiters space their queries of the event.
    """

    def __init__(self, *, poll: PollSchedule | None = None) -> None:
        self._schedule = PollSchedule() if poll is None else poll
        self._settled = anyio.Event()
        self._state = CompletionState.PENDING
        self._launched: Launched[T] | None = None
        self._readback: Callable[[], T] | None = None
        self._value: T | None = None
        self._exception: BaseException | None = None
        self._polls = 0
        self._waiters = 0
        self._settled_at: float | None = None
        self._done_at: float | None = None

    def __repr__(self) -> str:
        return f"<Completion {self._state.value}, {self._polls} polls>"

    def set_launched(self, launched: Launched[T]) -> None:
        """Hand over the launched work; waiters start polling its event.

        Args:
            launched: The work's event, readback and keepalive.

        Raises:
            TypeError: ``launched`` is not a :class:`Launched`.
            CompletionAlreadySet: The completion was already set.
        """
        if not isinstance(launched, Launched):
            raise TypeError(
                f"set_launched expects a Launched, got {type(launched).__name__} {launched!r}"
            )
        self._check_pending("set_launched")
        self._launched = launched
        self._settle(CompletionState.LAUNCHED)

    def set_exception(self, exc: BaseException) -> None:
        """Fail the completion: every waiter, present and future, gets ``exc`` raised.

        Args:
            exc: The exception the work raised; it is re-raised as is, not wrapped.

        Raises:
            TypeError: ``exc`` is not an exception instance.
            CompletionAlreadySet: The completion was already set.
        """
        if not isinstance(exc, BaseException):
            raise TypeError(
                f"set_exception expects an exception instance, got {type(exc).__name__} {exc!r}"
            )
        self._check_pending("set_exception")
        self._exception = exc
        self._settle(CompletionState.FAILED)
        self._done_at = self._settled_at

    def done(self) -> bool:
        """Return whether :meth:`result` would return or raise without waiting.

        Never blocks: if the work was launched and its event has not been seen fired yet, this
        queries the event once.
        """
        if self._state is CompletionState.LAUNCHED:
            assert self._launched is not None
            self._polls += 1
            if not self._launched.event.query():
                return False
            # The device is finished with the step's buffers: release them now rather than
            # when the result is read (readback keeps what it needs through its closure).
            self._readback = self._launched.readback
            self._launched = None
            self._state = CompletionState.FIRED
            self._done_at = _now()
        return self._state is not CompletionState.PENDING

    def result(self) -> T:
        """Return the result, reading it back on first use; or raise what the step raised.

        ``readback`` runs once; its value is cached for every later call, and an exception it
        raises is stored and raised again by every later call.

        Returns:
            What ``readback()`` returned.

        Raises:
            CompletionNotDone: Nothing was set yet, or the event has not fired.
            BaseException: The exception given to :meth:`set_exception`, or raised by
                ``readback``, as is.
        """
        if not self.done():
            raise CompletionNotDone(
                f"result() needs a done completion, but this one is {self._state.value}: "
                "await it (or check done()) first"
            )
        if self._state is CompletionState.FIRED:
            assert self._readback is not None
            readback, self._readback = self._readback, None
            try:
                self._value = readback()
            except Exception as exc:
                self._exception = exc
                self._state = CompletionState.FAILED
            else:
                self._state = CompletionState.DONE
        if self._state is CompletionState.FAILED:
            assert self._exception is not None
            raise self._exception
        return self._value  # type: ignore[return-value]  # DONE: set by readback

    async def wait(self) -> T:
        """Wait until the completion is done and return its result.

        Always a checkpoint, even when already done. Waits for ``set_*``, then for the event:
        awaits its ``until_fired()`` once if it has one (:class:`SupportsFired`), then polls it on
        the :class:`PollSchedule`; never blocks the loop and never synchronizes the device.

        Cancellation abandons this wait only: the completion is left as it was.

        Returns:
            The result, as :meth:`result` gives it.

        Raises:
            BaseException: What the step raised, as :meth:`result` raises it.
        """
        self._waiters += 1
        try:
            await self._settled.wait()  # a checkpoint even when already set
            poll = 0
            while not self.done():
                assert self._launched is not None  # not done after set: launched, not fired
                until_fired = getattr(self._launched.event, "until_fired", None)
                if poll == 0 and until_fired is not None:
                    await until_fired()
                else:
                    await anyio.sleep(self._schedule.delay(poll))
                poll += 1
        finally:
            self._waiters -= 1
        return self.result()

    def __await__(self) -> Generator[Any, None, T]:
        return self.wait().__await__()

    def statistics(self) -> CompletionStatistics:
        """Return a snapshot of the completion's state and polling counters."""
        return CompletionStatistics(
            state=self._state,
            polls=self._polls,
            waiters=self._waiters,
            settled_at=self._settled_at,
            done_at=self._done_at,
        )

    def _check_pending(self, operation: str) -> None:
        if self._state is not CompletionState.PENDING:
            raise CompletionAlreadySet(
                f"a completion can be set only once, but {operation}() was called on one "
                f"that is already {self._state.value}"
            )

    def _settle(self, state: CompletionState) -> None:
        self._state = state
        self._settled_at = _now()
        self._settled.set()
