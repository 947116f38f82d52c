"""Launching a plan on the device's thread: timed, with its masks, and without the rows the
failure of the step before strands.

The forward stroke hands each plan to the device with a :class:`Launcher` as the function to
run; the device calls it on its own thread, one launch at a time, in plan order. Kept apart
from :mod:`twostroke.engine.engine`, which decides *what* to launch and *when*: this module
knows how a launch goes right and what one that failed leaves behind, and what the device's
time went to (:class:`LaunchTimer`: launching steps, or waiting between them for Python).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from twostroke.engine.runners.protocol import MaskingRunner, ModelRunner
from twostroke.engine.structured.masks import StepMasks
from twostroke.gpu.completion import Launched, ReadyEvent
from twostroke.gpu.cores import ThreadGovernor
from twostroke.states.plan import RunnerOutput, StepPlan

__all__ = ["LaunchTimer", "Launcher"]


class Launcher:
    """Launches an engine's steps on its runner.

    Args:
        runner: The engine's runner.
        block_size: Tokens per KV block (which rows a failed step strands depends on it).
        governor: Sets torch's thread count before each launch, from what the cores are
            doing (on the CPU, when the configuration leaves ``torch_threads`` to the engine).
    """

    def __init__(
        self, runner: ModelRunner, *, block_size: int, governor: ThreadGovernor | None = None
    ) -> None:
        self._runner = runner
        self.governor = governor
        self._masking = runner if isinstance(runner, MaskingRunner) else None
        self._block_size = block_size
        self._failed: StepPlan | None = None
        #: The launches' time and the device's waits between them.
        self.timer = LaunchTimer()
        # The open recordings (record()); replaced, never mutated, so the device's thread
        # reads a consistent tuple while the event loop's opens or closes one.
        self._recordings: tuple[list[StepPlan], ...] = ()

    @contextmanager
    def record(self) -> Iterator[list[StepPlan]]:
        """The plans launched while the block is open, in launch order, as launched (less
        the rows a failed step stranded); see
        :meth:`~twostroke.engine.engine.Engine.record_steps`."""
        plans: list[StepPlan] = []
        self._recordings = (*self._recordings, plans)
        try:
            yield plans
        finally:
            self._recordings = tuple(r for r in self._recordings if r is not plans)

    @property
    def applies_masks(self) -> bool:
        """Whether the runner samples constrained rows under masks (a :class:`MaskingRunner`)."""
        return self._masking is not None

    def __call__(
        self, plan: StepPlan, continues: bool, masks: StepMasks | None = None
    ) -> Launched[RunnerOutput]:
        """Time the launch of one step (on the device's thread) and launch it.

        ``continues``: the plan was made while a step was in flight or right after one was
        applied (the wait before it counts as the device's idle time, see
        :class:`LaunchTimer`).
        """
        if self.governor is not None:
            self.governor.adjust()
        with self.timer.launch(continues=continues):
            return self._launch(plan, masks)

    def _launch(self, plan: StepPlan, masks: StepMasks | None) -> Launched[RunnerOutput]:
        """Launch one step, without the rows that the failure of the step before strands.

        With the one-step lookahead, the plan of step N+1 was made before step N failed (and
        no later plan was:
        :data:`~twostroke.states.validators.MAX_PIPELINE_DEPTH`). Rows of step N's requests
        in it may take their input from step N's samples, which do not exist, and rows that
        took a prefix-cache hit on a block step N was filling would read KV that was never
        written. The scheduler fails the first and recomputes the second when it applies
        step N's failure; here their rows are dropped (their blocks come back when step N+1
        completes) and the rest of step N+1 runs as planned.
        """
        failed, self._failed = self._failed, None
        if failed is not None:
            plan = plan.without(plan.stranded_by(failed, self._block_size))
            if not plan.requests:
                empty = RunnerOutput(step_id=plan.step_id, sampled={})
                return Launched(event=ReadyEvent(), readback=lambda: empty)
        for recording in self._recordings:
            recording.append(plan)
        try:
            if masks is not None:
                assert self._masking is not None  # submit refuses constraints otherwise
                return self._masking.execute_masked(plan, masks)
            return self._runner.execute(plan)
        except BaseException:
            self._failed = plan
            raise


class LaunchTimer:
    """Times each launch of a step where it runs, and the device's wait before it.

    ``forward_seconds`` adds up the launches; ``forward_idle_seconds`` the gaps between the
    end of one launch and the start of the next that *continues* a busy run (its plan was
    made while a step was in flight, or right after one was applied): time the device
    waited on Python. A gap before a launch that does not continue one (the engine was idle,
    with nothing to run) is not counted.

    Launches run one at a time, on the device's thread; the engine's statistics read the two
    sums from the event loop's thread (a float read is atomic under the GIL).

    Args:
        clock: Seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.forward_seconds = 0.0
        self.forward_idle_seconds = 0.0
        self._last_end: float | None = None

    @contextmanager
    def launch(self, *, continues: bool) -> Iterator[None]:
        """Time the launch in the body; count the wait before it if it ``continues``."""
        began = self._clock()
        if continues and self._last_end is not None:
            self.forward_idle_seconds += began - self._last_end
        try:
            yield
        finally:
            self._last_end = self._clock()
            self.forward_seconds += self._last_end - began
