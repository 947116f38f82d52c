"""What a scheduler test runs: requests as reusable specs, and the steps they arrive at.

A :class:`RequestSpec` holds everything needed to build a fresh
:class:`~twostroke.states.request.Request`, and a :class:`Workload` a list of them with their
arrival steps, so one workload can run twice (serial and overlapped, tight and roomy pools)
and the runs be compared. They describe the input only: the hypothesis strategies draw them
(:func:`~twostroke.states.testing.strategies.workloads`) without the harness, and
:func:`~twostroke.states.testing.harness.drive` runs them with every guarantee checked.

A constrained request follows :data:`SIMULATED_VOCABULARY`, the text of the simulated model's
token ids, through :func:`reference_matcher`. Pure: attrs and the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from twostroke.states.params import SamplingParams
from twostroke.states.request import ConstraintCompiled, Request
from twostroke.states.scheduler import SchedulerConfig
from twostroke.states.testing.constraints import ReferenceMatcher

__all__ = ["SIMULATED_VOCABULARY", "RequestSpec", "Workload", "reference_matcher"]

#: The text of each of the simulated model's 64 token ids
#: (:func:`~twostroke.states.simulation.toy_next_token`'s), which a constrained request's
#: :class:`ReferenceMatcher` reads.
#: Every character of the constraint strategies' alphabet is one of them.
SIMULATED_VOCABULARY = tuple("ab0 .écdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ12345678")
assert len(SIMULATED_VOCABULARY) == 64


def reference_matcher(
    params: SamplingParams, eos_token_ids: Iterable[int]
) -> ReferenceMatcher | None:
    """A fresh matcher of ``params.constraint`` over :data:`SIMULATED_VOCABULARY`, or ``None``."""
    if params.constraint is None:
        return None
    return ReferenceMatcher(params.constraint, SIMULATED_VOCABULARY, eos_token_ids)


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _int_set(value: Iterable[int]) -> frozenset[int]:
    return frozenset(value)


def _specs(value: Iterable[RequestSpec]) -> tuple[RequestSpec, ...]:
    return tuple(value)


@attrs.frozen
class RequestSpec:
    """Everything needed to build a fresh :class:`Request`, so one workload can run twice.

    Attributes:
        prompt_token_ids: The tokenized prompt.
        params: Its sampling parameters.
        eos_token_ids: The model's end-of-sequence ids.
    """

    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_ints)
    params: SamplingParams = attrs.field(factory=SamplingParams)
    eos_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_int_set)

    def build(
        self, request_id: int, arrival_time: float = 0.0, *, compiled: bool = True
    ) -> Request:
        """A new request in status WAITING.

        Args:
            request_id: Its id.
            arrival_time: Its arrival timestamp.
            compiled: Give a constrained request its :func:`reference_matcher` (the event
                :class:`~twostroke.states.request.ConstraintCompiled`), as the engine does
                before it queues one; ``False`` leaves it to the caller.

        Returns:
            The request.
        """
        request = Request(
            request_id=request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            arrival_time=arrival_time,
            eos_token_ids=self.eos_token_ids,
        )
        matcher = reference_matcher(self.params, self.eos_token_ids)
        if compiled and matcher is not None:
            request.apply(ConstraintCompiled(matcher))
        return request

    def fits(self, config: SchedulerConfig) -> bool:
        """Whether a scheduler with ``config`` accepts this request (rather than reject it)."""
        total = len(self.prompt_token_ids) + self.build(0).max_tokens
        needed = -(-(total - 1) // config.block_size)
        return (
            bool(self.prompt_token_ids)
            and total <= config.max_model_len
            and (needed <= config.num_blocks)
        )


@attrs.frozen
class Workload:
    """Requests and the step at which each arrives.

    Attributes:
        requests: The requests, in arrival order; the i-th gets request id ``i``.
        arrivals: For each request, how many steps complete before it is submitted (it is
            submitted earlier if the scheduler runs out of work). Empty means all at once.

    Raises:
        ValueError: ``arrivals`` has the wrong length, a negative entry, or decreases.
    """

    requests: tuple[RequestSpec, ...] = attrs.field(converter=_specs)
    arrivals: tuple[int, ...] = attrs.field(default=(), converter=_ints)

    @arrivals.validator
    def _check_arrivals(self, _: object, value: tuple[int, ...]) -> None:
        if value and len(value) != len(self.requests):
            raise ValueError(
                f"arrivals must have one entry per request ({len(self.requests)}), got {len(value)}"
            )
        if any(step < 0 for step in value):
            raise ValueError(f"arrivals must be >= 0, got {value}")
        if list(value) != sorted(value):
            raise ValueError(f"arrivals must not decrease, got {value}")

    def build(self) -> list[tuple[int, Request]]:
        """Fresh requests with ids ``0..n-1``, each with its arrival step."""
        arrivals = self.arrivals or (0,) * len(self.requests)
        return [
            (step, spec.build(request_id, float(step)))
            for request_id, (step, spec) in enumerate(zip(arrivals, self.requests, strict=True))
        ]
