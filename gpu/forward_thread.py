"""One long-lived thread that runs a device's steps, so torch's OpenMP team stays with it.

torch's intra-op parallelism is an OpenMP team, and an OpenMP team belongs to the thread that
starts a parallel region (its *master*): every thread that runs torch gets a team of its own,
sized by the torch thread count it had when it first ran torch. A step handed to a pool of
worker threads (``anyio.to_thread``) may land on a different thread than the step before and
starts or wakes another team, while the teams of the other threads still hold their workers
spinning at the end of their last region; on a machine with as many torch threads as cores
the teams then take turns on the cores. One dedicated thread that runs every step keeps one
team, warm, for the engine's whole life: the steps run as fast as in a plain loop.

:class:`ForwardThread` is that thread. It is started by ``async with`` and stopped and joined
when the block exits, so no thread outlives its owner; a step is handed over through a
queue, and the waiting task is woken through a cheap waiter in anyio's worker threads (a
thread that only blocks on a :class:`threading.Event`, never runs torch), which works on
asyncio and trio alike and never makes the forward thread wait for the event loop.

:meth:`ForwardThread.submit` queues work without waiting for it and returns a
:class:`Ticket`: a device queues step N+1 behind step N that way, so the thread goes from one
step to the next without a round trip through the event loop (a GPU stream's queue, on the
CPU).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs
import torch

from twostroke.gpu.threads import torch_threads

__all__ = ["ForwardThread", "ForwardThreadClosed", "Ticket"]

T = TypeVar("T")


class ForwardThreadClosed(RuntimeError):
    """Work was handed to a :class:`ForwardThread` that is not running."""


@attrs.define(eq=False)
class Ticket(Generic[T]):
    """One call queued on a :class:`ForwardThread`, and its outcome once it has run.

    Made by :meth:`ForwardThread.submit`; the thread fills it in. ``done()`` may be asked from
    any thread; ``outcome()`` only once ``done()`` is true. (The engine times its launches
    itself, inside the work.)
    """

    _work: Callable[[], T]
    _waiters: anyio.CapacityLimiter
    _done: threading.Event = attrs.field(factory=threading.Event, init=False)
    _value: T | None = attrs.field(default=None, init=False)
    _error: BaseException | None = attrs.field(default=None, init=False)

    def done(self) -> bool:
        """Whether the call has run (returned or raised); never blocks."""
        return self._done.is_set()

    async def wait(self) -> None:
        """Return once the call has run.

        A waiter (one of anyio's worker threads, under the forward thread's own limiter)
        blocks on the ticket, so the event loop sleeps meanwhile. Cancellation abandons this
        wait at once (the waiter thread returns when the call does); the call itself runs
        regardless.
        """
        if self._done.is_set():
            await anyio.lowlevel.checkpoint()
            return
        await anyio.to_thread.run_sync(
            self._done.wait, abandon_on_cancel=True, limiter=self._waiters
        )

    def outcome(self) -> T:
        """What the call returned, or raise what it raised.

        Raises:
            RuntimeError: the call has not run yet (check :meth:`done` or await :meth:`wait`).
            BaseException: the exception the call raised, as is.
        """
        if not self._done.is_set():
            raise RuntimeError("outcome() of a ticket whose call has not run yet: await wait()")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set by _run, which succeeded

    def _run(self) -> None:
        try:
            self._value = self._work()
        except BaseException as exc:  # handed to the caller, who decides what is fatal
            self._error = exc
        finally:
            self._done.set()


#: Put on the queue to stop the thread.
_STOP = object()


class ForwardThread:
    """A thread that runs the calls handed to :meth:`run`, one at a time, in order.

    Use it as an async context manager: entering starts the thread, leaving stops it after
    the calls already handed over and joins it. Inside the thread, torch runs with the
    intra-op thread count that the thread entering the block had (``torch.get_num_threads()``
    there), because torch fixes a thread's OpenMP team size when the thread first runs torch.

    Args:
        name: The thread's name (shown by debuggers and ``py-spy``).

    Raises:
        TypeError: ``name`` is not a string.
    """

    def __init__(self, name: str = "twostroke forward") -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
        self.name = name
        self._queue: queue.SimpleQueue[Ticket[object] | object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._waiters: anyio.CapacityLimiter | None = None
        self._abandoned = False

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<ForwardThread {self.name!r} {state}>"

    @property
    def running(self) -> bool:
        """Whether the thread was started and not yet told to stop."""
        return self._thread is not None

    @property
    def ident(self) -> int | None:
        """The running thread's identifier (``threading.get_ident()`` inside it), or ``None``."""
        return None if self._thread is None else self._thread.ident

    async def __aenter__(self) -> ForwardThread:
        """Start the thread.

        Raises:
            ForwardThreadClosed: the thread is running already (a thread is entered once).
        """
        await anyio.lowlevel.checkpoint()
        if self._thread is not None:
            raise ForwardThreadClosed(f"{self!r} is running already: enter it only once")
        # The waiters only block on an Event, so they get a private limiter (made here, in
        # the loop that uses it): the default one may be exhausted by unrelated calls.
        self._waiters = anyio.CapacityLimiter(1)
        thread = threading.Thread(
            target=self._serve, args=(torch.get_num_threads(),), name=self.name, daemon=True
        )
        thread.start()
        self._thread = thread
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop the thread once the calls handed over have run, and join it.

        Shielded: the thread is joined even if the caller is cancelled meanwhile; after
        :meth:`abandon` it is told to stop and left to finish on its own.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(_STOP)
        if self._abandoned:
            await anyio.lowlevel.checkpoint()
            return
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(thread.join, limiter=self._waiters)
        self._waiters = None

    def abandon(self) -> None:
        """Do not wait for the thread when the block exits: its call may never return.

        For an owner that gave up on the work in progress (a device that hangs): leaving
        the block then tells the thread to stop after its current call and returns at
        once, and the thread (a daemon) ends whenever that call does, or with the process.
        The one case where the thread outlives the block.
        """
        self._abandoned = True

    def submit(self, work: Callable[[], T]) -> Ticket[T]:
        """Queue ``work`` behind the calls already handed over, and return at once.

        Never blocks and never yields to the event loop, so calls queue in the order
        ``submit`` was called; the thread runs them one after another without waiting for the
        loop in between.

        Returns:
            The call's :class:`Ticket`: await :meth:`Ticket.wait`, then read
            :meth:`Ticket.outcome`.

        Raises:
            ForwardThreadClosed: the thread is not running.
        """
        if self._thread is None or self._waiters is None:
            raise ForwardThreadClosed(f"{self!r} takes work only inside its async with block")
        ticket: Ticket[T] = Ticket(work, self._waiters)
        self._queue.put(ticket)
        return ticket

    async def run(self, work: Callable[[], T]) -> T:
        """Run ``work`` in the thread and return what it returns (or raise what it raised).

        Calls run one at a time, in the order they were made. Cancellation: a call that was
        handed over still runs to the end, and this waits for it (shielded) before the
        cancellation is delivered, so nothing the work uses is released early.

        Raises:
            ForwardThreadClosed: the thread is not running.
        """
        try:
            ticket = self.submit(work)
        except ForwardThreadClosed:
            await anyio.lowlevel.checkpoint()
            raise
        with anyio.CancelScope(shield=True):
            await ticket.wait()
        await anyio.lowlevel.checkpoint_if_cancelled()
        return ticket.outcome()

    def _serve(self, threads: int) -> None:
        with torch_threads(threads):
            while True:
                ticket = self._queue.get()
                if ticket is _STOP:
                    return
                assert isinstance(ticket, Ticket)
                ticket._run()
