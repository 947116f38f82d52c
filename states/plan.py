"""What crosses between the strokes: step plans going forward, outcomes coming back.

A :class:`StepPlan` goes down to the runner; the runner's :class:`RunnerOutput` (or, when the
step raised, a :class:`StepFailure`) comes back and is the scheduler's input as it is, as
vLLM's ``update_from_output(scheduler_output, runner_output)`` takes it: the step id the
runner read from the plan is the id the scheduler checks against its oldest step in flight.
All values are frozen, so a plan in flight cannot change under the step that executes it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

from twostroke.states.params import SamplingParams
from twostroke.states.request import FinishReason
from twostroke.states.validators import frozen_mapping

__all__ = [
    "RunnerOutput",
    "ScheduledRequest",
    "StepFailure",
    "StepPlan",
    "StepReport",
    "TokenLogprobs",
    "verify_draft",
]


@attrs.frozen
class ScheduledRequest:
    """One request's share of a step.

    The step computes positions ``[start, start + num_tokens)``. Their input ids are
    ``token_ids``, followed, when ``pending_input`` is true, by one more id that the host
    does not know yet: the token the *previous step* sampled for this request, which the
    runner takes from that step's output on the device (the one-step lookahead), and then by
    the ``draft_token_ids`` (speculative decoding: :mod:`twostroke.states.speculation`).

    A row with drafts samples at its last ``1 + len(draft_token_ids)`` positions, each as a
    row without drafts would sample there (sample index ``sample_index + i``), and the
    runner reports the tokens sampled up to the first one that differs from the draft at
    its position (:meth:`RunnerOutput.tokens`).

    Attributes:
        request_id: The request.
        start: First position computed in this step.
        token_ids: Known input ids for the first positions.
        pending_input: Whether the last input id comes from the previous step's sample.
        sample: Whether to sample a token from the logits of the last position.
        sample_index: Index in the output of the token sampled here (for seeded sampling:
            the same index gets the same random draw however the batch is composed).
        num_prompt_tokens: The prompt length (positions before it are prompt, after it are
            output; penalties need to tell them apart).
        block_table: KV blocks covering at least positions ``[0, start + num_tokens)``:
            after the first ``num_released_blocks``, the request's own.
        params: The request's sampling parameters.
        draft_token_ids: Drafted tokens verified in this step (only on a row that samples).
        num_released_blocks: Leading entries of ``block_table`` that are padding (block 0):
            positions behind every layer's sliding window, whose blocks the request gave
            back (:class:`~twostroke.states.request.BlocksReleased`). The attention never
            reads them: each query sees only the window before it.
    """

    request_id: int
    start: int
    token_ids: tuple[int, ...]
    pending_input: bool
    sample: bool
    sample_index: int
    num_prompt_tokens: int
    block_table: tuple[int, ...]
    params: SamplingParams
    draft_token_ids: tuple[int, ...] = ()
    num_released_blocks: int = 0

    @property
    def held_blocks(self) -> tuple[int, ...]:
        """The blocks of the table that the request holds (the rest is padding)."""
        return self.block_table[self.num_released_blocks :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.pending_input + len(self.draft_token_ids)

    @property
    def num_samples(self) -> int:
        """Positions the runner samples at: 0, 1, or 1 + the drafts."""
        return (1 + len(self.draft_token_ids)) if self.sample else 0

    @property
    def end(self) -> int:
        """One past the last position computed."""
        return self.start + self.num_tokens

    def written_blocks(self, block_size: int) -> frozenset[int]:
        """The KV blocks this row writes: those covering positions ``[start, end)``."""
        first = self.start // block_size
        last = -(-self.end // block_size)
        return frozenset(self.block_table[first:last])


@attrs.frozen
class StepPlan:
    """Everything a runner needs for one step, in the order it should batch requests.

    ``finished_request_ids`` lists requests the runner will not see again (their per-request
    device state, such as sampler history, may be dropped). ``preempted_request_ids`` lists
    requests preempted since the last plan: each is recomputed from its first uncached
    position when it is admitted again, so KV the runner keeps for it outside the block
    table (a windowed layer's, :mod:`twostroke.engine.runners.window_kv`) may be dropped
    before this plan's rows run. ``planned_behind`` is the step
    that was in flight when this one was planned (``None`` if none was): if that step fails,
    some rows of this one may be stranded (see :meth:`stranded_by`).
    """

    step_id: int
    requests: tuple[ScheduledRequest, ...]
    finished_request_ids: tuple[int, ...] = ()
    planned_behind: int | None = None
    preempted_request_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.requests)

    @property
    def num_samples(self) -> int:
        """Rows that sample a token (a row with drafts counts once)."""
        return sum(entry.sample for entry in self.requests)

    @property
    def request_ids(self) -> tuple[int, ...]:
        return tuple(entry.request_id for entry in self.requests)

    def written_blocks(self, block_size: int) -> frozenset[int]:
        """The KV blocks some row of this step writes."""
        return frozenset().union(*(entry.written_blocks(block_size) for entry in self.requests))

    def stranded_by(self, failed: StepPlan, block_size: int) -> frozenset[int]:
        """The requests whose rows here cannot run because ``failed`` (an earlier step) did.

        They are the failed step's own requests (their rows may take an input it never
        sampled) and the requests that read KV it was writing: a prefix-cache hit on a block
        still being filled when this step was planned. Only the step this one was planned
        behind can strand rows of it: with at most
        :data:`~twostroke.states.validators.MAX_PIPELINE_DEPTH` steps in flight, that is the
        only step that can fail after this one was planned. The forward stroke drops these
        rows before it launches this step; the prefix cache uncaches what they write
        (:meth:`~twostroke.states.prefix_cache.PrefixCache.distrust`).
        """
        if self.planned_behind != failed.step_id:
            # Planned once the failure was applied: the scheduler left the failed requests
            # out, and blocks the failed step wrote may since belong to someone else.
            return frozenset()
        written = failed.written_blocks(block_size)
        failed_ids = set(failed.request_ids)
        return frozenset(
            entry.request_id
            for entry in self.requests
            if entry.request_id in failed_ids or not written.isdisjoint(entry.held_blocks)
        )

    def without(self, request_ids: Collection[int]) -> StepPlan:
        """This plan less the rows of ``request_ids`` (same step id, same order otherwise).

        The forward stroke uses it when the step before this one failed: the requests of
        that step have failed, and their rows here may take an input the failed step never
        sampled.
        """
        kept = tuple(entry for entry in self.requests if entry.request_id not in request_ids)
        return attrs.evolve(self, requests=kept)


@attrs.frozen
class TokenLogprobs:
    """Log-probability of the chosen token and of the top alternatives at one position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class RunnerOutput:
    """What one step produced, as the runner read it back to the host.

    Attributes:
        step_id: The id of the plan the runner executed.
        sampled: The sampled token id for every request of the plan that sampled.
        logprobs: For requests that asked for logprobs, the chosen token's and the top
            alternatives' log-probabilities.
        speculated: For a row with drafts, the tokens after ``sampled``'s: the token sampled
            at each position while the token before it equalled its draft (so at most as
            many as the drafts; a row whose first draft was rejected has none here).
        speculated_logprobs: Their log-probabilities, for requests that asked for them.

    The mappings are read-only copies of those given (assigning raises ``TypeError``).
    """

    step_id: int
    sampled: Mapping[int, int] = attrs.field(converter=frozen_mapping)
    logprobs: Mapping[int, TokenLogprobs] = attrs.field(factory=dict, converter=frozen_mapping)
    speculated: Mapping[int, tuple[int, ...]] = attrs.field(factory=dict, converter=frozen_mapping)
    speculated_logprobs: Mapping[int, tuple[TokenLogprobs, ...]] = attrs.field(
        factory=dict, converter=frozen_mapping
    )

    def tokens(self, request_id: int) -> tuple[int, ...]:
        """Every token the step produced for a request that sampled, in order."""
        return (self.sampled[request_id], *self.speculated.get(request_id, ()))

    def token_logprobs(self, request_id: int) -> tuple[TokenLogprobs, ...]:
        """The log-probabilities of :meth:`tokens`, for a request that asked for them."""
        first = self.logprobs.get(request_id)
        if first is None:
            return ()
        return (first, *self.speculated_logprobs.get(request_id, ()))


def verify_draft(draft_token_ids: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts a row accepts: the drafts that equal the token sampled at their
    position, up to the first that does not (``sampled`` has one more token than the draft).
    """
    accepted = 0
    for draft_id, token_id in zip(draft_token_ids, sampled, strict=False):
        if draft_id != token_id:
            break
        accepted += 1
    return accepted


@attrs.frozen
class StepFailure:
    """A step that raised instead of producing a :class:`RunnerOutput`.

    Every request in it fails with ``message`` (its ``Request.failure``).
    """

    step_id: int
    message: str


@attrs.frozen
class StepReport:
    """What applying one outcome changed, for the engine to deliver.

    Attributes:
        new_tokens: ``(request_id, token_id)`` for every token appended to a live request
            (tokens for requests that ended meanwhile are dropped and not listed).
        finished: ``(request_id, reason)`` for requests that finished on this outcome.
        failed: Requests that failed with this step.
    """

    new_tokens: tuple[tuple[int, int], ...] = ()
    finished: tuple[tuple[int, FinishReason], ...] = ()
    failed: tuple[int, ...] = ()
