"""Hypothesis state machines for the request, the block pool and the scheduler.

Each drives the real object beside a plain reference model and checks invariants after every
rule. Test support: imports hypothesis (the ``test`` extra). Use it through
:mod:`twostroke.states.testing`, which re-exports everything.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Sequence
from typing import ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from twostroke.states.blocks import BlockPool
from twostroke.states.constraints import Choice
from twostroke.states.errors import InvalidTransition, RequestRejected, SchedulerError
from twostroke.states.params import SamplingParams
from twostroke.states.request import (
    TERMINAL,
    TRANSITIONS,
    Admitted,
    BlocksAllocated,
    BlocksReleased,
    Cancelled,
    ChunkScheduled,
    ConstraintCompiled,
    DraftVerified,
    Failed,
    Finished,
    FinishReason,
    Preempted,
    PrefixCacheHit,
    Request,
    RequestEvent,
    RequestStatus,
    SampleDiscarded,
    SampleScheduled,
    TokenSampled,
)
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.simulation import (
    SimulationError,
    toy_next_token,
)
from twostroke.states.speculation import SpeculativeConfig, Speculator
from twostroke.states.testing.constraints import ReferenceMatcher
from twostroke.states.testing.harness import SimulatedEngine
from twostroke.states.testing.reference import (
    PoolModel,
    RequestModel,
    Transitions,
    request_snapshot,
)
from twostroke.states.testing.strategies import (
    VOCAB_SIZE,
    request_specs,
    scheduler_configs,
)
from twostroke.states.testing.workload import SIMULATED_VOCABULARY, RequestSpec

__all__ = ["BlockPoolMachine", "DraftingSchedulerMachine", "RequestMachine", "SchedulerMachine"]

# --- the request machine --------------------------------------------------------------------


_ABORTS = (Cancelled, Failed)
_RUNNING = (RequestStatus.PREFILLING, RequestStatus.DECODING)
_EVENT_TYPES: tuple[type[RequestEvent], ...] = (
    ConstraintCompiled,
    Admitted,
    PrefixCacheHit,
    BlocksAllocated,
    BlocksReleased,
    ChunkScheduled,
    SampleScheduled,
    TokenSampled,
    SampleDiscarded,
    DraftVerified,
    Preempted,
    Finished,
    Cancelled,
    Failed,
)


class RequestMachine(RuleBasedStateMachine):
    """Applies random events, legal and not, to one request and to a reference model.

    An event the reference rejects must raise ``InvalidTransition`` naming the status and
    the event (a table miss) or the event's counts and the rule they break, and leave every
    observable field of the request unchanged (its matcher too); an event it accepts must
    change the request exactly as it changes the model. Some requests are constrained: the
    request's matcher, which only ``apply`` moves, and the model's own must agree on every
    token (taken, refused, or a dead end that fails the request).

    Class attributes to override in a subclass:
        reference_transitions: The table the model follows; by default a plain copy of
            :data:`~twostroke.states.request.TRANSITIONS`, so the machine checks ``apply``.
            Set a hand-written table to pin the lifecycle itself.
        specs: The strategy the request is drawn from.
    """

    reference_transitions: ClassVar[Transitions] = {
        status: dict(row) for status, row in TRANSITIONS.items()
    }
    specs: ClassVar[st.SearchStrategy[RequestSpec]] = request_specs(constrained=True)

    def __init__(self) -> None:
        super().__init__()
        self.request: Request | None = None
        self.model: RequestModel | None = None
        self.now = 0.0

    @initialize(data=st.data())
    def create(self, data: st.DataObject) -> None:
        spec = data.draw(self.specs, label="spec")
        compiled = data.draw(st.booleans(), label="compiled")
        request_id = data.draw(st.integers(0, 9), label="id")
        self.request = spec.build(request_id, compiled=compiled)
        self.model = RequestModel(
            self.reference_transitions,
            spec.prompt_token_ids,
            spec.params.constraint,
            spec.eos_token_ids,
            max_tokens=self.request.max_tokens,
        )
        if self.request.matcher is not None:
            self.model.matcher = self._fresh_matcher()

    def _fresh_matcher(self) -> ReferenceMatcher:
        """A matcher of the request's constraint (of some constraint, if it has none)."""
        model = self._state()[1]
        constraint = model.constraint or Choice(["a"])
        return ReferenceMatcher(constraint, SIMULATED_VOCABULARY, model.eos_token_ids)

    def _state(self) -> tuple[Request, RequestModel]:
        assert self.request is not None
        assert self.model is not None
        return self.request, self.model

    def _event(self, data: st.DataObject, *, progress: bool) -> RequestEvent:
        """Draw an event: with ``progress``, one the status accepts, sized to fit."""
        model = self._state()[1]
        self.now += 1.0
        kinds: Sequence[type[RequestEvent]] = _EVENT_TYPES
        left = model.num_tokens - model.computed
        sizes = st.integers(-1, left + 2)
        if progress:
            kinds = [kind for kind in model.table[model.status] if kind not in _ABORTS]
            sizes = st.just(left) | st.integers(1, max(left - 1, 1))
        kind = data.draw(st.sampled_from(kinds or [Admitted]), label="kind")
        if kind is ChunkScheduled:
            return kind(step_id=data.draw(st.integers(0, 9)), num_tokens=data.draw(sizes))
        if kind is SampleScheduled:
            drafts = st.integers(0, 3) if progress else st.integers(-1, 4)
            return SampleScheduled(
                step_id=data.draw(st.integers(0, 9)),
                num_tokens=data.draw(sizes),
                num_drafts=data.draw(drafts, label="num_drafts"),
            )
        if kind is DraftVerified:
            settles = model.drafts - model.placeholders
            accepted = st.integers(-1, model.drafts + 1)
            if progress and settles >= 0:
                accepted = st.just(settles) | accepted
            return DraftVerified(data.draw(st.integers(0, 9)), data.draw(accepted))
        if kind is BlocksAllocated:
            return BlocksAllocated(tuple(data.draw(st.lists(st.integers(0, 99), max_size=3))))
        if kind is BlocksReleased:
            return BlocksReleased(data.draw(st.integers(0, len(model.blocks) + 1)))
        if kind is PrefixCacheHit:
            block_ids = tuple(data.draw(st.lists(st.integers(0, 99), max_size=3)))
            return PrefixCacheHit(block_ids, data.draw(st.integers(-1, model.num_tokens + 1)))
        if kind is TokenSampled:
            return self._token(data)
        if kind is ConstraintCompiled:
            matcher = self._fresh_matcher()
            used = data.draw(st.booleans(), label="not at its start")
            allowed = sorted(matcher.allowed_token_ids())
            if used and allowed:
                matcher.advance(allowed[0])
            return ConstraintCompiled(matcher)
        if kind is SampleDiscarded:
            return SampleDiscarded(data.draw(st.integers(0, 9)))
        if kind is Finished:
            return Finished(data.draw(st.sampled_from(FinishReason)), self.now)
        if kind is Failed:
            return Failed(data.draw(st.text(max_size=5)), self.now)
        if kind is Admitted:
            return Admitted(self.now)
        if kind is Preempted:
            return Preempted()
        return Cancelled(self.now)

    @rule(data=st.data())
    def progress(self, data: st.DataObject) -> None:
        """An event the status accepts (its counts may still be refused)."""
        self._apply(self._event(data, progress=True))

    @precondition(lambda self: self.model is not None and self.model.status in _RUNNING)
    @rule(data=st.data())
    def sample(self, data: st.DataObject) -> None:
        """Schedule what is left to compute and deliver its token: the path that moves a
        constrained request's matcher (``progress`` alone reaches it seldom)."""
        model = self._state()[1]
        left = model.num_tokens - model.computed
        if left:
            self._apply(SampleScheduled(step_id=data.draw(st.integers(0, 9)), num_tokens=left))
        self._apply(self._token(data))

    def _token(self, data: st.DataObject) -> TokenSampled:
        """A token event: one the model's matcher takes, or any."""
        model = self._state()[1]
        self.now += 1.0
        tokens = st.integers(0, VOCAB_SIZE - 1)
        allowed = sorted(model.matcher.allowed_token_ids()) if model.matcher else []
        if allowed:
            tokens = st.sampled_from(allowed) | tokens
        return TokenSampled(data.draw(tokens, label="token_id"), self.now)

    @rule(data=st.data())
    def anything(self, data: st.DataObject) -> None:
        """Any event with any counts: most must be refused, with nothing changed."""
        self._apply(self._event(data, progress=False))

    def _apply(self, event: RequestEvent) -> None:
        request, model = self._state()
        before = request_snapshot(request)
        taken, matcher = model.resolve(event)
        target = model.next_status(taken)
        try:
            result = request.apply(event)
        except InvalidTransition as error:
            if target is not None:
                raise SimulationError(f"{request!r} refused {event}, reference {target}") from error
            message = str(error)
            name = type(event).__name__
            if type(event) in model.table[model.status]:
                # The table takes the event: a rule refused it, and the message says so.
                expected = f"request {request.request_id}: {name}"
                valid = error.rule is not None and message.startswith(expected)
            else:
                expected = f"request {request.request_id}: status {model.status} does not accept"
                valid = error.rule is None and message == f"{expected} event {name}"
            if not valid:
                raise SimulationError(f"InvalidTransition message {message!r}") from error
            if (error.status, error.event) != (model.status, event):
                raise SimulationError(f"it carries {error.status}, {error.event}") from error
            if request_snapshot(request) != before:
                raise SimulationError(f"{event} was rejected but changed {request!r}") from error
            return
        if target is None:
            raise SimulationError(f"{request!r} accepted {event}; the reference rejects it")
        model.apply(taken, target, matcher)
        if result is not target:
            raise SimulationError(f"apply({event}) returned {result}, reference {target}")

    @rule(data=st.data())
    def views(self, data: st.DataObject) -> None:
        """``token_ids`` and ``finish_reached`` agree with the model."""
        request, model = self._state()
        known = model.prompt + tuple(model.output)
        start = data.draw(st.integers(0, len(known) + 1))
        stop = data.draw(st.integers(start, len(known) + 1))
        if request.token_ids(start, stop) != known[start:stop]:
            raise SimulationError(f"token_ids({start}, {stop}) of {request!r} is wrong")
        params = request.params
        expected = None
        if len(model.output) >= request.max_tokens:
            expected = FinishReason.LENGTH
        if len(model.output) > params.min_tokens and (
            model.output[-1] in params.stop_token_ids
            or (not params.ignore_eos and model.output[-1] in request.eos_token_ids)
        ):
            expected = FinishReason.STOP
        if model.matcher is not None and model.matcher.terminated and model.matcher.accepting:
            expected = FinishReason.STOP  # the constraint's output is complete
        if request.finish_reached() is not expected:
            raise SimulationError(f"finish_reached() of {request!r} should be {expected}")

    @invariant()
    def matches_model(self) -> None:
        if self.request is None or self.model is None:
            return
        request, model = self.request, self.model
        if request_snapshot(request) != model.snapshot():
            raise SimulationError(f"{request_snapshot(request)} != reference {model.snapshot()}")
        if (request.status is RequestStatus.FINISHED) != (request.finish_reason is not None):
            raise SimulationError(f"{request!r} and its finish reason disagree")
        if request.is_terminal != (request.status in TERMINAL) or (
            request.is_terminal and request.block_table
        ):
            raise SimulationError(f"{request!r}: a terminal request holds blocks")
        for kind in _EVENT_TYPES:
            if (kind in model.table[model.status]) != (kind in TRANSITIONS[request.status]):
                raise SimulationError(f"{request.status} and the reference disagree on {kind}")
        if str(request.status) not in repr(request):
            raise SimulationError(f"repr {request!r} does not show the status")


# --- the block pool machine -------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a :class:`BlockPool` beside a :class:`PoolModel` (reference counts, FIFO list).

    Every call the model refuses must raise and change nothing; every other call must
    change the pool exactly as the model. Blocks are conserved after every rule.

    Class attributes to override in a subclass:
        sizes: Strategy for ``(num_blocks, block_size)``.
    """

    sizes: ClassVar[st.SearchStrategy[tuple[int, int]]] = st.tuples(
        st.integers(1, 10), st.integers(1, 4)
    )

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.model = PoolModel(0)

    @initialize(data=st.data())
    def create(self, data: st.DataObject) -> None:
        num_blocks, block_size = data.draw(self.sizes, label="sizes")
        self.pool = BlockPool(num_blocks, block_size)
        self.model = PoolModel(num_blocks)

    def _pool(self) -> BlockPool:
        assert self.pool is not None
        return self.pool

    def _ids(self) -> st.SearchStrategy[int]:
        """Any id, valid or not (one past each end)."""
        return st.integers(-1, self._pool().num_blocks)

    def _refused(self, call: str, action: Callable[[], object], error: type[Exception]) -> None:
        pool = self._pool()
        before = [pool.ref_count(b) for b in range(pool.num_blocks)], pool.statistics()
        try:
            action()
        except error:
            after = [pool.ref_count(b) for b in range(pool.num_blocks)], pool.statistics()
            if after != before:
                raise SimulationError(f"{call} was refused but changed the pool") from None
            return
        raise SimulationError(f"{call} should raise {error.__name__}")

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        pool = self._pool()
        count = data.draw(st.integers(-1, pool.num_blocks + 1), label="count")
        expected = self.model.allocate(count)
        if expected is None:
            error = ValueError if count < 0 else SchedulerError
            self._refused(f"allocate({count})", lambda: pool.allocate(count), error)
        elif pool.allocate(count) != expected:
            raise SimulationError(f"allocate({count}) did not take {expected} (FIFO)")

    @rule(data=st.data())
    def retain(self, data: st.DataObject) -> None:
        pool = self._pool()
        held = self.model.held
        ids = (st.sampled_from(held) | self._ids()) if held else self._ids()
        block_ids = data.draw(st.lists(ids, max_size=3), label="block_ids")
        if not self.model.can_retain(block_ids):
            self._refused(f"retain({block_ids})", lambda: pool.retain(block_ids), SchedulerError)
            return
        pool.retain(block_ids)
        self.model.retain(block_ids)

    @precondition(lambda self: bool(self.model.held))
    @rule(data=st.data())
    def release_held(self, data: st.DataObject) -> None:
        """Release references that are held: always succeeds."""
        held = self.model.held
        order = data.draw(st.permutations(held), label="order")
        block_ids = order[: data.draw(st.integers(1, len(held)), label="count")]
        self._pool().release(block_ids)
        self.model.release(block_ids)

    @rule(data=st.data())
    def release_any(self, data: st.DataObject) -> None:
        """Release anything: double frees, unknown ids, too many drops must be refused."""
        pool = self._pool()
        block_ids = data.draw(st.lists(self._ids(), max_size=3), label="block_ids")
        if not self.model.can_release(block_ids):
            self._refused(f"release({block_ids})", lambda: pool.release(block_ids), SchedulerError)
            return
        pool.release(block_ids)
        self.model.release(block_ids)

    @precondition(lambda self: bool(self.model.free))
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        pool = self._pool()
        block_id = data.draw(st.sampled_from(list(self.model.free)), label="block_id")
        self._refused(f"release([{block_id}])", lambda: pool.release([block_id]), SchedulerError)

    @invariant()
    def conserved(self) -> None:
        if self.pool is None:
            return
        pool = self.pool
        pool.check_invariants()
        stats = pool.statistics()
        expected = self.model.counts()
        if (stats.num_free_blocks, stats.num_used_blocks, stats.num_shared_blocks) != expected:
            raise SimulationError(f"{stats} != reference (free, used, shared) {expected}")
        if stats.num_free_blocks + stats.num_used_blocks != stats.num_blocks:
            raise SimulationError(f"blocks not conserved: {stats}")
        counts = [pool.ref_count(b) for b in range(pool.num_blocks)]
        if counts != list(self.model.refs.values()):
            raise SimulationError(f"reference counts {counts} != reference {self.model.refs}")


# --- the scheduler machine --------------------------------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """Drives a :class:`Scheduler` the way the engine does, in every order, on a tiny pool.

    Rules submit requests (one to four at once, follow-ups whose prompts start with an
    earlier request's tokens so that prefix caching hits, and ones that must be refused),
    plan a step when the pipeline has room, complete or fail the oldest step, run the
    bookkeeping loop
    (complete, then refill the pipeline), cancel any id at any moment (alone, in a burst,
    or every live request while steps are in flight, in any order), and finish decoding
    requests early (a stop string). Hypothesis' swarm testing switches random subsets of
    rules off per run, so some runs only queue and some never cancel. After every rule the
    :class:`SimulatedEngine` checks the budgets, FIFO admission, block conservation, the
    release of ended requests' blocks, and every output against the reference. At
    teardown, with arrivals stopped, the scheduler must reach idle within
    :func:`step_bound` steps.

    Class attributes to override in a subclass (or use :meth:`for_config`):
        configs: Strategy for the configuration (default :func:`scheduler_configs`).
        scheduler_class: The scheduler to test (a subclass of :class:`Scheduler`).
        inject_failures: Whether a rule fails steps (a device error).
        max_prompt_tokens, max_tokens: Request sizes.

    Override :meth:`next_token` to use another "model".
    """

    configs: ClassVar[st.SearchStrategy[SchedulerConfig]] = scheduler_configs()
    scheduler_class: ClassVar[type[Scheduler]] = Scheduler
    inject_failures: ClassVar[bool] = True
    max_prompt_tokens: ClassVar[int] = 24
    max_tokens: ClassVar[int] = 12

    request_ids = Bundle("request_ids")

    @classmethod
    def for_config(
        cls, config: SchedulerConfig | st.SearchStrategy[SchedulerConfig]
    ) -> type[SchedulerMachine]:
        """A subclass that tests ``config`` (a fixed value or a strategy).

        Args:
            config: The configuration to test.

        Returns:
            The machine class; its ``TestCase`` attribute is a test to collect.
        """
        configs = config if isinstance(config, st.SearchStrategy) else st.just(config)
        return type(f"{cls.__name__}ForConfig", (cls,), {"configs": configs})

    def __init__(self) -> None:
        super().__init__()
        self.simulation: SimulatedEngine | None = None
        self.now = 0.0
        self.next_id = 0

    def next_token(self, token_ids: Sequence[int]) -> int:
        """The "model" of the simulated device and of the reference."""
        return toy_next_token(token_ids)

    def _clock(self) -> float:
        self.now += 1.0
        return self.now

    @initialize(data=st.data())
    def create(self, data: st.DataObject) -> None:
        config = data.draw(self.configs, label="config")
        scheduler = self.scheduler_class(
            config, clock=self._clock, speculator=self.speculator(config, data)
        )
        self.simulation = SimulatedEngine(scheduler, next_token=self.next_token)

    def speculator(self, config: SchedulerConfig, data: st.DataObject) -> Speculator | None:
        """What drafts for the scheduler: by default what ``config`` says."""
        return None

    @property
    def engine(self) -> SimulatedEngine:
        assert self.simulation is not None
        return self.simulation

    def _specs(self) -> st.SearchStrategy[RequestSpec]:
        return request_specs(
            self.engine.config,
            max_prompt_tokens=self.max_prompt_tokens,
            max_tokens=self.max_tokens,
            scheduling_only=True,
            constrained=True,
        )

    @rule(target=request_ids, data=st.data())
    def add_requests(self, data: st.DataObject) -> MultipleResults[int]:
        """Submit one to four requests (arrivals must outpace the cancel rules)."""
        specs = data.draw(st.lists(self._specs(), min_size=1, max_size=4), label="specs")
        request_ids = []
        for spec in specs:
            request_id, self.next_id = self.next_id, self.next_id + 1
            self.engine.submit(spec.build(request_id, self.now))
            request_ids.append(request_id)
        return multiple(*request_ids)

    @precondition(lambda self: bool(self.engine.requests))
    @rule(target=request_ids, data=st.data())
    def add_follow_up(self, data: st.DataObject) -> int:
        """Submit a request whose prompt starts with another's tokens (a shared system
        prompt, or the next turn of a conversation): with prefix caching, it hits."""
        engine = self.engine
        earlier = engine.requests[data.draw(st.sampled_from(sorted(engine.requests)))]
        known = earlier.prompt_token_ids + earlier.output_token_ids
        prefix = known[: data.draw(st.integers(1, len(known)), label="shared")]
        spec = data.draw(self._specs(), label="spec")
        prompt = (prefix + spec.prompt_token_ids)[: max(len(spec.prompt_token_ids), len(prefix))]
        spec = attrs.evolve(spec, prompt_token_ids=prompt)
        if not spec.fits(engine.config):
            spec = attrs.evolve(spec, params=attrs.evolve(spec.params, max_tokens=1, min_tokens=0))
        while not spec.fits(engine.config):
            spec = attrs.evolve(spec, prompt_token_ids=spec.prompt_token_ids[:-1])
        request_id, self.next_id = self.next_id, self.next_id + 1
        engine.submit(spec.build(request_id, self.now))
        return request_id

    @rule(data=st.data())
    def add_unservable(self, data: st.DataObject) -> None:
        """A request that can never fit, or a reused id, is refused and nothing changes."""
        engine = self.engine
        config = engine.config
        reuse = bool(engine.requests) and data.draw(st.booleans(), label="reuse an id")
        if reuse:
            request_id = data.draw(st.sampled_from(sorted(engine.requests)))
            spec = RequestSpec(prompt_token_ids=[1])
            error: type[Exception] = SchedulerError
            if request_id not in engine.scheduler:
                return  # a removed id may be reused
        else:
            request_id = self.next_id
            capacity = min(config.max_model_len, config.num_blocks * config.block_size + 1)
            num_prompt = data.draw(st.integers(0, capacity + 1))
            most = max(capacity + 1 - num_prompt, 1)
            spec = RequestSpec([7] * num_prompt, SamplingParams(max_tokens=most))
            error = RequestRejected
        before = engine.scheduler.statistics()
        try:
            engine.scheduler.add_request(spec.build(request_id))
        except error:
            if engine.scheduler.statistics() != before:
                raise SimulationError("a refused request changed the scheduler") from None
            return
        raise SimulationError(f"{spec} with id {request_id} should raise {error.__name__}")

    @precondition(lambda self: self.engine.scheduler.can_schedule)
    @rule()
    def schedule(self) -> None:
        self.engine.plan()

    @precondition(lambda self: self.engine.scheduler.num_inflight_steps > 0)
    @rule()
    def complete(self) -> None:
        self.engine.complete()

    @rule(count=st.integers(0, 3))
    def advance(self, count: int) -> None:
        """Run the bookkeeping loop: complete the oldest step, then refill the pipeline.

        It stops with the pipeline full, so the next rule (a cancel, an arrival) often meets
        ``pipeline_depth`` steps in flight, as the engine's would while the device is busy.
        """
        for index in range(count + 1):
            if index and self.engine.scheduler.num_inflight_steps:
                self.engine.complete()
                self.engine.check()
            while self.engine.scheduler.can_schedule and self.engine.plan() is not None:
                self.engine.check()

    @precondition(
        lambda self: self.inject_failures and self.engine.scheduler.num_inflight_steps > 0
    )
    @rule()
    def fail(self) -> None:
        self.engine.complete(failure="simulated device error")

    @rule(request_id=request_ids | st.integers(-2, -1))
    def cancel(self, request_id: int) -> None:
        """Cancel any id: live, ended, removed, or never seen."""
        self.engine.cancel(request_id)

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def cancel_live(self, data: st.DataObject) -> None:
        """Cancel live requests in any order at one step boundary (clients leaving at once).

        The order matters with two steps in flight: requests of the newer step may end
        before those of the older one.
        """
        ids = st.lists(st.sampled_from(self._live()), min_size=1, max_size=3, unique=True)
        for request_id in data.draw(ids, label="request_ids"):
            self.engine.cancel(request_id)

    @precondition(
        lambda self: self.engine.scheduler.num_inflight_steps > 0 and len(self._live()) > 1
    )
    @rule(data=st.data())
    def cancel_all(self, data: st.DataObject) -> None:
        """Cancel every live request while steps are in flight (a shutdown).

        The order is newest step first, oldest first, or shuffled; newest step first is the
        order that a queue of deferred releases gets wrong.
        """
        live = self._live()
        order = data.draw(
            st.sampled_from([live, live[::-1]]) | st.permutations(live), label="order"
        )
        for request_id in order:
            self.engine.cancel(request_id)

    def _live(self) -> list[int]:
        """Live request ids, those in steps in flight first (newest step first)."""
        plans = reversed(self.engine.scheduler.inflight_plans)
        inflight = [rid for plan in plans for rid in plan.request_ids]
        live = [r.request_id for r in self.engine.requests.values() if not r.is_terminal]
        return [rid for rid in dict.fromkeys(inflight) if rid in live] + [
            rid for rid in live if rid not in inflight
        ]

    def _decoding(self) -> list[int]:
        statuses = (RequestStatus.DECODING, RequestStatus.PREEMPTED)
        return [
            r.request_id
            for r in self.engine.requests.values()
            if r.status in statuses and r.num_output_tokens
        ]

    @precondition(lambda self: bool(self._decoding()))
    @rule(data=st.data())
    def stop_string(self, data: st.DataObject) -> None:
        """The engine matched a stop string in a decoding request's text."""
        request_id = data.draw(st.sampled_from(self._decoding()), label="request_id")
        self.engine.finish_on_stop_string(request_id)

    @invariant()
    def guarantees(self) -> None:
        if self.simulation is not None:
            self.simulation.check()

    def teardown(self) -> None:
        # Hypothesis calls teardown in a ``finally``: drain only after a clean run, so a
        # failure found by a rule is reported as it is, not hidden behind a drain error.
        if self.simulation is not None and sys.exc_info()[0] is None:
            self.simulation.run_until_idle()


#: How :class:`DraftingSchedulerMachine` drafts: the model's own continuation, random ids,
#: the continuation with one token wrong, a mix, or the configured method itself.
DRAFTS = ("perfect", "random", "adversarial", "mixed", "method")


class DraftingSchedulerMachine(SchedulerMachine):
    """:class:`SchedulerMachine` whose running requests draft tokens (speculative decoding).

    The drafts are the test's: the model's own greedy continuation (every draft holds until
    the request ends), random ids, that continuation with one token changed, a mix of these,
    or the configured method's (``ngram`` or ``suffix``). Whatever they are, every guarantee
    of the base machine holds: no block leaks, a step never passes its budget (drafts count),
    every output equals the reference computed without drafts (so preempting a request
    whose drafts are in flight resumes identically), and no block is cached whose KV holds a
    rejected draft (the simulated device's reads would return it, and the output would
    differ).
    """

    def speculator(self, config: SchedulerConfig, data: st.DataObject) -> Speculator | None:
        drafts = data.draw(st.sampled_from(DRAFTS), label="drafts")
        spec = SpeculativeConfig(
            method=data.draw(st.sampled_from(["ngram", "suffix"]), label="method"),
            num_speculative_tokens=data.draw(st.integers(1, 5), label="num_speculative_tokens"),
            prompt_lookup_min=1,
            suffix_max_depth=8,
            suffix_cache_tokens=data.draw(st.sampled_from([0, 16, 64])),
            disable_by_batch_size=data.draw(st.none() | st.integers(1, 4)),
            adaptive=data.draw(st.booleans(), label="adaptive"),
        )
        if drafts == "method":
            return Speculator(spec)
        rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="draft seed"))

        def propose(request_id: int, known: Sequence[int], wanted: int) -> list[int]:
            kind = rng.choice(DRAFTS[:3]) if drafts == "mixed" else drafts
            if kind == "random":
                return [rng.randrange(VOCAB_SIZE) for _ in range(wanted)]
            sequence = list(known)
            for _ in range(wanted):
                sequence.append(self.next_token(sequence))
            draft = sequence[len(known) :]
            if kind == "adversarial" and draft:
                place = rng.randrange(len(draft))
                draft[place] = (draft[place] + 1) % VOCAB_SIZE
            return draft

        return Speculator(spec, propose=propose)
