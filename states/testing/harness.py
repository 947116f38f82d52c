"""The engine's bookkeeping loop over a simulated device, checking every guarantee per step.

:class:`SimulatedEngine` does what the engine's bookkeeping stroke does with a
:class:`~twostroke.states.scheduler.Scheduler` (submit, plan, execute, apply outcomes,
cancel, finish on a stop string), but on :class:`~twostroke.states.simulation.SimulatedKV`
and with a check after every call of each guarantee that the design promises: budgets,
admission in rank order (priority with aging, then arrival: FIFO among equal priorities),
preemption of the running requests of the largest rank (and no admission in the same step),
block conservation and exclusive ownership, blocks of ended requests freed by the end of the
last step in flight that used them, and outputs equal to
:func:`~twostroke.states.simulation.reference_output` whatever preemption and lookahead did.
:func:`drive` runs a whole :class:`Workload` to completion with it, and proves it completes
within :func:`step_bound` steps.

The hypothesis state machines in :mod:`twostroke.states.testing` are thin layers over this
module, which stays pure (attrs and the standard library) so a user can drive their own
scheduler configuration from any test framework.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Mapping, Sequence

import attrs

from twostroke.states.plan import RunnerOutput, StepFailure, StepPlan, StepReport
from twostroke.states.request import FinishReason, Request, RequestStatus
from twostroke.states.scheduler import Scheduler, SchedulerConfig, SchedulerStatistics
from twostroke.states.simulation import (
    NextToken,
    SimulatedKV,
    SimulationError,
    reference_output,
    toy_next_token,
)
from twostroke.states.testing.constraints import ReferenceMatcher
from twostroke.states.testing.queues import running_ids, waiting_ids
from twostroke.states.testing.workload import Workload, reference_matcher

__all__ = ["DriveResult", "SimulatedEngine", "drive", "step_bound"]


def step_bound(config: SchedulerConfig, requests: Iterable[Request]) -> int:
    """An upper bound on the steps that serve ``requests`` to completion once arrivals stop.

    Why it holds: every completed step has a live request R of the smallest rank (with
    every priority equal, the oldest), and R is never preempted (the victim is the running
    request of the largest rank, and R alone always fits, since submission rejects what
    cannot). While R is the oldest, each step computes at least one
    of its at most ``prompt + max_tokens`` positions, or (at most twice per position) waits
    for blocks that a step in flight returns, or (at most ``2 * depth`` times) waits for its
    own token in flight or for admission. Steps still in flight add ``depth``.

    Args:
        config: The scheduler's configuration.
        requests: The requests that are not yet terminal.

    Returns:
        The bound, in completed steps.
    """
    depth = config.pipeline_depth
    return depth + sum(
        3 * (request.num_prompt_tokens + request.max_tokens) + 4 * depth + 4
        for request in requests
        if not request.is_terminal
    )


@attrs.frozen
class _Ending:
    """A request that ended: the blocks it held and the step by which they must be free."""

    block_ids: frozenset[int]
    deadline: int | None


class SimulatedEngine:
    """A scheduler, a :class:`SimulatedKV`, and a check of every guarantee after each call.

    Every method raises :class:`SimulationError` as soon as a guarantee fails, with a
    message that names it.

    Args:
        scheduler: The scheduler under test (fresh: nothing submitted yet).
        next_token: The "model" the simulated device and the reference share.
    """

    def __init__(self, scheduler: Scheduler, *, next_token: NextToken = toy_next_token) -> None:
        self.scheduler = scheduler
        self.config = scheduler.config
        self.next_token = next_token
        self.kv = SimulatedKV(
            self.config.num_blocks,
            self.config.block_size,
            next_token,
            window=self.config.sliding_window,
        )
        #: Every request ever submitted, by id (they stay here after the scheduler drops them).
        self.requests: dict[int, Request] = {}
        #: The token stream each request received, as the engine would deliver it.
        self.streams: dict[int, list[int]] = {}
        #: Request ids in the order they were first admitted.
        self.first_admissions: list[int] = []
        self.num_completed = 0
        #: Each request's rank, computed here from its priority, the steps planned before
        #: it arrived and its arrival, as the scheduler's documentation defines it.
        self.ranks: dict[int, tuple[int, int]] = {}
        #: Steps completed when each request was submitted.
        self.arrival_steps: dict[int, int] = {}
        self._arrivals = itertools.count()
        self._outcomes: collections.deque[RunnerOutput] = collections.deque()
        self._references: dict[int, tuple[list[int], str]] = {}
        self._tables: dict[int, tuple[int, ...]] = {}
        self._endings: dict[int, _Ending] = {}
        self._truncated: dict[int, int] = {}

    # --- the engine's calls -----------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Submit a request (``Scheduler.add_request``); a rejection propagates unchanged."""
        planned = self.scheduler.statistics().num_steps_planned
        self.scheduler.add_request(request)
        rid = request.request_id
        self.requests[rid] = request
        self.streams[rid] = []
        aging = self.config.priority_aging_steps
        self.ranks[rid] = (request.params.priority * aging + planned, next(self._arrivals))
        self.arrival_steps[rid] = self.num_completed

    def plan(self) -> StepPlan | None:
        """Plan a step, check it, and execute it on the simulated device at once.

        Executing at planning time keeps the device's order (steps run in plan order) while
        the outcome waits, as on a device stream, until :meth:`complete` applies it.
        """
        waiting_before = set(waiting_ids(self.scheduler))
        running_before = {
            rid: self.requests[rid].num_preemptions for rid in running_ids(self.scheduler)
        }
        plan = self.scheduler.schedule()
        admitted: list[int] = []
        if plan is not None:
            admitted = self._check_plan(plan, waiting_before)
            self._outcomes.append(self.kv.execute(plan, self._allowed(plan)))
        self._check_preemptions(plan, running_before, admitted)
        self._after()
        return plan

    def _allowed(self, plan: StepPlan) -> dict[int, tuple[frozenset[int], ...]]:
        """The masks of the plan's constrained rows, as the engine computes them.

        The engine fills a step's masks once every earlier step is applied, from each
        request's matcher. Here the step executes at planning time, so the question goes to
        a copy of the request's matcher advanced by the tokens the steps in flight sampled
        for it (the device knows them): the request's own matcher moves only when its
        tokens are applied.

        Raises:
            TypeError: a constrained request's matcher is not a :class:`ReferenceMatcher`
                (the only kind this simulation can look ahead with).
        """
        allowed: dict[int, tuple[frozenset[int], ...]] = {}
        for entry in plan.requests:
            matcher = self.requests[entry.request_id].matcher
            if not entry.sample or matcher is None:
                continue
            if not isinstance(matcher, ReferenceMatcher):
                raise TypeError(
                    f"the simulated engine looks ahead with a ReferenceMatcher, got "
                    f"{type(matcher).__name__} for request {entry.request_id}"
                )
            ahead = matcher.copy()
            for outcome in self._outcomes:
                if entry.request_id not in outcome.sampled:
                    continue
                if not all(ahead.advance(t) for t in outcome.tokens(entry.request_id)):
                    break
            # One set per position the row samples at: after each of its drafts too, as the
            # engine fills them (past a draft the constraint refuses, the set before it).
            sets = [ahead.allowed_token_ids()]
            for token_id in entry.draft_token_ids:
                if not ahead.terminated and ahead.advance(token_id):
                    sets.append(ahead.allowed_token_ids())
                else:
                    sets.append(sets[-1])
            allowed[entry.request_id] = tuple(sets)
        return allowed

    def complete(self, failure: str | None = None) -> StepReport:
        """Apply the oldest step's outcome, or fail that step with ``failure``."""
        outcome: RunnerOutput | StepFailure = self._outcomes.popleft()
        if failure is not None:
            outcome = StepFailure(outcome.step_id, failure)
            # Its KV is garbage now: a later step that reads it gets caught.
            self.kv.poison(self.scheduler.inflight_plans[0])
        report = self.scheduler.apply(outcome)
        self.num_completed += 1
        for rid, token_id in report.new_tokens:
            if rid in self._truncated:
                raise SimulationError(f"request {rid} got token {token_id} after it finished")
            self.streams[rid].append(token_id)
        # A row that verified drafts delivers several tokens at once: check after them all.
        for rid in dict.fromkeys(rid for rid, _ in report.new_tokens):
            self._check_output(self.requests[rid])
        for rid, reason in report.finished:
            if self.requests[rid].finish_reason is not reason:
                raise SimulationError(f"request {rid} reported {reason}, holds another reason")
        self._after(completed_step=outcome.step_id)
        return report

    def cancel(self, request_id: int) -> bool:
        """Cancel any id, known or not, at any moment; checks the answer and idempotence."""
        request = self.requests.get(request_id)
        live = request is not None and not request.is_terminal
        answer = self.scheduler.cancel(request_id)
        if answer != live:
            raise SimulationError(f"cancel({request_id}) returned {answer}, expected {live}")
        if request is not None and live and request.status is not RequestStatus.CANCELLED:
            raise SimulationError(f"{request!r} was cancelled but is {request.status}")
        if self.scheduler.cancel(request_id):
            raise SimulationError(f"cancel({request_id}) twice returned True twice")
        self._after()
        return answer

    def finish_on_stop_string(self, request_id: int) -> bool:
        """Finish a request early, as the engine does when its text matched a stop string."""
        request = self.requests[request_id]
        answer = self.scheduler.finish_on_stop_string(request_id)
        if answer:
            self._truncated[request_id] = request.num_output_tokens
        self._after()
        return answer

    # --- driving ----------------------------------------------------------------------------

    def advance(self) -> bool:
        """Do the next thing the bookkeeping loop would: plan if it can, else apply.

        Returns:
            Whether anything happened (``False`` means nothing is planned or in flight).
        """
        if self.scheduler.can_schedule and self.plan() is not None:
            return True
        if self._outcomes:
            self.complete()
            return True
        return False

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Drive until every request is terminal and every block free.

        Args:
            max_steps: Fail if it takes more completed steps than this (default:
                :func:`step_bound` of what is live now).

        Returns:
            The number of steps completed on the way.

        Raises:
            SimulationError: a guarantee failed, the scheduler got stuck, or it starved.
        """
        if max_steps is None:
            max_steps = step_bound(self.config, self.requests.values())
        start = self.num_completed
        while self.advance():
            self.check()
            if self.num_completed - start > max_steps:
                raise SimulationError(
                    f"not idle after {max_steps} steps (the bound): {self.scheduler!r}"
                )
        self.check_idle()
        return self.num_completed - start

    def check_idle(self) -> None:
        """Check that every request is terminal, every record dropped, every block free but
        those pinned (``cache_ttl``; each pinned block once, as pins may share one)."""
        unfinished = [r for r in self.requests.values() if not r.is_terminal]
        if unfinished:
            raise SimulationError(f"stuck: nothing to plan, nothing in flight, but {unfinished}")
        if not self.scheduler.is_idle():
            raise SimulationError(f"every request ended but not idle: {self.scheduler!r}")
        pinned = len(set(self.scheduler.pinned_blocks))
        if self.scheduler.pool.num_free + pinned != self.config.num_blocks:
            raise SimulationError(f"idle but blocks are missing: {self.scheduler.pool!r}")

    # --- checks -----------------------------------------------------------------------------

    def check(self) -> None:
        """Check the scheduler's own invariants and the block accounting seen from outside.

        Blocks are conserved: a block is used exactly when a live request's table, a step
        in flight or a pin holds it, and no block is held for two requests at once unless it is a
        cached prefix block (with prefix caching, whose hits share blocks).
        """
        self.scheduler.check_invariants()
        owner: dict[int, int] = {}
        pool = self.scheduler.pool

        def hold(block_id: int, rid: int, where: str) -> None:
            if owner.setdefault(block_id, rid) != rid and pool.block_hash(block_id) is None:
                raise SimulationError(
                    f"block {block_id} is held for requests {owner[block_id]} and {rid} ({where})"
                )

        for request in self.scheduler:
            for block_id in request.block_table:
                hold(block_id, request.request_id, "block tables")
        sharing = self.config.enable_prefix_caching
        for plan in self.scheduler.inflight_plans:
            for entry in plan.requests:
                for block_id in entry.held_blocks:
                    if sharing:
                        # A failed step uncaches blocks that its readers, failed too,
                        # still hold in later steps in flight.
                        owner.setdefault(block_id, entry.request_id)
                    else:
                        hold(block_id, entry.request_id, f"step {plan.step_id} in flight")
        for block_id in self.scheduler.pinned_blocks:  # a finished request's cache_ttl
            owner.setdefault(block_id, -1)
        for block_id in range(self.config.num_blocks):
            if (pool.ref_count(block_id) > 0) != (block_id in owner):
                state = "free" if block_id in owner else "used"
                raise SimulationError(
                    f"blocks not conserved: block {block_id} is {state} but "
                    f"{'held' if block_id in owner else 'held by nobody'}"
                )

    def _check_preemptions(
        self, plan: StepPlan | None, running_before: Mapping[int, int], admitted: Sequence[int]
    ) -> None:
        """The victims are the running requests of the largest rank (with one priority, the
        newest), and a step that preempts admits none.

        Both are policy rather than safety: preempting a request of a smaller rank delays
        the smallest (and so risks starvation), admitting while preempting recomputes for
        nothing.
        ``running_before`` maps each request running before the plan to its preemption
        count (a victim readmitted at once is no longer PREEMPTED, but its count moved).
        """
        preempted = [
            rid
            for rid, count in running_before.items()
            if self.requests[rid].num_preemptions > count
        ]
        if not preempted:
            return
        step = "a step that plans nothing" if plan is None else f"step {plan.step_id}"
        kept = [rid for rid in running_before if rid not in preempted]
        rank = self.ranks
        if kept and min(rank[rid] for rid in preempted) < max(rank[rid] for rid in kept):
            raise SimulationError(
                f"{step} preempts {preempted} but keeps {kept}, of a larger rank: the victim "
                "must be the running request of the largest rank"
            )
        readmitted = [rid for rid in preempted if plan is not None and rid in plan.request_ids]
        if admitted or readmitted:
            raise SimulationError(
                f"{step} preempts {preempted} and admits {[*admitted, *readmitted]}"
            )

    def _check_plan(self, plan: StepPlan, waiting_before: set[int]) -> list[int]:
        config = self.config
        if plan.num_tokens > config.max_num_batched_tokens:
            raise SimulationError(
                f"step {plan.step_id} has {plan.num_tokens} tokens, budget "
                f"{config.max_num_batched_tokens}"
            )
        ids = plan.request_ids
        if len(ids) > config.max_num_seqs or len(set(ids)) != len(ids):
            raise SimulationError(f"step {plan.step_id} has requests {ids}: over the limit")
        if any(entry.num_tokens < 1 for entry in plan.requests):
            raise SimulationError(f"step {plan.step_id} schedules an empty chunk: {plan}")
        admitted = [rid for rid in ids if rid in waiting_before]
        for rid in admitted:
            if rid not in self.first_admissions:
                self.first_admissions.append(rid)
        rank = self.ranks
        keys = [rank[rid] for rid in admitted]
        if keys != sorted(keys):
            raise SimulationError(f"step {plan.step_id} admits {admitted} out of rank order")
        skipped = [
            (rid, later)
            for rid in waiting_ids(self.scheduler)
            for later in admitted
            if rank[rid] < rank[later]
        ]
        if skipped:
            raise SimulationError(
                f"step {plan.step_id} admits past waiting requests of a smaller rank: {skipped}"
            )
        return admitted

    def _reference(self, request: Request) -> tuple[list[int], str]:
        rid = request.request_id
        if rid not in self._references:
            self._references[rid] = reference_output(
                request.prompt_token_ids,
                request.params,
                eos_token_ids=request.eos_token_ids,
                next_token=self.next_token,
                matcher=reference_matcher(request.params, request.eos_token_ids),
                choose=self.kv.choose,
                window=self.config.sliding_window,
            )
        return self._references[rid]

    def _check_output(self, request: Request) -> None:
        rid = request.request_id
        output = list(request.output_token_ids)
        expected, reason = self._reference(request)
        if output != self.streams[rid]:
            raise SimulationError(f"request {rid} holds {output}, streamed {self.streams[rid]}")
        if output != expected[: len(output)]:
            raise SimulationError(f"request {rid} produced {output}, reference {expected}")
        if request.status is not RequestStatus.FINISHED:
            return
        if rid in self._truncated:
            if len(output) != self._truncated[rid]:
                raise SimulationError(f"request {rid} grew after finishing early: {output}")
        elif output != expected or request.finish_reason is not FinishReason(reason):
            raise SimulationError(
                f"request {rid} finished ({request.finish_reason}) with {output}, reference "
                f"({reason}) {expected}"
            )

    def _after(self, completed_step: int | None = None) -> None:
        """Note requests that ended, check their deadlines, remember the tables."""
        inflight = self.scheduler.inflight_plans
        for rid, request in self.requests.items():
            if not request.is_terminal:
                self._tables[rid] = request.block_table
                continue
            if rid in self._endings:
                continue
            self._check_output(request)
            steps = [plan for plan in inflight if rid in plan.request_ids]
            blocks = set(self._tables.pop(rid, ()))
            for plan in steps:
                for entry in plan.requests:
                    if entry.request_id == rid:
                        blocks.update(entry.held_blocks)
            deadline = max((plan.step_id for plan in steps), default=None)
            self._endings[rid] = _Ending(frozenset(blocks), deadline)
            if deadline is None:
                self._check_released(rid)
        if completed_step is not None:
            for rid, ending in self._endings.items():
                if ending.deadline == completed_step:
                    self._check_released(rid)

    def _check_released(self, rid: int) -> None:
        ending = self._endings[rid]
        if rid in self.scheduler:
            raise SimulationError(
                f"request {rid} ended ({self.requests[rid].status}) but is still kept after "
                f"step {ending.deadline}"
            )
        # A cached prefix block it shared may be held by others still, or pinned
        # (SamplingParams.cache_ttl).
        others = {b for request in self.scheduler for b in request.block_table}
        others.update(self.scheduler.pinned_blocks)
        others.update(
            b
            for plan in self.scheduler.inflight_plans
            for e in plan.requests
            for b in e.held_blocks
        )
        held = sorted(
            b for b in ending.block_ids if self.scheduler.pool.ref_count(b) and b not in others
        )
        if held:
            raise SimulationError(
                f"request {rid} ended ({self.requests[rid].status}) but blocks {held} are not "
                f"free after step {ending.deadline}"
            )


@attrs.frozen
class DriveResult:
    """What :func:`drive` observed.

    Attributes:
        outputs: The token stream each request received, by request id.
        statuses: Each request's final status.
        finish_reasons: Each finished request's reason.
        num_steps: Steps completed.
        max_steps: The bound the run was held to.
        statistics: The scheduler's statistics at the end.
    """

    outputs: Mapping[int, tuple[int, ...]]
    statuses: Mapping[int, RequestStatus]
    finish_reasons: Mapping[int, FinishReason]
    num_steps: int
    max_steps: int
    statistics: SchedulerStatistics


def drive(
    scheduler: Scheduler,
    requests: Workload | Sequence[Request],
    *,
    next_token: NextToken = toy_next_token,
    max_steps: int | None = None,
) -> DriveResult:
    """Run a workload to completion over :class:`SimulatedKV`, checking every guarantee.

    The loop keeps the pipeline as full as the scheduler's ``pipeline_depth`` allows, so
    the same workload exercises the serial schedule at depth 1 and the lookahead at depth 2.

    Args:
        scheduler: A fresh scheduler.
        requests: A :class:`Workload` (with arrivals), or requests all submitted at once.
        next_token: The "model".
        max_steps: Fail past this many completed steps (default: :func:`step_bound` of all
            the requests plus the last arrival step).

    Returns:
        The streams, statuses and counts.

    Raises:
        SimulationError: a guarantee failed (the message names it).
        RequestRejected: a request cannot be served with this configuration.
    """
    engine = SimulatedEngine(scheduler, next_token=next_token)
    if isinstance(requests, Workload):
        arrivals = requests.build()
    else:
        arrivals = [(0, request) for request in requests]
    if max_steps is None:
        last = max((step for step, _ in arrivals), default=0)
        max_steps = last + step_bound(scheduler.config, [request for _, request in arrivals])
    pending = collections.deque(arrivals)
    while True:
        while pending and pending[0][0] <= engine.num_completed:
            engine.submit(pending.popleft()[1])
        if engine.advance():
            engine.check()
        elif pending:
            engine.submit(pending.popleft()[1])  # nothing to do: the next arrival comes now
        else:
            break
        if engine.num_completed > max_steps:
            raise SimulationError(f"not idle after {max_steps} steps (the bound): {scheduler!r}")
    engine.check_idle()
    final = engine.requests.values()
    return DriveResult(
        outputs={rid: tuple(stream) for rid, stream in engine.streams.items()},
        statuses={r.request_id: r.status for r in final},
        finish_reasons={r.request_id: r.finish_reason for r in final if r.finish_reason},
        num_steps=engine.num_completed,
        max_steps=max_steps,
        statistics=scheduler.statistics(),
    )
