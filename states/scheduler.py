"""The scheduler: which requests compute which positions in the next step.

There are no prefill and decode phases (vLLM's insight): every request has a computed-token
count that catches up with its token count under a per-step token budget. This one rule gives
chunked prefill, mixed prefill/decode batches and recompute after preemption.

The one-step lookahead is built in. :meth:`Scheduler.schedule` may plan step N+1 while step N
is in flight: a request that samples in step N holds a *placeholder* for that token, and step
N+1 feeds it as a *pending input* that the runner takes from step N's output on the device.
:meth:`Scheduler.apply` then applies step N's outcome. Two rules keep memory safe:

* blocks of a request that ends (or is preempted) while a step that uses them is in flight
  are released only when that step's outcome is applied;
* a preempted request is not readmitted while a step in flight still owes it a token.

Policy: every request has a *rank*, fixed when it arrives: ``(priority * N + s, arrival)``,
where ``priority`` is its :attr:`~twostroke.states.params.SamplingParams.priority` (lower runs
first, vLLM's), ``N`` is ``priority_aging_steps``, ``s`` is the number of steps planned
before it arrived, and ``arrival`` counts submissions (FIFO among equals). Running requests
are served in rank order; admission takes the waiting requests in rank order and stops at the
first that does not fit (so none is passed by a lower one while it waits for room); when a
running request needs a block and none is free, the running request of the largest rank is
preempted (recomputed later), so the smallest always progresses. With every priority equal,
the rank is the arrival order: FIFO admission, the newest preempted first.

Aging: ``s`` counts in the rank at a rate of one priority level per ``N`` steps, so a request
that waited ``k * N`` steps ranks as one ``k`` levels better that arrives now. A fixed rank
needs no re-sorting as time passes, and it bounds waiting: a request of priority ``p`` is
passed only by requests that arrive less than ``(p - q) * N`` steps after it (``q`` their
priority), and from then on it is served as the oldest request of a FIFO queue would be.
The order of preemption follows the same rank, not the priority alone: otherwise a stream of
higher-priority arrivals could preempt an admitted request again and again.
With ``max_waiting_requests`` set, a new request that would pass it is refused
(:class:`~twostroke.states.errors.EngineOverloaded`) and nothing changes.

With ``speculative_config``, a running request whose row reaches its end may carry drafted
tokens (:mod:`twostroke.states.speculation`), proposed here, while the step before runs. The
drafts count against the step's token budget, never make a request wait or preempt another
(a draft that does not fit is dropped), and never pass ``max_tokens``. A request that
verifies drafts in a step in flight is not planned again until that step's outcome says how
many held: its next positions depend on it. A constrained request's draft ends at the first
token its constraint refuses: cut here, on a fork of its matcher, when no token of it is in
flight, and otherwise by the masks of the drafted positions (filled on forks followed through
the drafts once the token in flight is applied: a refused draft is never sampled). Requests
with penalties do not draft (their penalties at a drafted position would depend on the drafts
before it): they decode as without speculation.

Both queues are kept in rank order. A new request of the same priority as the waiting
queue's last ranks after it, so it is appended at O(1) cost; a request of a better priority
and a preempted one go into the middle, found by binary search.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from twostroke.states.blocks import BlockPool, blocks_for
from twostroke.states.constraints import Matcher
from twostroke.states.errors import EngineOverloaded, RequestRejected, SchedulerError
from twostroke.states.plan import RunnerOutput, ScheduledRequest, StepFailure, StepPlan, StepReport
from twostroke.states.prefix_cache import PrefixCache
from twostroke.states.request import (
    Admitted,
    BlocksAllocated,
    BlocksReleased,
    Cancelled,
    ChunkScheduled,
    DraftVerified,
    Failed,
    Finished,
    FinishReason,
    Preempted,
    Request,
    RequestEvent,
    RequestStatus,
    SampleDiscarded,
    SampleScheduled,
    TokenSampled,
)
from twostroke.states.scheduler_config import (
    SchedulerConfig,
    SchedulerStatistics,
    SchedulingPolicy,
)
from twostroke.states.speculation import MAX_SPECULATIVE_TOKENS, Speculator

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStatistics", "SchedulingPolicy"]


class Scheduler:
    """Plans steps over a :class:`BlockPool` and applies their outcomes.

    Args:
        config: Sizes and limits.
        clock: Source of timestamps for the requests' timings (monotonic seconds). Tests
            pass a fake one; nothing in this module reads the time otherwise.
        speculator: Drafts for running requests; by default one for
            ``config.speculative_config`` (none without it). Tests give one with drafts of
            their own choosing.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        speculator: Speculator | None = None,
    ) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self._prefix = PrefixCache(self.pool, enabled=config.enable_prefix_caching)
        spec = config.speculative_config
        if speculator is None and spec is not None:
            speculator = Speculator(spec)
        self._speculator = speculator
        self._clock = clock
        self._requests: dict[int, Request] = {}
        self._rank: dict[int, tuple[int, int]] = {}
        self._arrivals = itertools.count()
        # Both in rank order (see the module's docstring): admission takes the first waiting,
        # preemption the last running.
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        # Terminal requests whose blocks a step in flight still uses.
        self._ending: set[int] = set()
        self._inflight: collections.deque[StepPlan] = collections.deque()
        # Blocks to release when a step completes, by step id. Keyed, not queued: requests
        # end in any order (a cancel for step N may come after one for step N+1).
        self._deferred: dict[int, list[int]] = {}
        # Requests recomputed because they read KV a failed step never wrote: the samples
        # of their steps in flight, up to this step id, are garbage and are discarded.
        self._discard: dict[int, int] = {}
        self._gone: list[int] = []
        self._preempted: list[int] = []
        # The windowed layers' pool's reservations of the running requests (and of ended
        # ones a step in flight still computes), by request id: see twostroke.states.windowed.
        self._windowed: dict[int, int] = {}
        # Finished requests' cached blocks held for their cache_ttl, oldest first: (when
        # the pin ends, its blocks). Each holds one reference per block.
        self._pins: collections.deque[tuple[float, tuple[int, ...]]] = collections.deque()
        self._next_step = 0
        self._num_completed = 0
        self._num_tokens_scheduled = 0
        self._num_tokens_generated = 0
        self._num_preemptions = 0

    # --- queries ------------------------------------------------------------------------

    def get(self, request_id: int) -> Request | None:
        """The live record of a request, or ``None`` once it has been removed."""
        return self._requests.get(request_id)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests.values()))

    @property
    def speculator(self) -> Speculator | None:
        """What drafts for the running requests, or ``None``."""
        return self._speculator

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    @property
    def inflight_plans(self) -> tuple[StepPlan, ...]:
        return tuple(self._inflight)

    @property
    def pinned_blocks(self) -> tuple[int, ...]:
        """The blocks finished requests' ``cache_ttl`` pins hold, oldest pin first."""
        return tuple(block_id for _, block_ids in self._pins for block_id in block_ids)

    @property
    def can_schedule(self) -> bool:
        """Whether the pipeline has room for another step."""
        return len(self._inflight) < self.config.pipeline_depth

    def is_idle(self) -> bool:
        """No request record and no step in flight: every block is free."""
        return not self._requests and not self._inflight

    def rank(self, request_id: int) -> tuple[int, int]:
        """A live request's rank: admission takes the smallest first, preemption the largest.

        ``(priority * priority_aging_steps + steps planned before it arrived, arrival)``:
        fixed when it arrives (see the module's docstring).

        Raises:
            KeyError: the scheduler holds no record of ``request_id``.
        """
        return self._rank[request_id]

    # --- admission and removal ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request in the waiting queue, at its rank (by its priority, then arrival).

        Raises:
            RequestRejected: it can never be served (empty prompt, too long for the context
                or for the whole KV pool); nothing is queued.
            EngineOverloaded: the waiting queue is full (``max_waiting_requests``); nothing
                is queued.
            SchedulerError: the id is in use, the request is not new, or it has a constraint
                but not its matcher yet (:class:`~twostroke.states.request.ConstraintCompiled`).
        """
        self.check_request(request)
        if request.params.constraint is not None and request.matcher is None:
            raise SchedulerError(
                f"request {request.request_id} has a constraint but no matcher: "
                "apply ConstraintCompiled before queueing it"
            )
        rank = (
            request.params.priority * self.config.priority_aging_steps + self._next_step,
            next(self._arrivals),
        )
        self._requests[request.request_id] = request
        self._rank[request.request_id] = rank
        waiting = self._waiting
        if not waiting or rank > self._rank_of(waiting[-1]):
            waiting.append(request)  # the common case (one priority): no search
        else:
            self._insert(waiting, request)

    def check_request(self, request: Request) -> None:
        """Return if :meth:`add_request` would take ``request`` now; change nothing.

        The engine asks it before the work that comes ahead of queueing a constrained
        request (compiling its constraint, which gives the request its matcher), so a
        request it can never serve is refused at once.

        Raises:
            RequestRejected, EngineOverloaded, SchedulerError: as :meth:`add_request`, but
                for the matcher, which a constrained request may not have yet.
        """
        config = self.config
        if request.request_id in self._requests:
            raise SchedulerError(f"request id {request.request_id} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_generated_tokens:
            raise SchedulerError(f"request {request.request_id} is not new: {request!r}")
        if not request.prompt_token_ids:
            raise RequestRejected("the prompt must contain at least one token, got 0")
        total = request.num_prompt_tokens + request.max_tokens
        if total > config.max_model_len:
            raise RequestRejected(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.max_tokens}) must be <= max_model_len "
                f"({config.max_model_len}), got {total}",
                num_prompt_tokens=request.num_prompt_tokens,
                max_tokens=request.max_tokens,
                max_model_len=config.max_model_len,
            )
        needed = self.most_blocks_held(total)
        if needed > config.num_blocks:
            raise RequestRejected(
                f"prompt + max_tokens ({total} tokens) needs {needed} KV blocks of "
                f"{config.block_size}, but the pool has only {config.num_blocks}"
            )
        windowed = config.windowed_kv
        if windowed is not None:
            reservation = windowed.reservation(
                total, block_size=config.block_size, max_drafts=self._max_drafts()
            )
            reserve = windowed.step_reserve(
                block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens
            )
            if reserve + reservation > windowed.num_blocks:
                raise RequestRejected(
                    f"prompt + max_tokens ({total} tokens) needs {reservation} blocks of the "
                    f"windowed layers' pool beside a step's {reserve}, but it has only "
                    f"{windowed.num_blocks}"
                )
        self.check_waiting_room()

    def check_waiting_room(self) -> None:
        """Return if the waiting queue has room for a new request.

        Cheap (a length and a comparison): the engine asks before it tokenizes a prompt.

        Raises:
            EngineOverloaded: ``max_waiting_requests`` requests (or more: preempted requests
                always go back) are waiting; nothing changes.
        """
        limit = self.config.max_waiting_requests
        if limit is not None and len(self._waiting) >= limit:
            raise EngineOverloaded(
                f"the waiting queue is full: {len(self._waiting)} requests wait for admission "
                f"and max_waiting_requests is {limit}; retry later"
            )

    def cancel(self, request_id: int) -> bool:
        """Cancel a request at any point of its life. Idempotent.

        Its blocks are free at once, or, if a step in flight uses them, when that step's
        outcome is applied.

        Returns:
            Whether the request was live (``False`` for unknown or already ended ones).
        """
        request = self._requests.get(request_id)
        if request is None or request.is_terminal:
            return False
        self._end(request, Cancelled(self._clock()))
        return True

    def finish_on_stop_string(self, request_id: int) -> bool:
        """Finish a decoding request whose text matched a stop string (reason ``STOP``).

        Stop strings are text, which the engine makes and matches; every stop on token ids
        is the request's own (:meth:`Request.finish_reached`).

        Returns:
            Whether the request was live.

        Raises:
            InvalidTransition: the request is waiting or prefilling (it has not sampled
                yet); nothing changes.
        """
        request = self._requests.get(request_id)
        if request is None or request.is_terminal:
            return False
        self._end(request, Finished(FinishReason.STOP, self._clock()))
        return True

    def fail(self, request_id: int, message: str) -> bool:
        """Fail a live request for a reason of its own (its constraint's backend gave up).

        Its blocks come back as for a cancel. The engine delivers the failure itself (it is
        not in any :class:`StepReport`).

        Returns:
            Whether the request was live.
        """
        request = self._requests.get(request_id)
        if request is None or request.is_terminal:
            return False
        self._end(request, Failed(message, self._clock()))
        return True

    # --- planning -----------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or return ``None`` if no request can compute anything.

        Raises:
            SchedulerError: ``pipeline_depth`` steps are already in flight.
        """
        if not self.can_schedule:
            raise SchedulerError(
                f"can't plan a step while {len(self._inflight)} steps are in flight "
                f"(pipeline_depth={self.config.pipeline_depth})"
            )
        config = self.config
        step_id = self._next_step
        budget = config.max_num_batched_tokens
        entries: list[ScheduledRequest] = []
        preempted = False
        self._expire_pins()

        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            num_tokens = self._tokens_to_compute(request, budget)
            if num_tokens == 0:
                index += 1
                continue
            self._slide(request)
            drafts, needed = self._fit_draft(
                request,
                num_tokens,
                budget,
                computed=request.num_computed_tokens,
                held=request.num_table_blocks,
                room=self.pool.num_free,
            )
            self._unpin(needed)
            # (The second test only when the first fails: it counts the deferred releases.)
            while needed > self.pool.num_free and (
                needed > self.pool.num_free + self._num_returning_blocks()
            ):
                victim = self._running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break  # it ranked last; nothing after it is left to serve
            index += 1
            if needed > self.pool.num_free:
                continue  # blocks come back when the step in flight completes
            entries.append(self._schedule(request, step_id, num_tokens, needed, drafts))
            budget -= num_tokens + len(drafts)

        while (
            not preempted
            and self._waiting
            and budget > 0
            and len(self._running) < config.max_num_seqs
        ):
            request = self._waiting[0]
            if self._step_in_flight(request) is not None:
                break  # a step in flight still owes it a token; keep rank order
            # The longest cached prefix is skipped; cached (free) blocks it takes back from
            # the pool are no longer free for the rest.
            hits = self._prefix.match(request)
            computed = len(hits) * config.block_size
            num_tokens = self._tokens_to_compute(request, budget, computed)
            # With a sliding window, the hit's blocks behind its first query's window go
            # back as soon as they are claimed (_slide, below): they cost no room.
            kept = hits[self._behind_window(computed, request.num_known_tokens) :]
            reclaimed = sum(1 for block_id in kept if not self.pool.ref_count(block_id))
            drafts, needed = self._fit_draft(
                request,
                num_tokens,
                budget,
                computed=computed,
                held=len(hits),
                room=self.pool.num_free - reclaimed,
            )
            if num_tokens and self._unpin(needed + reclaimed):
                continue  # pinned blocks went back to the pool: match and count again
            if num_tokens == 0 or needed + reclaimed > self.pool.num_free:
                break
            reservation = self._windowed_reservation(request)
            if reservation > self._windowed_room():
                break  # the windowed layers' pool: a running request's end frees some
            self._waiting.popleft()
            if config.windowed_kv is not None:
                self._windowed[request.request_id] = reservation
            request.apply(Admitted(self._clock()))
            self._prefix.claim(request, hits)  # before anything is allocated
            self._slide(request)
            self._insert(self._running, request)
            entries.append(self._schedule(request, step_id, num_tokens, needed, drafts))
            budget -= num_tokens + len(drafts)

        if not entries:
            return None
        # Only now, with the plan complete, may later steps match the blocks it writes.
        self._prefix.commit(self._requests[entry.request_id] for entry in entries)
        gone, self._gone = tuple(self._gone), []
        preempted_ids, self._preempted = tuple(self._preempted), []
        plan = StepPlan(
            step_id=step_id,
            requests=tuple(entries),
            finished_request_ids=gone,
            preempted_request_ids=preempted_ids,
            planned_behind=self._inflight[-1].step_id if self._inflight else None,
        )
        self._next_step += 1
        self._inflight.append(plan)
        return plan

    def _tokens_to_compute(self, request: Request, budget: int, computed: int | None = None) -> int:
        if request.num_drafts:
            return 0  # where its next positions are depends on the step verifying its drafts
        if request.num_generated_tokens >= request.max_tokens:
            return 0  # its last token is in flight; computing its KV would be waste
        if computed is None:
            computed = request.num_computed_tokens
        return min(request.num_tokens - computed, budget)

    def _draft(
        self, request: Request, num_tokens: int, budget: int, computed: int
    ) -> tuple[int, ...]:
        """Drafted tokens to verify after the ``num_tokens`` a row of ``request`` computes
        from ``computed`` (its computed count; at admission, its prefix hit's)."""
        speculator = self._speculator
        if (
            speculator is None
            or num_tokens < 1
            or request.num_tokens - computed != num_tokens  # the row does not reach the end
            or request.params.uses_penalties
            or not speculator.enabled_for(len(self._running))
        ):
            return ()
        # A constrained request's drafts are cut here where its constraint refuses one, if
        # its matcher is where they start; with a token in flight it is behind, and the
        # masks of the drafted positions, filled once that token is applied, end the draft
        # at the first one the constraint refuses (a refused draft is never sampled).
        matcher = request.matcher if not request.num_placeholders else None
        most = min(
            budget - num_tokens,
            request.max_tokens - request.num_generated_tokens - 1,
            MAX_SPECULATIVE_TOKENS,
        )
        if most < 1:
            return ()
        known = request.token_ids(0, request.num_known_tokens)
        drafts = speculator.draft(request.request_id, known, request.num_placeholders, most)
        if matcher is not None and drafts:
            drafts = _allowed_prefix(matcher, drafts)
        return drafts

    def _fit_draft(
        self,
        request: Request,
        num_tokens: int,
        budget: int,
        *,
        computed: int,
        held: int,
        room: int,
    ) -> tuple[tuple[int, ...], int]:
        """The drafts a row of ``request`` verifies, and the new blocks the row needs.

        The row computes ``num_tokens`` from position ``computed``, in ``held`` blocks it
        already has (its block table, or at admission its prefix hit's). Drafts never wait
        for blocks or preempt a request: where the row with its drafts needs more than
        ``room`` blocks, it goes without them. Whether the row itself fits is the caller's.

        Returns:
            The drafts (maybe none) and the blocks the row needs beyond ``held``.
        """
        size = self.config.block_size
        drafts = self._draft(request, num_tokens, budget, computed)
        needed = max(blocks_for(computed + num_tokens + len(drafts), size) - held, 0)
        if drafts and needed > room:
            return (), max(blocks_for(computed + num_tokens, size) - held, 0)
        return drafts, needed

    def _schedule(
        self,
        request: Request,
        step_id: int,
        num_tokens: int,
        num_blocks: int,
        drafts: tuple[int, ...] = (),
    ) -> ScheduledRequest:
        if num_blocks:
            request.apply(BlocksAllocated(self.pool.allocate(num_blocks)))
        start = request.num_computed_tokens
        end = start + num_tokens
        known_end = min(end, request.num_known_tokens)
        pending = end > known_end
        if pending:
            # The placeholder comes from the step planned just before this one.
            assert request.last_step_id == step_id - 1, request
        sample = end == request.num_tokens
        assert sample or not drafts, (request, drafts)
        event: RequestEvent
        if sample:
            event = SampleScheduled(step_id, num_tokens, len(drafts))
        else:
            event = ChunkScheduled(step_id, num_tokens)
        sample_index = request.num_generated_tokens
        request.apply(event)
        self._num_tokens_scheduled += num_tokens + len(drafts)
        released = request.num_released_blocks
        return ScheduledRequest(
            request_id=request.request_id,
            start=start,
            token_ids=request.token_ids(start, known_end),
            pending_input=pending,
            sample=sample,
            sample_index=sample_index,
            num_prompt_tokens=request.num_prompt_tokens,
            # Block 0 pads the positions behind the window: a valid block the attention
            # never reads there (each query sees only its window).
            block_table=(0,) * released + request.block_table,
            params=request.params,
            draft_token_ids=drafts,
            num_released_blocks=released,
        )

    # --- outcomes -----------------------------------------------------------------------

    def apply(self, outcome: RunnerOutput | StepFailure) -> StepReport:
        """Apply the outcome of the oldest step in flight: the runner's output, or its failure.

        Tokens for requests that ended meanwhile are dropped. Blocks whose last user was
        this step are released, and requests that ended are removed.

        Raises:
            SchedulerError: the outcome's step id is not the oldest step in flight's, or the
                token of a live request that sampled is missing; nothing is applied.
        """
        if not self._inflight or self._inflight[0].step_id != outcome.step_id:
            expected = self._inflight[0].step_id if self._inflight else None
            raise SchedulerError(
                f"outcome for step {outcome.step_id} does not match the oldest step in "
                f"flight ({expected})"
            )
        plan = self._inflight[0]
        if isinstance(outcome, RunnerOutput):
            # Rows of requests that ended meanwhile may be missing: when the step before
            # this one failed, the runner never computed its requests' rows here.
            missing = [
                entry.request_id
                for entry in plan.requests
                if entry.sample
                and entry.request_id not in outcome.sampled
                and not self._requests[entry.request_id].is_terminal
                and entry.request_id not in self._discard
            ]
            if missing:
                raise SchedulerError(f"step {plan.step_id} outcome lacks tokens for {missing}")
            for entry in plan.requests:
                if entry.draft_token_ids and entry.request_id in outcome.sampled:
                    _check_verified(plan.step_id, entry.draft_token_ids, outcome, entry.request_id)
        self._inflight.popleft()
        self._num_completed += 1
        now = self._clock()
        new_tokens: list[tuple[int, int]] = []
        finished: list[tuple[int, FinishReason]] = []
        failed: list[int] = []
        readers: set[int] = set()
        if isinstance(outcome, StepFailure):
            readers = self._prefix.distrust(plan, self._inflight)
        for entry in plan.requests:
            request = self._requests.get(entry.request_id)
            if request is None or request.is_terminal:
                continue
            if self._discard.get(entry.request_id, -1) >= plan.step_id:
                if entry.sample:
                    request.apply(SampleDiscarded(plan.step_id))
                continue
            if isinstance(outcome, StepFailure):
                self._end(request, Failed(outcome.message, now))
                failed.append(request.request_id)
                continue
            if not entry.sample:
                continue
            tokens = outcome.tokens(entry.request_id)
            for token_id in tokens:
                block_ids = request.block_table
                if request.apply(TokenSampled(token_id, now)) is RequestStatus.FAILED:
                    self._retire(request, block_ids)  # its constraint refused the token
                    failed.append(request.request_id)
                    break
                self._num_tokens_generated += 1
                new_tokens.append((request.request_id, token_id))
                reason = request.finish_reached()
                if reason is not None:
                    self._end(request, Finished(reason, now))
                    finished.append((request.request_id, reason))
                    break
            if entry.draft_token_ids:
                assert self._speculator is not None
                accepted = len(tokens) - 1
                self._speculator.verified(entry.request_id, len(entry.draft_token_ids), accepted)
                if not request.is_terminal:
                    request.apply(DraftVerified(plan.step_id, accepted))
        # Requests that read KV the failed step was writing did nothing wrong: they are
        # recomputed (preempted), and what their steps in flight sample is discarded.
        for request_id in sorted(readers):
            request = self._requests[request_id]
            if request.status in (RequestStatus.PREFILLING, RequestStatus.DECODING):
                assert request.last_step_id is not None, request  # it was in a step
                self._discard[request_id] = request.last_step_id
                self._preempt(request)
        for request_id in [rid for rid, last in self._discard.items() if last <= plan.step_id]:
            del self._discard[request_id]
        # Tokens that arrived complete blocks whose KV a step in flight writes.
        arrived = (self._requests.get(request_id) for request_id, _ in new_tokens)
        self._prefix.commit(r for r in arrived if r is not None and not r.is_terminal)

        for step_id in [step_id for step_id in self._deferred if step_id <= plan.step_id]:
            self.pool.release(self._deferred.pop(step_id))
        for request_id in sorted(self._ending):
            last = self._requests[request_id].last_step_id
            assert last is not None  # it ended while a step in flight computed for it
            if last <= plan.step_id:
                self._ending.discard(request_id)
                self._remove(request_id)
        return StepReport(
            new_tokens=tuple(new_tokens), finished=tuple(finished), failed=tuple(failed)
        )

    # --- internals ----------------------------------------------------------------------

    def _insert(self, queue: list[Request] | collections.deque[Request], request: Request) -> None:
        """Put ``request`` into ``queue`` (sorted by rank) after every smaller rank.

        A binary search: O(log n) rank look-ups, never a pass over the queue in Python.
        """
        rank = self._rank[request.request_id]
        queue.insert(bisect.bisect(queue, rank, key=self._rank_of), request)

    def _rank_of(self, request: Request) -> tuple[int, int]:
        return self._rank[request.request_id]

    def _step_in_flight(self, request: Request) -> int | None:
        """The last step in flight that computes for ``request``, or ``None`` if none does."""
        last = request.last_step_id
        if last is None or not self._inflight or last < self._inflight[0].step_id:
            return None
        return last

    def _num_returning_blocks(self) -> int:
        """Blocks that become free when the steps in flight complete.

        A deferred release of a shared block returns nothing while another request holds
        it: counting it would preempt victim after victim for blocks that never come.
        """
        drops = collections.Counter(b for blocks in self._deferred.values() for b in blocks)
        return sum(1 for block_id, count in drops.items() if self.pool.ref_count(block_id) == count)

    def _release(self, request: Request, block_ids: tuple[int, ...]) -> None:
        # Deepest first: the pool evicts the blocks released first, so leaves go before
        # the prefixes they extend.
        block_ids = block_ids[::-1]
        if not block_ids:
            return
        last = self._step_in_flight(request)
        if last is not None:
            self._deferred.setdefault(last, []).extend(block_ids)
        else:
            self.pool.release(block_ids)

    def _slide(self, request: Request) -> None:
        """Give back the blocks of ``request`` that its sliding window has passed (see
        :attr:`SchedulerConfig.sliding_window`), before its next step is planned.

        That step computes from ``num_computed_tokens`` on, and its first query sees back to
        ``sliding_window - 1`` positions before it; no later query sees further (drafts that
        fail roll back no further than that, a preempted request starts over). A block
        whose tokens are not all known yet (a step in flight samples its last) stays until
        they arrive, so that the prefix cache still takes it. A step in flight that reads a
        block released here has it until it completes (:meth:`_release` defers it).
        """
        behind = (
            self._behind_window(request.num_computed_tokens, request.num_known_tokens)
            - request.num_released_blocks
        )
        if behind > 0:
            block_ids = request.block_table[:behind]
            request.apply(BlocksReleased(behind))
            self._release(request, block_ids)

    def _behind_window(self, computed: int, known: int) -> int:
        """Leading blocks of a request no query reads again once ``computed`` positions are
        computed (or planned), of which ``known`` tokens are known: those wholly before the
        next query's window and of known tokens (0 without a sliding window)."""
        window = self.config.sliding_window
        if window is None:
            return 0
        return max(min(computed - window + 1, known), 0) // self.config.block_size

    def most_blocks_held(self, num_positions: int) -> int:
        """The most blocks a request of ``num_positions`` positions (prompt and output) holds
        at once while it runs alone: all of them, or with a sliding window the blocks from
        its first query's window (at most ``pipeline_depth - 2`` more back, for the tokens
        that steps in flight sample) to the end of a step's token budget, whichever is
        fewer. :meth:`check_request` refuses a request whose count passes the pool's.
        """
        config = self.config
        size = config.block_size
        whole = blocks_for(num_positions - 1, size)  # the last token's KV is never written
        window = config.sliding_window
        if window is None:
            return whole
        back = max(window - 1, config.pipeline_depth - 2)
        return min(whole, blocks_for(back + config.max_num_batched_tokens, size) + 1)

    def _windowed_reservation(self, request: Request) -> int:
        """The windowed layers' pool's reservation of ``request`` (0 without that pool)."""
        config = self.config
        windowed = config.windowed_kv
        if windowed is None:
            return 0
        total = request.num_prompt_tokens + request.max_tokens
        return windowed.reservation(
            total, block_size=config.block_size, max_drafts=self._max_drafts()
        )

    def _windowed_room(self) -> int:
        """The windowed layers' pool's blocks no reservation holds (0 without that pool)."""
        config = self.config
        windowed = config.windowed_kv
        if windowed is None:
            return 0
        reserve = windowed.step_reserve(
            block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens
        )
        return windowed.num_blocks - reserve - sum(self._windowed.values())

    def _max_drafts(self) -> int:
        spec = self.config.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    def _pin(self, request: Request) -> None:
        """Hold a request that just finished's cached blocks for its ``cache_ttl``."""
        ttl = request.params.cache_ttl
        if not ttl or not self._prefix.enabled:
            return
        pool = self.pool
        cached = tuple(b for b in request.block_table if pool.block_hash(b) is not None)
        if cached:
            pool.retain(cached)
            self._pins.append((self._clock() + ttl, cached))

    def _expire_pins(self) -> None:
        """Release the pins whose time is up."""
        if not self._pins:
            return
        now = self._clock()
        ended = [pin for pin in self._pins if pin[0] <= now]
        for pin in ended:
            self._pins.remove(pin)
            self.pool.release(pin[1][::-1])  # deepest first, as _release does

    def _unpin(self, needed: int) -> bool:
        """Release pins, oldest first, until ``needed`` blocks are free or none is left.

        Returns:
            Whether any pin was released.
        """
        released = False
        while self._pins and self.pool.num_free < needed:
            _, block_ids = self._pins.popleft()
            self.pool.release(block_ids[::-1])
            released = True
        return released

    def _preempt(self, request: Request) -> None:
        block_ids = request.block_table
        request.apply(Preempted())
        self._running.remove(request)
        self._insert(self._waiting, request)
        self._release(request, block_ids)
        self._preempted.append(request.request_id)
        self._windowed.pop(request.request_id, None)  # the runner drops its table first
        self._num_preemptions += 1

    def _end(self, request: Request, event: Cancelled | Finished | Failed) -> None:
        block_ids = request.block_table
        if isinstance(event, Finished):
            self._pin(request)
        request.apply(event)
        self._retire(request, block_ids)

    def _retire(self, request: Request, block_ids: tuple[int, ...]) -> None:
        """Take a request that just ended out of its queue; ``block_ids`` were its table."""
        if request in self._running:
            self._running.remove(request)
        else:  # a live request is running or waiting (check_invariants)
            self._waiting.remove(request)
        self._release(request, block_ids)
        if self._step_in_flight(request) is not None:
            self._ending.add(request.request_id)
        else:
            self._remove(request.request_id)

    def _remove(self, request_id: int) -> None:
        self._prefix.drop(request_id)
        self._windowed.pop(request_id, None)
        request = self._requests.pop(request_id)
        if self._speculator is not None:
            finished = request.status is RequestStatus.FINISHED
            self._speculator.finished(request_id, request.output_token_ids if finished else ())
        del self._rank[request_id]
        if request.last_step_id is not None:  # a runner has seen it: it may drop its state
            self._gone.append(request_id)

    # --- introspection ------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        pool = self.pool.statistics()
        return SchedulerStatistics(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_ending=len(self._ending),
            num_inflight_steps=len(self._inflight),
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_pinned_blocks=len(set(self.pinned_blocks)),
            num_blocks=pool.num_blocks,
            num_kv_cache_tokens=pool.num_blocks * pool.block_size,
            num_steps_planned=self._next_step,
            num_steps=self._num_completed,
            num_tokens_scheduled=self._num_tokens_scheduled,
            num_tokens_generated=self._num_tokens_generated,
            num_preemptions=self._num_preemptions,
            num_prefix_cache_queries=pool.num_prefix_cache_queries,
            num_prefix_cache_hits=pool.num_prefix_cache_hits,
            **self._speculation_statistics(),
        )

    def _speculation_statistics(self) -> dict[str, Any]:
        speculator = self._speculator
        if speculator is None:
            return {
                "num_spec_decode_drafts": 0,
                "num_spec_decode_draft_tokens": 0,
                "num_spec_decode_accepted_tokens": 0,
            }
        return {
            "num_spec_decode_drafts": speculator.num_drafts,
            "num_spec_decode_draft_tokens": speculator.num_draft_tokens,
            "num_spec_decode_accepted_tokens": speculator.num_accepted_tokens,
            "spec_decode_accepted_tokens_per_pos": tuple(speculator.accepted_per_position),
        }

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any guarantee of the scheduler does not hold.

        Blocks are conserved (every reference is held by exactly one live request table, one
        deferred release or one pin), every deferred release waits for a step still in flight, no
        block used by a step in flight is free, the queues hold the statuses they should in
        rank order, and the limits hold.
        """
        self.pool.check_invariants()
        self._prefix.check_invariants(self._requests.values())
        config = self.config
        inflight = {plan.step_id for plan in self._inflight}
        for step_id, block_ids in self._deferred.items():
            assert step_id in inflight, f"blocks {block_ids} wait for step {step_id}, not in flight"
        expected = collections.Counter[int]()
        for request in self._requests.values():
            expected.update(request.block_table)
            if request.is_terminal:
                assert not request.block_table, f"{request!r} ended but holds blocks"
        for block_ids in self._deferred.values():
            expected.update(block_ids)
        expected.update(self.pinned_blocks)  # (a failed step may have uncached one since)
        for block_id in range(self.pool.num_blocks):
            assert self.pool.ref_count(block_id) == expected[block_id], (
                f"block {block_id} has {self.pool.ref_count(block_id)} references but "
                f"{expected[block_id]} holders"
            )
        for plan in self._inflight:
            for entry in plan.requests:
                for block_id in entry.held_blocks:
                    assert self.pool.ref_count(block_id) > 0, (
                        f"block {block_id} is free but step {plan.step_id} in flight uses it"
                    )
        assert len(self._inflight) <= config.pipeline_depth
        assert len(self._running) <= config.max_num_seqs
        if config.windowed_kv is not None:
            # Each running request holds a reservation of the windowed layers' pool, and
            # only they and the ended ones a step in flight still computes; together they fit.
            running_ids = {request.request_id for request in self._running}
            assert running_ids <= set(self._windowed), "a running request has no reservation"
            assert set(self._windowed) <= running_ids | self._ending, "a stale reservation"
            assert self._windowed_room() >= 0, "the windowed layers' pool is overbooked"
        else:
            assert not self._windowed
        waiting = {RequestStatus.WAITING, RequestStatus.PREEMPTED}
        running = {RequestStatus.PREFILLING, RequestStatus.DECODING}
        for queue, statuses in ((self._waiting, waiting), (self._running, running)):
            keys = [self._rank[request.request_id] for request in queue]
            assert keys == sorted(keys), "a queue is out of rank order"
            for request in queue:
                assert request.status in statuses, f"{request!r} is in the wrong queue"
                assert self._requests[request.request_id] is request
        live = {r.request_id for r in self._waiting} | {r.request_id for r in self._running}
        assert len(live) == len(self._waiting) + len(self._running), "a request is queued twice"
        for request in self._requests.values():
            if request.request_id in live:
                needed = blocks_for(request.num_computed_tokens, config.block_size)
                assert request.num_table_blocks >= needed, f"{request!r} lacks blocks"
                # Only blocks wholly behind the window, of known tokens, are given back.
                window = config.sliding_window
                seen_from = 0 if window is None else request.num_computed_tokens - window + 1
                released = request.num_released_blocks * config.block_size
                assert released <= max(min(seen_from, request.num_known_tokens), 0), (
                    f"{request!r} gave back {request.num_released_blocks} blocks, but positions "
                    f"from {seen_from} are still seen"
                )
                # A live request always has its last token left to compute: a sampled token's
                # KV is written only when the token is fed to the next step.
                assert request.num_computed_tokens < request.num_tokens, (
                    f"{request!r} has no token left to compute"
                )
                assert request.num_generated_tokens <= request.max_tokens
            else:
                assert request.is_terminal, request
                assert request.request_id in self._ending, request
            mine = [
                entry
                for plan in self._inflight
                for entry in plan.requests
                if entry.request_id == request.request_id
            ]
            inflight_samples = sum(entry.num_samples for entry in mine)
            if not request.is_terminal and request.num_drafts:
                carried = len(mine[-1].draft_token_ids) if mine else 0
                assert carried == request.num_drafts, (
                    f"{request!r} verifies {request.num_drafts} drafts, but its last step in "
                    f"flight carries {carried}"
                )
            if not request.is_terminal:
                assert request.num_placeholders == inflight_samples, (
                    f"{request!r} has {request.num_placeholders} placeholders but "
                    f"{inflight_samples} samples in flight"
                )

    def __repr__(self) -> str:
        return (
            f"<Scheduler {len(self._waiting)} waiting, {len(self._running)} running, "
            f"{len(self._inflight)} in flight, {self.pool.num_free}/{self.pool.num_blocks} "
            f"blocks free>"
        )


def _allowed_prefix(matcher: Matcher, drafts: tuple[int, ...]) -> tuple[int, ...]:
    """The drafts up to the first one the request's constraint refuses (none after one that
    ends its output), followed on a fork of its matcher: the request's own does not move."""
    try:
        follower = matcher.fork()
        kept = 0
        for token_id in drafts:
            if follower.terminated or not follower.advance(token_id):
                break
            kept += 1
    except Exception:  # the backend's trouble is the request's, met when its mask is filled
        return ()
    return drafts[:kept]


def _check_verified(
    step_id: int, drafts: tuple[int, ...], outcome: RunnerOutput, request_id: int
) -> None:
    """Raise :class:`SchedulerError` unless a row's tokens are a verification of ``drafts``:
    at most one more than them, each but the last equal to the draft at its place."""
    tokens = outcome.tokens(request_id)
    if len(tokens) > len(drafts) + 1 or tuple(tokens[:-1]) != drafts[: len(tokens) - 1]:
        raise SchedulerError(
            f"step {step_id} outcome for request {request_id}: tokens {list(tokens)} do not "
            f"verify the drafts {list(drafts)} (each token before the last must equal its draft)"
        )
