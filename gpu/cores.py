"""How many torch threads the forward pass takes: all its cores while they are free, fewer
while other work wants them.

torch's intra-op threads are an OpenMP team, and a team is only as fast as its slowest
thread: at each of a step's hundreds of barriers the others wait for it. On a machine the
team has to itself, every core pays, and more so when the waiting threads spin for a while
before they sleep (OpenMP's default, :mod:`twostroke.gpu.openmp`). On a machine shared with
other work, a team thread that loses its core holds up its partners at every barrier, and
spinning partners burn the time slices the descheduled thread needs. Measured inside the
engine (docs/performance-log.md, "Spinning waits inside the engine"; AVX2 EPYC, 2 cores,
SmolLM2-135M, 32 requests): on an idle machine two spinning threads ran at 43.7 output tok/s
against 39.1 for two sleeping ones; with one other process busy on one core, two spinning
threads ran at 11.7, two sleeping ones at 25.9, and one thread at 27.7 either way.

A :class:`ThreadGovernor` takes both columns' better figure. Between steps, on the thread
that runs them, it reads two counters the kernel keeps and moves the thread count by one
when the last window (at least :data:`WINDOW` seconds) asks for it:

- **one thread fewer** when the forward thread was runnable but not running (waiting on a
  run queue: someone else had its core) for :data:`CONTENDED` of the window or more;
- **one thread more** when the cores this process may run on were idle, together, for at
  least :data:`SPARE` of a core through the window (a core the team could have used), and
  the forward thread itself did not wait.

The two signals are asymmetric on purpose. Idle time is what a smaller team leaves on the
table, but a full team leaves none (its threads spin or compute), so contention is read from
the forward thread's own run-queue wait, which is there whatever took the core: another
process, another engine in this process, the event loop's thread.

The thresholds sit well apart from what the engine's windows show (32 requests, 2 cores,
docs/performance-log.md, "Fewer threads while other work wants the cores"): on a quiet machine
the forward thread waited 0-3 % of each window with 0.08-0.17 cores idle (10-14 % with one
request, whose short steps leave the event loop's bookkeeping a larger share); with one
other core busy, 40 % at two threads, then 0-2 % with no idle core at one. There the governed
engine ran 1.09-1.19x faster than two fixed threads with sleeping waits and 2.7x faster with
spinning ones, and on the quiet machine as fast.

Both counters are Linux's (``/proc/stat``, ``/proc/thread-self/schedstat``). Where they
cannot be read, the count stays at its most.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import attrs
import torch

from twostroke.gpu.validators import check_int_at_least, check_seconds

__all__ = [
    "CONTENDED",
    "SPARE",
    "WINDOW",
    "CoreSample",
    "ThreadGovernor",
    "read_core_sample",
    "usable_cores",
]

logger = logging.getLogger("twostroke.gpu.cores")

#: The shortest window the governor judges, in seconds: long enough for ``/proc/stat``'s
#: ticks (10 ms on most kernels) to be a small error on each core.
WINDOW = 0.25

#: The fraction of a window the forward thread may wait on a run queue before the team
#: loses a thread. Above what the engine's own event loop causes: with one request on two
#: cores, the loop's bookkeeping beside a step made the forward thread wait 10-14 % of a
#: window, and at 0.1 the team lost a thread every other window (each a quarter of a second
#: at half speed); another process busy on one core makes it wait about 40 %.
CONTENDED = 0.25

#: The idle time, in cores, a window must show before the team gains a thread.
SPARE = 0.75


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset)
    where the platform has one, else ``os.cpu_count()``; at least 1."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return max(1, len(affinity(0)))
    return os.cpu_count() or 1


@attrs.frozen
class CoreSample:
    """Cumulative counters at one moment; a window is the difference of two samples.

    Attributes:
        wall: Seconds on a monotonic clock.
        idle: Core-seconds the CPUs this process may run on spent idle, since boot.
        waited: Seconds the sampling thread spent runnable but not running, since it started.
    """

    wall: float
    idle: float
    waited: float


def read_core_sample(
    stat: str = "/proc/stat", schedstat: str = "/proc/thread-self/schedstat"
) -> CoreSample | None:
    """Sample the calling thread's run-queue wait and its CPUs' idle time, from Linux's files.

    Args:
        stat: The kernel's CPU statistics (``cpuN`` lines, in clock ticks).
        schedstat: The calling thread's scheduler statistics (nanoseconds on a CPU, waiting
            on a run queue, and time slices).

    Returns:
        The sample, or ``None`` where the files cannot be read or parsed (not Linux, or a
        kernel without scheduler statistics).
    """
    wall = time.monotonic()
    try:
        cpus = os.sched_getaffinity(0)
        ticks = os.sysconf("SC_CLK_TCK")
        with open(schedstat, encoding="ascii") as file:
            waited_ns = int(file.read().split()[1])
        idle_ticks = 0
        with open(stat, encoding="ascii") as file:
            for line in file:
                name, _, fields = line.partition(" ")
                if not name.startswith("cpu") or not name[3:].isdigit():
                    continue
                if int(name[3:]) in cpus:
                    values = fields.split()
                    idle_ticks += int(values[3]) + int(values[4])  # idle, iowait
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    return CoreSample(wall=wall, idle=idle_ticks / ticks, waited=waited_ns / 1e9)


class ThreadGovernor:
    """Sets the calling thread's torch thread count between steps, from 1 to ``most``.

    Call :meth:`adjust` on the thread that runs the steps, before each step: the count it
    sets is that thread's (torch's OpenMP team belongs to the thread that starts it). It
    starts at ``most``.

    Args:
        most: The most threads (the cores the forward pass may use).
        window: The shortest window judged, in seconds.
        sample: Reads the counters (:func:`read_core_sample`; tests pass their own).
        apply: Sets the count (``torch.set_num_threads``; tests pass their own).
        clock: The clock of the samples' ``wall`` (``time.monotonic``): the counters are read
            only once a window may have ended.

    Raises:
        TypeError, ValueError: ``most`` is not an int >= 1, or ``window`` not a number > 0.
    """

    def __init__(
        self,
        most: int,
        *,
        window: float = WINDOW,
        sample: Callable[[], CoreSample | None] = read_core_sample,
        apply: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.most = check_int_at_least("most", most, 1)
        self._window = check_seconds("window", window, positive=True)
        self._sample = sample
        self._apply = apply
        self._clock = clock
        self._threads = most
        self._start: CoreSample | None = None
        self._readable = most > 1
        #: How many times the count changed.
        self.changes = 0

    def __repr__(self) -> str:
        return f"<ThreadGovernor {self._threads} of {self.most} threads, {self.changes} changes>"

    @property
    def threads(self) -> int:
        """The count :meth:`adjust` last set (``most`` before the first call)."""
        return self._threads

    def adjust(self) -> int:
        """Judge the window that ends now, if it is long enough, and set the count for the
        next step.

        Returns:
            The thread count for the next step.
        """
        if not self._readable:
            return self._threads
        if self._start is not None and self._clock() - self._start.wall < self._window:
            return self._threads
        now = self._sample()
        if now is None:
            # Not Linux: keep every core, as a fixed count would.
            self._readable = False
            return self._threads
        start, self._start = self._start, now
        if start is None:
            self._apply(self._threads)
            return self._threads
        span = now.wall - start.wall
        waited = (now.waited - start.waited) / span
        idle = (now.idle - start.idle) / span
        if waited >= CONTENDED:
            if self._threads > 1:
                self._set(self._threads - 1, f"it waited for a core {waited:.0%} of {span:.2f} s")
        elif self._threads < self.most and idle >= SPARE:
            self._set(self._threads + 1, f"{idle:.2f} cores idle for {span:.2f} s")
        return self._threads

    def _set(self, threads: int, why: str) -> None:
        self._apply(threads)
        self._threads = threads
        self.changes += 1
        logger.debug("the forward pass now runs %d torch threads: %s", threads, why)
