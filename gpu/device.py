"""Devices: where a step's work is launched, and how its completion is resolved.

The forward stroke hands a device a ``work`` callable (the runner's ``execute`` bound to a
plan) and a :class:`~twostroke.gpu.completion.Completion`; the device runs the work, which
returns a :class:`~twostroke.gpu.completion.Launched`, and resolves the completion with it.
What differs between devices is only *where* the work runs and *when* its event fires:

* :class:`CudaDevice` runs the Python launch in a worker thread; the work only enqueues kernels
  and records an event, so ``run`` returns as soon as the launch did and step N+1 is launched
  while step N executes.
* :class:`CpuDevice` runs the whole computation in a worker thread (torch releases the GIL
  inside its kernels), so the event loop keeps serving bookkeeping meanwhile. Inside
  ``async with device:`` that is one long-lived thread of the device's own
  (:class:`~twostroke.gpu.forward_thread.ForwardThread`), which keeps torch's OpenMP team
  warm; outside, anyio's pooled worker threads.
* :class:`~twostroke.gpu.fake.FakeDevice` (in :mod:`twostroke.gpu.fake`) is a GPU in virtual
  time for tests: the work runs inline and its event fires
  ``step_time`` seconds of loop time later, queued behind the steps before it.

A device never raises an exception of the work from ``run``: it goes into the completion, and
the engine fails that step's requests and keeps running, unless :meth:`Device.probe` then
finds the device gone (a lost CUDA context fails every later call), which kills the engine.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs
import torch

from twostroke.gpu.completion import (
    Completion,
    CompletionAlreadySet,
    CompletionState,
    Launched,
    SupportsQuery,
)
from twostroke.gpu.forward_thread import ForwardThread, Ticket
from twostroke.gpu.host import available_memory
from twostroke.gpu.validators import check_int_at_least

__all__ = [
    "CpuDevice",
    "CudaDevice",
    "Device",
    "DeviceUnavailable",
]

T = TypeVar("T")


class DeviceUnavailable(RuntimeError):
    """The device asked for does not exist on this machine (no CUDA, or no such index)."""


class Device(abc.ABC):
    """Where the forward stroke launches steps.

    Attributes:
        kind: ``"cuda"``, ``"cpu"`` or ``"fake"``.
        torch_device: The device tensors of this engine live on.
    """

    kind: ClassVar[str]
    torch_device: torch.device

    async def __aenter__(self) -> Device:
        """Hold the device for the body of an ``async with`` block (an engine's life).

        Devices that run steps on threads of their own start them here and join them when
        the block exits, so no thread outlives the block; :meth:`run` works outside a block
        too. Blocks may nest (two engines on one device): the last exit releases. Always a
        checkpoint.
        """
        await anyio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Release what :meth:`__aenter__` started; shielded, so it always releases."""
        return None  # nothing held: a device without threads of its own

    @abc.abstractmethod
    async def run(self, work: Callable[[], Launched[T]], completion: Completion[T]) -> None:
        """Launch ``work`` and resolve ``completion`` with what it returns.

        An exception raised by ``work`` goes into the completion (``set_exception``) and is
        not raised here: the engine keeps running. Steps run one at a time, in call order.
        ``run`` returns once the work is launched, not once it is finished: the completion
        tells when that is.

        Cancellation: the work runs and the completion is resolved even if the caller is
        cancelled meanwhile (its buffers may already be in use); the cancellation is raised
        afterwards.

        Args:
            work: Launches one step; called with no arguments, exactly once.
            completion: Resolved with the work's :class:`Launched`, or with its exception.

        Raises:
            CompletionAlreadySet: ``completion`` was already set (a bug in the caller).
        """

    async def call(self, work: Callable[[], T]) -> T:
        """Run ``work`` where this device's steps run, and return what it returns.

        For the set-up that comes before the steps and uses torch: loading a model, making its
        KV cache. A device with a thread of its own runs it there, so the event loop keeps
        serving its other tasks meanwhile (a model takes seconds to load) and the process
        has one OpenMP team, the thread's, instead of a second on the loop thread. A device
        without threads runs it in the calling thread, after a checkpoint.

        Cancellation: work handed over runs to its end, and is waited for (shielded); the
        cancellation is delivered after.

        Raises:
            BaseException: what ``work`` raised, as is.
        """
        await anyio.lowlevel.checkpoint()
        return work()

    async def probe(self) -> None:
        """Check that the device still runs work; raise what it raises if it cannot.

        The engine calls this after a step failed (unless it ran out of memory), to tell an
        error of that step from a device that is gone (a CUDA context after an illegal
        address, a device-side assert or a launch failure, where every later call fails).
        It runs a tiny piece of work where steps run, behind the steps already queued, and
        waits for it: cheap, but not free, so it is not called on the happy path.

        Raises:
            Exception: the device cannot run work; the error is what the device raised.
        """
        await anyio.lowlevel.checkpoint()

    def abandon(self) -> None:
        """Give up on the work in flight: a step never completed (the device hangs).

        Leaving the ``async with`` block then no longer waits for the threads that run
        steps (a thread stuck in a step would hold the block forever); they end when their
        work does, or with the process. A device without threads has nothing to give up.
        """
        return None

    def free_memory(self) -> int:
        """Bytes of memory free for a KV cache on this device.

        The host's available memory (``MemAvailable``, or what ``os.sysconf`` reports) for
        the CPU and the fake device; subclasses with memory of their own say theirs.
        """
        return available_memory()


def _resolve(completion: Completion[T], launched: object) -> None:
    if isinstance(launched, Launched):
        completion.set_launched(launched)
    else:
        completion.set_exception(
            TypeError(
                f"device work must return a Launched, got {type(launched).__name__} {launched!r}"
            )
        )


@attrs.frozen
class _QueuedEvent:
    """The event of a step queued on a forward thread: fired once the thread ran the launch
    and the event the launch returned fired (at once on the CPU; a CUDA event's own time on a
    GPU). A launch that raised, or returned something other than a :class:`Launched`, counts
    as fired: the readback raises."""

    ticket: Ticket[Any]

    def query(self) -> bool:
        if not self.ticket.done():
            return False
        try:
            launched = self.ticket.outcome()
        except BaseException:
            return True
        return not isinstance(launched, Launched) or launched.event.query()

    async def until_fired(self) -> None:
        await self.ticket.wait()


def _ticket_readback(ticket: Ticket[Any]) -> Callable[[], Any]:
    """The readback of a step queued on a forward thread: the launch's own readback, or what
    the launch raised (or a ``TypeError`` if it returned something other than a
    :class:`Launched`)."""

    def readback() -> Any:
        launched = ticket.outcome()
        if not isinstance(launched, Launched):
            raise TypeError(
                f"device work must return a Launched, got {type(launched).__name__} {launched!r}"
            )
        return launched.readback()

    return readback


@attrs.frozen
class _Serializer:
    """Per-event-loop primitives that run one step at a time, in call order."""

    # The lock queues callers first-in first-out from the moment they call run (anyio's
    # to_thread checkpoints before taking its limiter, and trio may reorder ready tasks);
    # the private one-token limiter keeps the launch off the default thread limiter, which
    # unrelated to_thread calls could exhaust.
    lock: anyio.Lock
    limiter: anyio.CapacityLimiter


class _WorkerThreadDevice(Device):
    """A device whose work runs in a worker thread, one step at a time.

    Inside ``async with device:`` the worker is the device's own :class:`ForwardThread`,
    started on the first entry and joined on the last exit. There :meth:`run` only *queues*
    the work on the thread and returns: the step is launched in the sense a GPU launches a
    kernel, and the completion fires when the thread has run it. So the forward stroke queues
    step N+1 while step N runs, and the thread starts it the moment step N ends, without
    waiting for the event loop (which may be busy applying step N, or with the application's
    own tasks). Outside a block, anyio's pooled worker threads run each step while ``run``
    waits (correct, but a step may land on another thread than the one before, with another
    OpenMP team: slower on the CPU with more than one torch thread).
    """

    def __init__(self) -> None:
        # Created lazily in run(), once per event loop: anyio primitives belong to one loop,
        # and a device may outlive the loop it was first used on (tests, re-opened engines).
        self._serializer: anyio.lowlevel.RunVar[_Serializer] = anyio.lowlevel.RunVar(
            f"twostroke {type(self).__name__} {id(self):#x} serializer"
        )
        self._forward: ForwardThread | None = None
        self._holders = 0

    @property
    def forward_thread(self) -> ForwardThread | None:
        """The thread steps run on inside ``async with device:``; ``None`` outside."""
        return self._forward

    async def __aenter__(self) -> _WorkerThreadDevice:
        if self._forward is None:
            forward = ForwardThread(f"twostroke {self.kind} forward")
            await forward.__aenter__()
            self._forward = forward
        else:
            await anyio.lowlevel.checkpoint()
        self._holders += 1
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._holders -= 1
        if self._holders == 0 and self._forward is not None:
            forward, self._forward = self._forward, None
            await forward.__aexit__(None, None, None)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.torch_device}>"

    async def run(self, work: Callable[[], Launched[T]], completion: Completion[T]) -> None:
        if self._forward is not None:
            state = completion.statistics().state
            if state is not CompletionState.PENDING:  # refused before anything is queued
                await anyio.lowlevel.checkpoint()
                raise CompletionAlreadySet(
                    f"a completion can be set only once, but run() was given one that is "
                    f"already {state.value}"
                )
            # Queued before any checkpoint: the completion is set whatever happens to the
            # caller, and calls queue in call order.
            ticket = self._forward.submit(functools.partial(self._launch, work))
            completion.set_launched(
                Launched(
                    event=_QueuedEvent(ticket),
                    readback=_ticket_readback(ticket),
                    keepalive=(ticket,),
                )
            )
            await anyio.lowlevel.checkpoint()
            return
        serializer = self._current_serializer()
        # Shielded: once called, the work is launched and the completion resolved, however
        # the caller is cancelled (the cancellation is delivered after the shield).
        with anyio.CancelScope(shield=True):
            async with serializer.lock:
                try:
                    launched = await anyio.to_thread.run_sync(
                        self._launch, work, limiter=serializer.limiter
                    )
                except Exception as exc:
                    completion.set_exception(exc)
                except BaseException as exc:  # KeyboardInterrupt, SystemExit: fail and go on
                    completion.set_exception(exc)
                    raise
                else:
                    _resolve(completion, launched)
        await anyio.lowlevel.checkpoint_if_cancelled()

    async def call(self, work: Callable[[], T]) -> T:
        """Run ``work`` on the forward thread, behind the steps queued there (see
        :meth:`Device.call`); outside a block, on one of anyio's worker threads, one at a
        time with the steps, as :meth:`run` runs them there."""
        if self._forward is not None:
            return await self._forward.run(functools.partial(self._in_thread, work))
        serializer = self._current_serializer()
        async with serializer.lock:
            return await anyio.to_thread.run_sync(
                functools.partial(self._in_thread, work), limiter=serializer.limiter
            )

    def _in_thread(self, work: Callable[[], T]) -> T:
        """Run ``work`` in the worker thread; subclasses set up thread state around it."""
        return work()

    async def probe(self) -> None:
        """Run :meth:`_probe` where steps run (the forward thread, behind the queued steps).

        Cancellation abandons the wait; the probe itself still runs.
        """
        if self._forward is not None:
            ticket = self._forward.submit(self._probe)
            await ticket.wait()
            ticket.outcome()
            return
        serializer = self._current_serializer()
        async with serializer.lock:
            await anyio.to_thread.run_sync(
                self._probe, limiter=serializer.limiter, abandon_on_cancel=True
            )

    def _probe(self) -> None:
        """The probe's work, in the worker thread: reaching the thread is all the CPU needs."""

    def abandon(self) -> None:
        """Leave the forward thread behind when the block exits (see :meth:`Device.abandon`)."""
        if self._forward is not None:
            self._forward.abandon()

    def _launch(self, work: Callable[[], Launched[T]]) -> Launched[T]:
        """Run a step's ``work`` in the worker thread."""
        return self._in_thread(work)

    def _current_serializer(self) -> _Serializer:
        serializer = self._serializer.get(None)
        if serializer is None:
            serializer = _Serializer(anyio.Lock(), anyio.CapacityLimiter(1))
            self._serializer.set(serializer)
        return serializer


class CpuDevice(_WorkerThreadDevice):
    """The CPU: each step's whole forward runs in a worker thread.

    torch releases the GIL inside its kernels, so while one core computes step N the loop
    thread applies step N-1 on another: the same overlap as on a GPU, on two cores.
    """

    kind: ClassVar[str] = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.torch_device = torch.device("cpu")


def _check_index(index: object) -> int:
    return check_int_at_least("index", index, 0)


class CudaDevice(_WorkerThreadDevice):
    """One CUDA GPU: the Python launch of each step runs in a worker thread.

    The work only enqueues kernels and records an event (the runner does that), so ``run``
    returns as soon as the launch did and step N+1 is queued while step N executes. The launch
    runs with this GPU as the thread's current device, so streams and events the work creates
    without naming a device are on it.

    Constructing one never touches CUDA (safe at import time and on CPU-only machines);
    :func:`select_device` checks that the GPU exists.

    Args:
        index: The CUDA device index.

    Raises:
        TypeError: ``index`` is not an int.
        ValueError: ``index`` is negative.
    """

    kind: ClassVar[str] = "cuda"

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        self.index = _check_index(index)
        self.torch_device = torch.device("cuda", self.index)

    def free_memory(self) -> int:
        """Bytes free on this GPU (``torch.cuda.mem_get_info``)."""
        free, _ = torch.cuda.mem_get_info(self.torch_device)
        return int(free)

    def _probe(self) -> None:
        """A one-element kernel, then wait for the GPU: raises if its context is gone.

        After an illegal address, a device-side assert or a launch failure the CUDA context
        is unusable and every call raises its error; after an error of one step (a bad
        plan, out of memory) this runs fine. The wait covers the steps queued before it.
        """
        with torch.cuda.device(self.torch_device):
            torch.ones(1, device=self.torch_device).add_(1)
            torch.cuda.synchronize(self.torch_device)

    def _in_thread(self, work: Callable[[], T]) -> T:
        # The current device is per thread, and anyio's worker threads are shared: set it for
        # this call only and restore it after.
        with torch.cuda.device(self.torch_device):
            return work()

    def _launch(self, work: Callable[[], Launched[T]]) -> Launched[T]:
        launched = self._in_thread(work)
        if isinstance(launched, Launched):  # anything else fails the completion as it is
            launched = attrs.evolve(
                launched, event=_GuardedEvent(launched.event, self.torch_device)
            )
        return launched


@attrs.frozen
class _GuardedEvent:
    """An event of a CUDA device, queried with that device current.

    The event loop's thread polls it, and that thread's current device is whatever it was
    (GPU 0 by default): querying an event of GPU 1 there may make the runtime create a
    context on GPU 0. The guard costs two cheap runtime calls per query.
    """

    event: SupportsQuery
    device: torch.device

    def query(self) -> bool:
        with torch.cuda.device(self.device):
            return self.event.query()
