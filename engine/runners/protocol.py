"""The model runner interface: the forward stroke's only view of a model.

A runner turns a :class:`~twostroke.states.plan.StepPlan` into device work and hands back a
:class:`~twostroke.gpu.completion.Launched` (an event that fires when the work is done and a
``readback`` that then reads the sampled ids from host memory into a
:class:`~twostroke.states.plan.RunnerOutput`, which the scheduler applies as it is). It never
blocks on the device itself; the device's :meth:`~twostroke.gpu.device.Device.run` decides
whether ``execute`` runs in a worker thread (CPU) or only enqueues kernels (CUDA).

The one-step lookahead is the runner's business too: a scheduled request with
``pending_input`` takes its last input id from the ids the *previous* step sampled for it,
which the runner keeps on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from twostroke.engine.structured.masks import StepMasks
from twostroke.gpu.completion import Launched
from twostroke.states.plan import RunnerOutput, StepPlan

if TYPE_CHECKING:
    from twostroke.engine.models.plan import RunPlan

__all__ = [
    "InvariantRunner",
    "MaskingRunner",
    "ModelRunner",
    "PlannedRunner",
    "WindowApartRunner",
    "WindowedRunner",
]


class ModelRunner(Protocol):
    """What the engine needs from a model, on any device."""

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) the model accepts."""
        ...

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of KV cache one block of ``block_size`` positions takes (all layers)."""
        ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Create the paged KV cache. Called once, before the first step."""
        ...

    def execute(self, plan: StepPlan) -> Launched[RunnerOutput]:
        """Launch one step.

        Runs synchronously, possibly in a worker thread; on CUDA it only enqueues work and
        records an event. Steps are executed one at a time, in plan order. An exception
        fails every request of the plan; the runner must stay usable for the next plan.
        """
        ...


@runtime_checkable
class MaskingRunner(Protocol):
    """A runner that applies constraints: the engine gives it a step's token masks.

    The engine submits constrained requests only to a runner with this method.
    """

    def execute_masked(self, plan: StepPlan, masks: StepMasks | None) -> Launched[RunnerOutput]:
        """Launch one step whose constrained rows sample under ``masks``.

        ``masks`` (``None`` for a step without constrained rows) may not be filled yet at
        the launch: the runner waits for them (:meth:`StepMasks.wait`) only where it samples
        those rows, on the device's thread, or computes them later (a runner that launches
        inline). Token ids a mask leaves out are never sampled for its row.
        """
        ...


@runtime_checkable
class InvariantRunner(Protocol):
    """A runner that says whether its numbers are batch-invariant; the engine promises
    nothing of a runner that does not."""

    @property
    def deterministic(self) -> bool:
        """Whether a request's tokens and logprobs are a function of the model, its prompt,
        its parameters and its seed alone, whatever the requests, chunks and drafts that
        share its steps."""
        ...


@runtime_checkable
class WindowedRunner(Protocol):
    """A runner that says how far back its model's attention reads: where every layer
    attends within a sliding window, the scheduler gives back each request's blocks behind
    it (:attr:`SchedulerConfig.sliding_window
    <twostroke.states.scheduler_config.SchedulerConfig.sliding_window>`)."""

    @property
    def kv_window(self) -> int | None:
        """The positions every layer's query sees, its own included, or ``None`` where some
        layer sees them all. The runner never reads a position further back: a block table
        may hold padding there."""
        ...


@runtime_checkable
class WindowApartRunner(Protocol):
    """A runner whose model's sliding-window layers, beside global ones, keep their KV
    apart and only as far back as the window (:mod:`~twostroke.engine.runners.window_kv`):
    the engine sizes their pool, gives it to :meth:`allocate_kv_cache`, and runs without
    prefix caching."""

    @property
    def windowed_kv_window(self) -> int | None:
        """The windowed layers' window where they keep their KV apart, else ``None``."""
        ...

    def windowed_kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of the windowed layers' own KV takes."""
        ...

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, *, num_windowed_blocks: int = 0
    ) -> None:
        """Create the caches: ``num_blocks`` of the pool, ``num_windowed_blocks`` of the
        windowed layers' own (0 where they keep none apart)."""
        ...


@runtime_checkable
class PlannedRunner(Protocol):
    """A runner of a model loaded by a plan (:class:`~twostroke.engine.models.plan.RunPlan`):
    the engine shows the plan (:attr:`Engine.plan <twostroke.engine.Engine.plan>`)."""

    @property
    def plan(self) -> RunPlan:
        """What the run decided about its model, once."""
        ...
