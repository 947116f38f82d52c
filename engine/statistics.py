"""The engine's statistics: a snapshot of its queues, its pool and its two strokes.

:meth:`twostroke.engine.Engine.statistics` returns one; the coordinator's record extends it
(:class:`twostroke.engine.coordinator.statistics.CoordinatorStatistics`).
"""

from __future__ import annotations

import attrs

from twostroke.states.scheduler_config import SchedulerStatistics
from twostroke.states.statistics import count, seconds

__all__ = ["EngineStatistics"]


@attrs.frozen(kw_only=True)
class EngineStatistics(SchedulerStatistics):
    """A snapshot of the engine, cheap to take at any time (:meth:`Engine.statistics`).

    Its scheduler's statistics (:class:`~twostroke.states.scheduler_config.SchedulerStatistics`:
    the queues, the KV pool and prefix cache, the steps and tokens, each under the one name
    it has from the block pool to the server's metrics), and what only the engine knows.
    Every field is a count or seconds (:mod:`twostroke.states.statistics`), so records of
    several engines add up field by field.
    """

    #: Requests submitted whose handle has not ended yet.
    num_open_requests: int = count()
    #: Steps that failed (each failed exactly the requests in it).
    num_failed_steps: int = count()
    #: Seconds the bookkeeping stroke spent in its own work (planning, applying, delivering).
    bookkeeping_seconds: float = seconds()
    #: Seconds the device spent launching steps, timed where they run: on the CPU, computing
    #: them on the device's forward thread; on a GPU, enqueueing their kernels.
    forward_seconds: float = seconds()
    #: Seconds the device sat between the end of one launch and the start of the next while
    #: the engine was busy (the next plan was made while a step was in flight, or right
    #: after one was applied): the time it waited on Python. Not counted: idle time with
    #: nothing to run.
    forward_idle_seconds: float = seconds()
    #: torch threads the forward pass runs on now, on the CPU: the count the engine's
    #: :class:`~twostroke.gpu.cores.ThreadGovernor` last chose, or the fixed
    #: ``torch_threads`` configured (0 on other devices).
    torch_threads: int = count()
    #: Times the governor changed that count (another process took a core, or gave it back).
    num_torch_thread_changes: int = count()
    #: Rows sampled under a structured-output mask: one per token a constrained request
    #: sampled (its matcher's allowed set, filled by the bookkeeping stroke).
    num_masked_rows: int = count()
    #: Seconds the bookkeeping stroke spent filling those masks (at depth 2, while the
    #: step's layers ran).
    mask_fill_seconds: float = seconds()
    #: Seconds the runner waited for masks at sampling, over the steps applied: the part of
    #: the filling the forward did not hide.
    mask_wait_seconds: float = seconds()
