"""The model runner interface: the forward stroke's only view of a model.

A runner turns a :class:`~twostroke.states.plan.StepPlan` into device work and hands back a
:class:`~twostroke.gpu.completion.Launched` (an event that fires when the work is done and a
``readback`` that then reads the sampled ids from host memory). It never blocks on the device
itself; the device's :meth:`~twostroke.gpu.device.Device.run` decides whether ``execute`` runs
in a worker thread (CPU) or only enqueues kernels (CUDA).

The one-step lookahead is the runner's business too: a scheduled request with
``pending_input`` takes its last input id from the ids the *previous* step sampled for it,
which the runner keeps on the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import attrs

from twostroke.gpu.completion import Launched
from twostroke.states.plan import StepPlan
from twostroke.states.validators import frozen_mapping

__all__ = ["ModelRunner", "RunnerOutput", "TokenLogprobs"]


@attrs.frozen
class TokenLogprobs:
    """Log-probability of the chosen token and of the top alternatives at one position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class RunnerOutput:
    """What one step produced, as read back to the host.

    Attributes:
        step_id: The plan's step id.
        sampled: The sampled token id for every request of the plan that sampled.
        logprobs: For requests that asked for logprobs, the chosen token's and the top
            alternatives' log-probabilities.

    Both mappings are read-only copies of those given (assigning raises ``TypeError``).
    """

    step_id: int
    sampled: Mapping[int, int] = attrs.field(converter=frozen_mapping)
    logprobs: Mapping[int, TokenLogprobs] = attrs.field(factory=dict, converter=frozen_mapping)


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
