"""The threads constraints compile on: a known stack, slots held until the work ends, the
smallest constraints first.

llguidance compiles a grammar recursively, in native code: a constraint that chains
thousands of ``$ref`` s or grammar rules used more stack than a thread has by default (8 MiB
on Linux) and ended the process with ``SIGSEGV``, which no ``except`` catches. So compiles
run on threads of this module only, made with a stack of :data:`COMPILE_STACK_SIZE` bytes,
enough for the deepest constraint the size limits of :mod:`twostroke.states.constraints`
allow with a margin (docs/structured-output.md has the figures).

A compile cannot be stopped once it runs (llguidance has no cancellation; its fuel limits
bound its work). So a caller that gives up (past its time limit, or cancelled) leaves the
compile running, and its thread stays taken until it really ends: at most ``max_concurrent``
compiles burn CPU at once, however many were given up. A compile given up before it started
is dropped from the queue and costs nothing.

The queue is ordered by the constraint's size (characters of its text), smallest first, and
one more thread than ``max_concurrent`` takes only small constraints (at most
``small_size`` characters). A flood of large, slow constraints (one client's, or many) then
delays only constraints at least as large: a tool schema of a few thousand characters never
waits behind them, only behind the small ones queued before it, which compile in
milliseconds. Fairness per client would need an identity the engine does not have; size is
what it knows before compiling, and what a compile's cost grows with.

Threads start when work arrives and end after :data:`IDLE_SECONDS` without any (nothing is
left behind an engine that is gone). The event loop learns a compile's start and end through
its token, on asyncio and trio alike.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import anyio
import anyio.lowlevel
import attrs

__all__ = ["COMPILE_STACK_SIZE", "IDLE_SECONDS", "CompilePool", "PoolStatistics"]

T = TypeVar("T")

#: The stack of every compile thread, in bytes. The deepest constraints the limits allow
#: (1,024 rules of 25 nested groups each; 256 ``$ref`` s each 45 levels deep, 11,500 levels
#: in all) compiled with 32 and 64 MiB and overflowed 16 and 32 MiB (llguidance 1.9.1); this
#: is four times that. A stack is address space: only the pages a compile touches take
#: memory.
COMPILE_STACK_SIZE = 256 << 20
#: Seconds an idle compile thread waits for work before it ends.
IDLE_SECONDS = 10.0

#: ``threading.stack_size`` is process-wide: one pool at a time sets it, starts, resets it.
_STACK_LOCK = threading.Lock()


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    WITHDRAWN = "withdrawn"


class _Job(Generic[T]):
    """One compile: queued, running or done; its outcome once done."""

    __slots__ = ("finished", "function", "outcome", "raised", "size", "started", "state", "token")

    def __init__(
        self, size: int, function: Callable[[], T], token: anyio.lowlevel.EventLoopToken
    ) -> None:
        self.size = size
        self.function = function
        self.token = token
        self.started = anyio.Event()
        self.finished = anyio.Event()
        self.state = _State.QUEUED
        #: What ``function`` returned, or the exception it raised (the flag says which).
        self.outcome: T | BaseException | None = None
        self.raised = False


@attrs.frozen
class PoolStatistics:
    """A snapshot of a :class:`CompilePool`.

    Attributes:
        num_queued: Compiles waiting for a thread.
        num_running: Compiles running, those whose caller gave up included.
        num_abandoned: Of those, the ones whose caller gave up (their result is dropped).
        num_threads: Compile threads alive (running or idle).
    """

    num_queued: int
    num_running: int
    num_abandoned: int
    num_threads: int


class CompilePool:
    """Compile threads with a known stack, fed smallest constraint first.

    Args:
        max_concurrent: Threads that take any constraint (>= 1).
        small_size: The largest constraint (characters) the one extra thread takes.
        stack_size: Each thread's stack, in bytes.
        idle_seconds: How long an idle thread waits for work before it ends.
    """

    def __init__(
        self,
        *,
        max_concurrent: int,
        small_size: int,
        stack_size: int = COMPILE_STACK_SIZE,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self._max_concurrent = max_concurrent
        self._small_size = small_size
        self._stack_size = stack_size
        self._idle_seconds = idle_seconds
        self._lock = threading.Condition()
        self._queue: list[tuple[int, int, _Job[Any]]] = []
        self._order = itertools.count()
        self._threads = {False: 0, True: 0}  # by "takes small constraints only"
        self._idle = {False: 0, True: 0}
        self._running = 0
        self._abandoned = 0

    async def run(self, size: int, function: Callable[[], T], seconds: float) -> T | None:
        """Run ``function`` on a compile thread; its result, or ``None`` past ``seconds``.

        ``seconds`` count from when a thread starts the work, not while it is queued.
        Always a checkpoint. Cancelled (or past ``seconds``), the caller returns at once: a
        queued compile is dropped, a running one goes on holding its thread, its result
        dropped.

        Args:
            size: The constraint's size in characters (the queue's order).
            function: The compile; its exception is raised here.
            seconds: How long it may run.

        Raises:
            Exception: whatever ``function`` raised.
        """
        await anyio.lowlevel.checkpoint()
        job: _Job[T] = _Job(size, function, anyio.lowlevel.current_token())
        try:
            self._submit(job)  # (a thread that cannot start: the job is withdrawn below)
            await job.started.wait()
            with anyio.move_on_after(seconds):
                await job.finished.wait()
                if job.raised:
                    assert isinstance(job.outcome, BaseException)
                    raise job.outcome
                return cast(T, job.outcome)
            return None
        finally:
            self._withdraw(job)

    def run_now(self, function: Callable[[], T]) -> T:
        """Run ``function`` on a thread of its own with the compile stack, and wait for it.

        For synchronous callers (scripts, tests): no queue, no time bound.

        Raises:
            Exception: whatever ``function`` raised.
        """
        returned: list[T] = []
        raised: list[BaseException] = []

        def call() -> None:
            try:
                returned.append(function())
            except BaseException as exc:  # handed to the caller's thread
                raised.append(exc)

        self._start(call, name="twostroke-compile-now").join()
        if raised:
            raise raised[0]
        return returned[0]

    def statistics(self) -> PoolStatistics:
        """What is queued and running now."""
        with self._lock:
            return PoolStatistics(
                num_queued=sum(1 for *_, job in self._queue if job.state is _State.QUEUED),
                num_running=self._running,
                num_abandoned=self._abandoned,
                num_threads=self._threads[False] + self._threads[True],
            )

    # --- the loop's side ------------------------------------------------------------------

    def _submit(self, job: _Job[T]) -> None:
        small = job.size <= self._small_size
        with self._lock:
            heapq.heappush(self._queue, (job.size, next(self._order), job))
            if self._idle[False] or (small and self._idle[True]):
                self._lock.notify_all()
            elif self._threads[False] < self._max_concurrent:
                self._spawn(small_only=False)
            elif small and not self._threads[True]:
                self._spawn(small_only=True)

    def _withdraw(self, job: _Job[T]) -> None:
        """The caller is done with ``job``: drop it if queued, abandon it if running."""
        with self._lock:
            if job.state is _State.QUEUED:
                job.state = _State.WITHDRAWN  # left in the heap; the threads skip it
            elif job.state is _State.RUNNING:
                job.state = _State.WITHDRAWN
                self._abandoned += 1

    # --- the threads' side ----------------------------------------------------------------

    def _spawn(self, *, small_only: bool) -> None:
        """Start a compile thread (the lock held)."""
        self._threads[small_only] += 1
        try:
            self._start(lambda: self._work(small_only), name="twostroke-compile")
        except BaseException:
            self._threads[small_only] -= 1
            raise

    def _start(self, target: Callable[[], None], *, name: str) -> threading.Thread:
        with _STACK_LOCK:
            previous = threading.stack_size(self._stack_size)
            try:
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
            finally:
                threading.stack_size(previous)
        return thread

    def _take(self, small_only: bool) -> _Job[Any] | None:
        """The next job this thread may run (the lock held), dropping withdrawn ones."""
        while self._queue:
            size, _, job = self._queue[0]
            if job.state is not _State.QUEUED:
                heapq.heappop(self._queue)
                continue
            if small_only and size > self._small_size:
                return None  # the smallest queued is large: no small one waits
            heapq.heappop(self._queue)
            return job
        return None

    def _work(self, small_only: bool) -> None:
        while True:
            with self._lock:
                deadline = time.monotonic() + self._idle_seconds
                job = self._take(small_only)
                while job is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._threads[small_only] -= 1
                        return
                    self._idle[small_only] += 1
                    try:
                        self._lock.wait(remaining)
                    finally:
                        self._idle[small_only] -= 1
                    job = self._take(small_only)
                job.state = _State.RUNNING
                self._running += 1
            _tell(job.token, job.started.set)
            outcome: object
            raised = False
            try:
                outcome = job.function()
            except BaseException as exc:  # the caller's to raise
                outcome, raised = exc, True
            with self._lock:
                self._running -= 1
                if job.state is _State.WITHDRAWN:
                    self._abandoned -= 1
                else:
                    job.outcome, job.raised = outcome, raised
                job.state = _State.DONE
            _tell(job.token, job.finished.set)


def _tell(token: anyio.lowlevel.EventLoopToken, setter: Callable[[], None]) -> None:
    """Have the loop ``token`` names set one of its events, from a compile thread.

    Without waiting for it (anyio's backends' ``run_sync_soon``, which ``from_thread``
    uses): a thread blocked on a loop that stopped without closing would hold its slot for
    good. A loop that has ended meanwhile (its caller long gone) is not an error.
    """
    with contextlib.suppress(Exception):  # RunFinishedError: the loop is gone, its caller too
        token.backend_class.run_sync_soon(setter, (), token.native_token)
