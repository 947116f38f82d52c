"""The scheduler: stateful tests on tiny pools, depth 1 against depth 2, and unit tests."""

from __future__ import annotations

import collections
import itertools
import re
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.states.errors import (
    EngineOverloaded,
    InvalidTransition,
    RequestRejected,
    SchedulerError,
)
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, ScheduledRequest, StepFailure
from twostroke.states.request import FinishReason, Request, RequestStatus
from twostroke.states.scheduler import Scheduler, SchedulerConfig, SchedulerStatistics
from twostroke.states.scheduler_config import SchedulingPolicy
from twostroke.states.testing import (
    RequestSpec,
    SchedulerMachine,
    SimulatedEngine,
    SimulatedKV,
    Workload,
    drive,
    reference_output,
    running_ids,
    scheduler_configs,
    step_bound,
    waiting_ids,
    workloads,
)
from twostroke.states.testing.reference import request_snapshot
from twostroke.states.validators import MAX_PIPELINE_DEPTH

# --- stateful -------------------------------------------------------------------------------

#: Pools of at most 18 positions with 2 to 4 requests running: most runs preempt.
tiny_configs = scheduler_configs(
    num_blocks=st.integers(2, 6),
    block_size=st.integers(1, 3),
    max_num_seqs=st.integers(2, 4),
    max_num_batched_tokens=st.integers(2, 16),
)


def _tiny_pool(block_size: st.SearchStrategy[int]) -> Any:
    """The lookahead under memory pressure, where the rarest interleavings live."""
    return SchedulerMachine.for_config(
        scheduler_configs(
            num_blocks=st.integers(2, 6),
            block_size=block_size,
            max_num_seqs=st.integers(2, 4),
            max_num_batched_tokens=st.integers(2, 16),
            pipeline_depth=2,
        )
    ).TestCase


# Two machines, one pool each (blocks of one token, blocks of two or three), so that each
# fits its timeout on a loaded 2-core machine and the two run on different workers.
TestSchedulerTinyPool = _tiny_pool(st.integers(2, 3))
TestSchedulerTinyPoolOneTokenBlocks = _tiny_pool(st.just(1))
#: Pools of up to 48 positions, one machine per pipeline depth (each fits its timeout on a
#: loaded 2-core machine, and the two run on different workers).
TestScheduler = SchedulerMachine.for_config(scheduler_configs(pipeline_depth=1)).TestCase
TestSchedulerLookahead = SchedulerMachine.for_config(scheduler_configs(pipeline_depth=2)).TestCase


# Four machines at the profile's examples each (240 runs of up to 50 rules with `ci`), not
# two at three times: with constrained requests a machine at three times ran past its 120 s
# timeout in `make test` under a one-core load, and four spread over both workers. A run
# costs ~30 ms; the interleavings that turn up once in a few hundred runs (cancel a request
# of step N+1, then one of step N, while both are in flight) are the `thorough` profile's.


# --- properties -------------------------------------------------------------------------------


@given(st.data())
def test_depth_1_and_depth_2_stream_identical_tokens(data: st.DataObject) -> None:
    config = data.draw(scheduler_configs(pipeline_depth=1), label="config")
    workload = data.draw(workloads(config, scheduling_only=True), label="workload")
    serial = drive(Scheduler(config), workload)
    overlapped = drive(Scheduler(attrs.evolve(config, pipeline_depth=2)), workload)
    assert serial.outputs == overlapped.outputs
    assert serial.statuses == overlapped.statuses
    assert serial.finish_reasons == overlapped.finish_reasons
    for request_id, spec in enumerate(workload.requests):
        expected, reason = reference_output(
            spec.prompt_token_ids,
            spec.params,
            eos_token_ids=spec.eos_token_ids,
            window=config.sliding_window,
        )
        assert list(serial.outputs[request_id]) == expected
        assert str(serial.finish_reasons[request_id]) == reason


@given(st.data())
def test_memory_pressure_never_changes_output(data: st.DataObject) -> None:
    tight = data.draw(tiny_configs, label="config")
    workload = data.draw(workloads(tight, scheduling_only=True), label="workload")
    roomy = attrs.evolve(tight, num_blocks=1000, max_num_seqs=64)
    pressed = drive(Scheduler(tight), workload)
    free = drive(Scheduler(roomy), workload)
    assert free.statistics.num_preemptions == 0
    assert pressed.outputs == free.outputs


@given(st.data())
def test_no_request_waits_past_its_aging_bound(data: st.DataObject) -> None:
    """The bound docs/states.md states: a request R is passed only by requests of a smaller
    rank, all arrived by step L (the last of them to arrive); R ends within ``step_bound``
    of what had arrived by then, L + that many completed steps at most, whatever arrives
    after L. A long stream of short requests of a few priorities, so that ranks cross."""
    config = data.draw(
        scheduler_configs(
            num_blocks=st.integers(2, 8),
            max_num_seqs=st.integers(1, 3),
            priority_aging_steps=st.integers(1, 3),
        ),
        label="config",
    )
    workload = data.draw(
        workloads(
            config,
            max_requests=24,
            max_gap=2,
            max_prompt_tokens=4,
            max_tokens=3,
            scheduling_only=True,
        ),
        label="workload",
    )
    engine = SimulatedEngine(Scheduler(config))
    ended: dict[int, int] = {}
    pending = collections.deque(workload.build())
    while True:
        while pending and pending[0][0] <= engine.num_completed:
            engine.submit(pending.popleft()[1])
        if engine.advance():
            engine.check()
        elif pending:
            engine.submit(pending.popleft()[1])
        else:
            break
        for rid, record in engine.requests.items():
            if record.is_terminal:
                ended.setdefault(rid, engine.num_completed)
    # Fresh copies: step_bound counts the requests that are not terminal yet.
    requests = {r.request_id: r for _, r in workload.build()}
    for rid, rank in engine.ranks.items():
        ahead = [other for other, theirs in engine.ranks.items() if theirs <= rank]
        last = max(engine.arrival_steps[other] for other in ahead)
        arrived = [requests[o] for o, step in engine.arrival_steps.items() if step <= last]
        bound = last + step_bound(config, arrived)
        assert ended[rid] <= bound, (rid, rank, ended[rid], last, bound)


def test_a_preempted_request_produces_the_output_of_an_unpressed_run() -> None:
    config = SchedulerConfig(
        num_blocks=4, block_size=2, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=9
    )
    specs = [RequestSpec([1, 2], SamplingParams(max_tokens=6, ignore_eos=True))] * 2
    for depth in range(1, MAX_PIPELINE_DEPTH + 1):
        result = drive(Scheduler(attrs.evolve(config, pipeline_depth=depth)), specs_to(specs))
        assert result.statistics.num_preemptions >= 1
        expected = reference_output([1, 2], specs[0].params)[0]
        assert result.outputs == {0: tuple(expected), 1: tuple(expected)}


def specs_to(specs: list[RequestSpec]) -> Workload:
    return Workload(requests=specs)


# --- submission -------------------------------------------------------------------------------


def config(**overrides: int) -> SchedulerConfig:
    values = {
        "num_blocks": 8,
        "block_size": 4,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "max_model_len": 32,
        "pipeline_depth": 2,
    }
    return SchedulerConfig(**(values | overrides))


def request(request_id: int, prompt: int = 4, **params: int) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(request_id, range(1, prompt + 1), SamplingParams(**params), arrival_time=0)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message", "numbers"),
    [
        (0, 4, "the prompt must contain at least one token, got 0", (None, None, None)),
        (
            30,
            4,
            "prompt (30 tokens) + max_tokens (4) must be <= max_model_len (32), got 34",
            (30, 4, 32),
        ),
        (
            20,
            12,
            "prompt + max_tokens (32 tokens) needs 8 KV blocks of 4, but the pool has only 6",
            (None, None, None),
        ),
    ],
)
def test_requests_that_can_never_fit_are_rejected_not_queued(
    prompt: int, max_tokens: int, message: str, numbers: tuple[int | None, ...]
) -> None:
    scheduler = Scheduler(config(num_blocks=6))
    with pytest.raises(RequestRejected, match=f"^{re.escape(message)}$") as caught:
        scheduler.add_request(request(1, prompt, max_tokens=max_tokens))
    assert isinstance(caught.value, ValueError)
    rejected = caught.value
    # Only a rejection for the context carries its numbers (a front end words it from them).
    assert (rejected.num_prompt_tokens, rejected.max_tokens, rejected.max_model_len) == numbers
    assert 1 not in scheduler
    assert scheduler.is_idle()


def test_the_last_token_needs_no_block() -> None:
    scheduler = Scheduler(config(num_blocks=2))
    scheduler.add_request(request(1, 5, max_tokens=4))  # 9 tokens, 8 positions: 2 blocks
    assert waiting_ids(scheduler) == (1,)


def test_ids_must_be_unique_and_requests_new() -> None:
    scheduler = Scheduler(config())
    scheduler.add_request(request(1))
    with pytest.raises(SchedulerError, match=r"^request id 1 is already in use$"):
        scheduler.add_request(request(1))
    used = request(2)
    scheduler.add_request(used)
    scheduler.schedule()
    with pytest.raises(SchedulerError, match=r"^request 2 is not new: <Request 2 DECODING"):
        Scheduler(config()).add_request(used)


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("num_blocks", 0, ValueError, "num_blocks must be >= 1, got 0"),
        ("block_size", 0, ValueError, "block_size must be >= 1, got 0"),
        ("max_num_batched_tokens", 0, ValueError, "max_num_batched_tokens must be >= 1, got 0"),
        ("max_num_seqs", -1, ValueError, "max_num_seqs must be >= 1, got -1"),
        ("max_model_len", 1, ValueError, "max_model_len must be >= 2, got 1"),
        (
            "pipeline_depth",
            3,
            ValueError,
            "pipeline_depth must be 1 (serial) or 2 (lookahead), got 3",
        ),
        (
            "max_waiting_requests",
            0,
            ValueError,
            "max_waiting_requests must be >= 1 (or None for no limit), got 0",
        ),
        ("num_blocks", 2.0, TypeError, "num_blocks must be an int, got float 2.0"),
        ("max_num_seqs", True, TypeError, "max_num_seqs must be an int, got bool True"),
    ],
)
def test_config_is_validated(
    field: str, value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        config(**{field: value})  # type: ignore[arg-type]


def test_a_policy_sized_is_a_config_with_every_field_of_the_policy() -> None:
    policy = SchedulingPolicy(
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        pipeline_depth=1,
        enable_prefix_caching=False,
        max_waiting_requests=3,
    )
    sized = SchedulerConfig.sized(policy, num_blocks=5, max_model_len=12)
    assert sized == SchedulerConfig(
        num_blocks=5,
        max_model_len=12,
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        pipeline_depth=1,
        enable_prefix_caching=False,
        max_waiting_requests=3,
    )
    with pytest.raises(ValueError, match=r"^num_blocks must be >= 1, got 0$"):
        SchedulerConfig.sized(policy, num_blocks=0, max_model_len=12)


class CountingArrivals(dict[int, tuple[int, int]]):
    """The scheduler's ranks, counting every look-up (the queues' sort key)."""

    lookups = 0

    def __getitem__(self, request_id: int) -> tuple[int, int]:
        self.lookups += 1
        return super().__getitem__(request_id)


def count_arrival_lookups(scheduler: Scheduler) -> CountingArrivals:
    arrivals = CountingArrivals(scheduler._rank)
    scheduler._rank = arrivals
    return arrivals


def test_a_new_request_joins_the_back_of_the_queue_without_a_search() -> None:
    # Issue 20: each submit rebuilt the list of the waiting queue's keys (16,000 submits
    # blocked the event loop for 13.6 s). A new request of the queue's last priority ranks
    # after all the others: one comparison with the back, no search.
    scheduler = Scheduler(config())
    arrivals = count_arrival_lookups(scheduler)
    for request_id in range(1000):
        scheduler.add_request(request(request_id))
    assert arrivals.lookups == 999  # the first met an empty queue
    assert waiting_ids(scheduler) == tuple(range(1000))
    scheduler.check_invariants()


def preempt_behind(backlog: int, **overrides: int) -> tuple[Scheduler, CountingArrivals]:
    """Requests 1, 2, 3 run, ``backlog`` newer ones wait, then 3 is preempted (the newest)."""
    scheduler = Scheduler(
        config(num_blocks=4, block_size=2, max_model_len=7, pipeline_depth=1, **overrides)
    )
    kv = SimulatedKV(4, 2)
    for request_id in (1, 2, 3):
        scheduler.add_request(request(request_id, 2, max_tokens=4))
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.apply(kv.execute(plan))
    for request_id in range(4, 4 + backlog):
        scheduler.add_request(request(request_id, 2, max_tokens=4))
    arrivals = count_arrival_lookups(scheduler)
    plan = scheduler.schedule()  # 1 and 2 each need a second block: 3 gives its up
    assert plan is not None
    assert plan.request_ids == (1, 2)
    return scheduler, arrivals


def test_a_preempted_request_goes_back_before_every_newer_one_by_binary_search() -> None:
    scheduler, arrivals = preempt_behind(1000)
    assert arrivals.lookups <= 2 * (1003).bit_length() + 4  # O(log n), not one per request
    assert waiting_ids(scheduler) == (3, *range(4, 1004))
    scheduler.check_invariants()


def test_a_full_waiting_queue_refuses_a_new_request_and_changes_nothing() -> None:
    scheduler = Scheduler(config(max_waiting_requests=2))
    scheduler.add_request(request(1))
    scheduler.add_request(request(2))
    before = scheduler.statistics()
    message = (
        "the waiting queue is full: 2 requests wait for admission and max_waiting_requests "
        "is 2; retry later"
    )
    with pytest.raises(EngineOverloaded, match=f"^{re.escape(message)}$") as caught:
        scheduler.add_request(request(3))
    assert not isinstance(caught.value, RequestRejected)  # it may be served later
    with pytest.raises(EngineOverloaded, match=f"^{re.escape(message)}$"):
        scheduler.check_waiting_room()
    assert 3 not in scheduler
    assert waiting_ids(scheduler) == (1, 2)
    assert scheduler.statistics() == before
    # A request that can never be served says so, full queue or not.
    with pytest.raises(RequestRejected):
        scheduler.add_request(request(3, 0))
    plan = scheduler.schedule()  # admits both: the queue has room again
    assert plan is not None
    assert plan.request_ids == (1, 2)
    scheduler.check_waiting_room()
    scheduler.add_request(request(3))
    assert waiting_ids(scheduler) == (3,)
    scheduler.check_invariants()


def test_a_preempted_request_goes_back_even_past_max_waiting_requests() -> None:
    scheduler, _ = preempt_behind(3, max_waiting_requests=3)
    assert waiting_ids(scheduler) == (3, 4, 5, 6)  # 4 > 3: nothing admitted is ever dropped
    scheduler.check_invariants()
    with pytest.raises(EngineOverloaded, match=r"^the waiting queue is full: 4 requests wait"):
        scheduler.add_request(request(7, 2))


def test_no_max_waiting_requests_is_no_limit() -> None:
    scheduler = Scheduler(config())
    assert scheduler.config.max_waiting_requests is None
    for request_id in range(300):
        scheduler.check_waiting_room()
        scheduler.add_request(request(request_id))
    assert len(waiting_ids(scheduler)) == 300


# --- planning -----------------------------------------------------------------------------


def test_long_prompts_are_chunked_and_mixed_with_decodes_under_the_budget() -> None:
    scheduler = Scheduler(config(max_num_batched_tokens=8))
    kv = SimulatedKV(8, 4)
    scheduler.add_request(request(1, 3))
    first = scheduler.schedule()
    assert first is not None
    assert first.num_tokens == 3
    assert first.num_samples == 1
    scheduler.apply(kv.execute(first))
    scheduler.add_request(request(2, 20))
    plan = scheduler.schedule()
    assert plan is not None
    assert [(e.request_id, e.num_tokens, e.sample) for e in plan.requests] == [
        (1, 1, True),
        (2, 7, False),
    ]
    assert plan.num_tokens == 8


def test_admission_is_fifo_and_stops_at_the_first_request_that_does_not_fit() -> None:
    scheduler = Scheduler(config(num_blocks=3, max_num_batched_tokens=64, max_model_len=13))
    scheduler.add_request(request(1, 8, max_tokens=1))  # 2 blocks
    scheduler.add_request(request(2, 8, max_tokens=1))  # 2 blocks: does not fit now
    scheduler.add_request(request(3, 1, max_tokens=1))  # would fit, but must wait its turn
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.request_ids == (1,)
    assert waiting_ids(scheduler) == (2, 3)
    scheduler.check_invariants()  # the queues themselves in that order


def test_preemption_takes_the_newest_running_request() -> None:
    scheduler = Scheduler(config(num_blocks=4, block_size=2, max_model_len=7, pipeline_depth=1))
    kv = SimulatedKV(4, 2)
    for request_id in (1, 2, 3):
        scheduler.add_request(request(request_id, 2, max_tokens=4))
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.request_ids == (1, 2, 3)
    scheduler.apply(kv.execute(plan))
    # Each now needs a second block and one is free: 1 takes it, 2 takes 3's.
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.request_ids == (1, 2)
    newest = scheduler.get(3)
    assert newest is not None
    assert newest.status is RequestStatus.PREEMPTED
    assert newest.block_table == ()
    assert newest.num_computed_tokens == 0
    assert running_ids(scheduler) == (1, 2)
    assert waiting_ids(scheduler) == (3,)
    scheduler.check_invariants()  # the queues themselves in that order
    assert scheduler.statistics().num_preemptions == 1


# --- priorities -------------------------------------------------------------------------------


def test_admission_takes_the_lowest_priority_value_first_and_arrival_order_among_equals() -> None:
    scheduler = Scheduler(config(max_num_seqs=2))
    for request_id, priority in ((1, 2), (2, 0), (3, 1), (4, 0), (5, -1)):
        scheduler.add_request(request(request_id, priority=priority))
    assert waiting_ids(scheduler) == (5, 2, 4, 3, 1)
    scheduler.check_invariants()
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.request_ids == (5, 2)
    assert waiting_ids(scheduler) == (4, 3, 1)


def test_a_better_priority_that_does_not_fit_is_not_passed_by_worse_ones() -> None:
    # Admission stops at the first request that does not fit, in rank order: a stream of
    # small low-priority requests can't keep a large high-priority one out.
    scheduler = Scheduler(config(num_blocks=3, max_num_batched_tokens=64, max_model_len=13))
    scheduler.add_request(request(1, 8, max_tokens=2))  # 2 blocks
    assert scheduler.schedule() is not None
    scheduler.add_request(request(2, 1, max_tokens=1, priority=5))  # would fit
    scheduler.add_request(request(3, 8, max_tokens=1, priority=-5))  # 2 blocks: does not fit
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.request_ids == (1,)
    assert waiting_ids(scheduler) == (3, 2)


def test_preemption_takes_the_lowest_priority_running_request() -> None:
    scheduler = Scheduler(config(num_blocks=4, block_size=2, max_model_len=7, pipeline_depth=1))
    kv = SimulatedKV(4, 2)
    for request_id, priority in ((1, 1), (2, 0), (3, 0)):
        scheduler.add_request(request(request_id, 2, max_tokens=4, priority=priority))
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.request_ids == (2, 3, 1)  # served in rank order
    scheduler.apply(kv.execute(plan))
    # Each now needs a second block and one is free: 2 takes it, 3 takes 1's (the oldest,
    # but of the worst priority); among equals the newest would go (the test above).
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.request_ids == (2, 3)
    victim = scheduler.get(1)
    assert victim is not None
    assert victim.status is RequestStatus.PREEMPTED
    assert running_ids(scheduler) == (2, 3)
    assert waiting_ids(scheduler) == (1,)
    scheduler.check_invariants()


def test_a_waiting_request_gains_one_level_per_priority_aging_steps() -> None:
    # Request 1 (priority 2, N = 3) holds the only seat for 16 steps; 2 (priority 4) waits.
    # Its rank is 4 * 3 + 1 = 13: a priority-0 request arriving before step 13 passes it,
    # one arriving after does not, however many wait.
    scheduler = Scheduler(config(max_num_seqs=1, pipeline_depth=1, priority_aging_steps=3))
    kv = SimulatedKV(8, 4)
    scheduler.add_request(request(1, max_tokens=16, ignore_eos=True, priority=2))
    assert scheduler.rank(1) == (6, 0)
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.add_request(request(2, priority=4))
    assert scheduler.rank(2) == (13, 1)
    for step in range(1, 16):
        scheduler.apply(kv.execute(plan))
        if step in (12, 13):
            scheduler.add_request(request(step + 100, priority=0))
        plan = scheduler.schedule()
        assert plan is not None
    assert scheduler.rank(112) == (12, 2)
    assert scheduler.rank(113) == (13, 3)  # a tie on steps: arrival decides
    assert waiting_ids(scheduler) == (112, 2, 113)
    scheduler.check_invariants()


def test_a_low_priority_request_waits_a_bounded_time_behind_a_stream_of_better_ones() -> None:
    # One seat; a priority-0 request arrives at every step, forever: without aging the
    # priority-3 request would never run. With N = 2 it ranks (3 * 2 + 0, ...) and is
    # passed only by requests arriving before step 6.
    scheduler = Scheduler(config(max_num_seqs=1, pipeline_depth=1, priority_aging_steps=2))
    engine = SimulatedEngine(scheduler)
    engine.submit(request(0, max_tokens=1, priority=3))
    next_id = 1
    while 0 not in engine.first_admissions:
        engine.submit(request(next_id, max_tokens=1, priority=0))
        next_id += 1
        engine.advance()
        engine.check()
        assert engine.num_completed <= 20, engine.first_admissions
    passed = engine.first_admissions[: engine.first_admissions.index(0)]
    # Each one arrived before step 6 (its rank is the steps planned before it arrived).
    assert passed
    assert max(engine.ranks[rid][0] for rid in passed) < 6 < engine.ranks[next_id - 1][0]


# --- planning (continued) ---------------------------------------------------------------------


def test_a_full_pipeline_refuses_to_plan() -> None:
    scheduler = Scheduler(config(pipeline_depth=1))
    scheduler.add_request(request(1))
    assert scheduler.schedule() is not None
    assert not scheduler.can_schedule
    message = "can't plan a step while 1 steps are in flight (pipeline_depth=1)"
    with pytest.raises(SchedulerError, match=f"^{re.escape(message)}$"):
        scheduler.schedule()


def test_nothing_to_do_plans_nothing() -> None:
    assert Scheduler(config()).schedule() is None


# --- the lookahead ------------------------------------------------------------------------------


def test_step_n_plus_1_feeds_the_token_of_step_n_from_the_device() -> None:
    scheduler = Scheduler(config())
    kv = SimulatedKV(8, 4)
    scheduler.add_request(request(1, 3, max_tokens=3))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert first is not None
    assert second is not None
    (entry,) = second.requests
    assert entry.pending_input
    assert entry.token_ids == ()
    assert entry.start == 3
    assert entry.sample
    assert entry.sample_index == 1
    assert (first.planned_behind, second.planned_behind) == (None, first.step_id)
    assert scheduler.get(1).num_placeholders == 2  # type: ignore[union-attr]
    first_outcome, second_outcome = kv.execute(first), kv.execute(second)
    report = scheduler.apply(first_outcome)
    assert scheduler.inflight_plans == (second,)
    assert report.new_tokens == ((1, first_outcome.sampled[1]),)
    scheduler.apply(second_outcome)
    assert scheduler.get(1).output_token_ids == (  # type: ignore[union-attr]
        first_outcome.sampled[1],
        second_outcome.sampled[1],
    )


def test_a_request_that_finishes_at_step_n_drops_its_n_plus_1_token_and_frees_after() -> None:
    scheduler = Scheduler(config())
    kv = SimulatedKV(8, 4)
    scheduler.add_request(request(1, 3, max_tokens=1))
    scheduler.add_request(request(2, 3, max_tokens=3))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert first is not None
    assert second is not None
    assert second.request_ids == (2,)  # request 1's only token is in flight: nothing to compute
    scheduler.apply(kv.execute(first))
    third = scheduler.schedule()
    assert third is not None
    outcomes = [kv.execute(second), kv.execute(third)]
    assert running_ids(scheduler) == (2,)
    scheduler.cancel(2)  # request 2 is in steps 1 and 2
    # No live request is left, but steps in flight still use its blocks: not idle yet.
    stats = scheduler.statistics()
    assert (stats.num_waiting, stats.num_running, stats.num_ending) == (0, 0, 1)
    assert not scheduler.is_idle()
    assert scheduler.pool.num_free < 8
    report = scheduler.apply(outcomes[0])
    assert report.new_tokens == ()
    assert 2 in scheduler  # its record stays while a step in flight uses its blocks
    assert scheduler.pool.num_free < 8  # step 2 still writes into request 2's blocks
    scheduler.apply(outcomes[1])
    assert 2 not in scheduler
    assert scheduler.pool.num_free == 8
    assert scheduler.is_idle()


def test_blocks_wait_for_their_own_step_whatever_order_requests_end_in() -> None:
    # Found by a random driver: deferred releases were a queue drained from the front, so
    # cancelling a request of step 3 and then one of step 2 held step 2's blocks until step 3
    # completed, after the request record was gone.
    # Without prefix caching: request 3's prompt starts like request 2's and would share.
    cfg = config(
        num_blocks=3,
        block_size=2,
        max_num_batched_tokens=2,
        max_model_len=7,
        enable_prefix_caching=False,
    )
    scheduler = Scheduler(cfg)
    engine = SimulatedEngine(scheduler)
    engine.submit(request(2, 3, max_tokens=2, ignore_eos=True))
    for _ in range(2):
        engine.plan()
    engine.complete()
    engine.plan()
    engine.complete()  # request 2: one token known, its last one in flight in step 2
    engine.submit(request(3, 5, max_tokens=1))
    engine.plan()  # step 3 admits request 3 on the last free block
    assert [plan.request_ids for plan in scheduler.inflight_plans] == [(2,), (3,)]
    engine.cancel(3)
    engine.cancel(2)
    engine.complete()  # step 2: request 2's blocks come back now, not after step 3
    assert 2 not in scheduler
    assert 3 in scheduler
    assert scheduler.pool.num_free == 2
    engine.check()
    scheduler.check_invariants()


# --- cancellation and finishing ---------------------------------------------------------------


def run_to(status: str, depth: int) -> tuple[Scheduler, SimulatedEngine]:
    """A scheduler whose request 1 is at the given point of its life."""
    scheduler = Scheduler(config(max_num_batched_tokens=4, pipeline_depth=depth))
    engine = SimulatedEngine(scheduler)
    engine.submit(request(1, 10, max_tokens=8, ignore_eos=True))
    targets = {
        "queued": lambda: True,
        "mid-prefill": lambda: scheduler.get(1).num_computed_tokens > 0,  # type: ignore[union-attr]
        "in flight": lambda: scheduler.get(1).num_output_tokens >= 2,  # type: ignore[union-attr]
        "finished": lambda: 1 not in scheduler,
    }
    while not targets[status]():
        assert engine.advance()
    return scheduler, engine


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("status", ["queued", "mid-prefill", "in flight", "finished"])
def test_cancel_at_any_moment_is_idempotent_and_frees_by_the_next_step(
    status: str, depth: int
) -> None:
    scheduler, engine = run_to(status, depth)
    live = status != "finished"
    assert engine.cancel(1) is live  # checks the answer and that a second cancel says False
    assert scheduler.cancel(1) is False
    for _ in range(scheduler.num_inflight_steps):
        engine.complete()
    assert 1 not in scheduler
    assert scheduler.pool.num_free == scheduler.config.num_blocks
    assert engine.requests[1].status is (
        RequestStatus.CANCELLED if live else RequestStatus.FINISHED
    )
    assert scheduler.cancel(99) is False  # unknown ids are fine too


def test_a_stop_string_finishes_a_request_and_keeps_the_output_so_far() -> None:
    scheduler, engine = run_to("in flight", 2)
    output = engine.requests[1].output_token_ids
    assert engine.finish_on_stop_string(1)
    assert engine.requests[1].finish_reason is FinishReason.STOP
    engine.run_until_idle()
    assert engine.requests[1].output_token_ids == output
    assert not scheduler.finish_on_stop_string(1)


def test_a_stop_string_before_any_token_is_refused_and_changes_nothing() -> None:
    scheduler = Scheduler(config(max_num_batched_tokens=4))
    scheduler.add_request(request(1, 10))
    scheduler.schedule()
    before = scheduler.statistics()
    with pytest.raises(InvalidTransition, match="status PREFILLING does not accept event Fin"):
        scheduler.finish_on_stop_string(1)
    assert scheduler.statistics() == before
    assert scheduler.get(1).status is RequestStatus.PREFILLING  # type: ignore[union-attr]


# --- outcomes ---------------------------------------------------------------------------------


def test_outcomes_must_match_the_oldest_step_and_carry_every_token() -> None:
    scheduler = Scheduler(config())
    scheduler.add_request(request(1))
    scheduler.add_request(request(2))
    assert scheduler.schedule() is not None
    assert scheduler.schedule() is not None
    tracked = [r for r in scheduler if r is not None]

    def state() -> tuple[object, ...]:
        snapshots = [request_snapshot(r) for r in tracked]
        return scheduler.statistics(), scheduler.inflight_plans, snapshots

    before = state()
    # The runner's output of the second step, or a failure named after it, arriving first.
    message = "outcome for step 1 does not match the oldest step in flight (0)"
    for early in (RunnerOutput(1, {1: 3, 2: 4}), StepFailure(1, "device lost")):
        with pytest.raises(SchedulerError, match=f"^{re.escape(message)}$"):
            scheduler.apply(early)
        assert state() == before
    with pytest.raises(SchedulerError, match=r"^step 0 outcome lacks tokens for \[2\]$"):
        scheduler.apply(RunnerOutput(0, {1: 3}))
    assert state() == before
    scheduler.apply(RunnerOutput(0, {1: 3, 2: 4}))
    scheduler.apply(RunnerOutput(1, {1: 5, 2: 6}))
    assert [r.output_token_ids for r in tracked] == [(3, 5), (4, 6)]
    with pytest.raises(SchedulerError, match=r"does not match the oldest step in flight \(None\)"):
        scheduler.apply(RunnerOutput(1, {}))


def test_a_failed_step_fails_every_request_in_it_and_frees_their_blocks() -> None:
    scheduler = Scheduler(config(pipeline_depth=1))
    for request_id in (1, 2):
        scheduler.add_request(request(request_id))
    scheduler.schedule()
    scheduler.add_request(request(3))
    report = scheduler.apply(StepFailure(0, "device lost"))
    assert report.failed == (1, 2)
    assert 1 not in scheduler
    assert 2 not in scheduler
    assert waiting_ids(scheduler) == (3,)
    assert scheduler.pool.num_free == 8


def test_statistics_and_repr_show_the_state() -> None:
    scheduler = Scheduler(config())
    result = drive(scheduler, [request(i, 5, max_tokens=3, ignore_eos=True) for i in range(3)])
    stats = scheduler.statistics()
    assert stats.num_tokens_generated == 9
    assert stats.num_steps == result.num_steps
    assert stats.num_free_blocks == stats.num_blocks == 8
    assert repr(scheduler) == "<Scheduler 0 waiting, 0 running, 0 in flight, 8/8 blocks free>"
    assert result.statuses == dict.fromkeys(range(3), RequestStatus.FINISHED)


def test_the_clock_stamps_the_request_timings() -> None:
    ticks = itertools.count(100)
    scheduler = Scheduler(config(pipeline_depth=1), clock=lambda: float(next(ticks)))
    tracked = request(1, 2, max_tokens=2, ignore_eos=True)
    drive(scheduler, [tracked])
    times = (
        tracked.first_scheduled_time,
        tracked.first_token_time,
        tracked.last_token_time,
        tracked.end_time,
    )
    # admitted, token 1 (step 0 applied), token 2 and the finish (step 1 applied)
    assert times == (100.0, 101.0, 102.0, 102.0)


def test_finish_and_cancel_stamp_the_clock_time() -> None:
    ticks = itertools.count(100)
    scheduler = Scheduler(config(pipeline_depth=1), clock=lambda: float(next(ticks)))
    finished = request(1, 2, max_tokens=5, ignore_eos=True)
    cancelled = request(2, 2, max_tokens=5, ignore_eos=True)
    scheduler.add_request(finished)
    scheduler.add_request(cancelled)
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.apply(SimulatedKV(8, 4).execute(plan))
    assert scheduler.finish_on_stop_string(1)
    assert scheduler.cancel(2)
    assert finished.first_token_time is not None
    assert finished.end_time is not None
    assert cancelled.end_time is not None
    assert finished.first_token_time < finished.end_time < cancelled.end_time


def test_a_plan_row_carries_what_the_runner_needs() -> None:
    scheduler = Scheduler(config(max_num_batched_tokens=8))
    chunked = request(1, 10, max_tokens=2)
    scheduler.add_request(chunked)
    plan = scheduler.schedule()
    assert plan is not None
    # The budget allows 8 of the 10 prompt tokens: a chunk that does not sample.
    assert plan.requests == (
        ScheduledRequest(
            request_id=1,
            start=0,
            token_ids=tuple(range(1, 9)),
            pending_input=False,
            sample=False,
            sample_index=0,
            num_prompt_tokens=10,
            block_table=(0, 1),
            params=chunked.params,
        ),
    )


def test_statistics_count_the_queues_the_pipeline_and_the_work() -> None:
    scheduler = Scheduler(config(max_num_seqs=2, enable_prefix_caching=False))
    kv = SimulatedKV(8, 4)
    for request_id in (1, 2, 3):
        scheduler.add_request(request(request_id, 4, max_tokens=4, ignore_eos=True))
    queued = scheduler.statistics()
    assert queued == SchedulerStatistics(
        num_waiting=3,
        num_running=0,
        num_ending=0,
        num_inflight_steps=0,
        num_free_blocks=8,
        num_cached_blocks=0,
        num_pinned_blocks=0,
        num_blocks=8,
        num_kv_cache_tokens=32,  # 8 blocks of 4
        num_steps_planned=0,
        num_steps=0,
        num_tokens_scheduled=0,
        num_tokens_generated=0,
        num_preemptions=0,
        num_prefix_cache_queries=0,
        num_prefix_cache_hits=0,
        num_spec_decode_drafts=0,
        num_spec_decode_draft_tokens=0,
        num_spec_decode_accepted_tokens=0,
    )
    assert not scheduler.is_idle()  # nothing in flight, but a queued request will need blocks
    first = scheduler.schedule()  # admits 1 and 2 (max_num_seqs=2): 4 positions, 1 block each
    second = scheduler.schedule()  # their pending inputs: 1 position and a second block each
    assert first is not None
    assert second is not None
    assert scheduler.statistics() == attrs.evolve(
        queued,
        num_waiting=1,
        num_running=2,
        num_inflight_steps=2,
        num_free_blocks=4,
        num_steps_planned=2,
        num_tokens_scheduled=10,
    )
    pool = scheduler.pool.statistics()
    shared = attrs.fields_dict(type(pool)).keys() & attrs.fields_dict(SchedulerStatistics).keys()
    # The counts taken from the pool keep its names (and its values).
    assert shared == {
        "num_blocks",
        "num_free_blocks",
        "num_cached_blocks",
        "num_prefix_cache_queries",
        "num_prefix_cache_hits",
    }
    assert all(getattr(pool, name) == getattr(scheduler.statistics(), name) for name in shared)
    outcomes = [kv.execute(first), kv.execute(second)]
    scheduler.cancel(2)  # both steps in flight use its blocks
    cancelled = scheduler.statistics()
    assert (cancelled.num_running, cancelled.num_ending, cancelled.num_free_blocks) == (1, 1, 4)
    scheduler.apply(outcomes[0])  # request 2's token is dropped
    assert scheduler.statistics() == attrs.evolve(
        cancelled, num_inflight_steps=1, num_steps=1, num_tokens_generated=1
    )
    scheduler.apply(outcomes[1])  # request 2's last step: its blocks come back, it is gone
    assert scheduler.statistics() == attrs.evolve(
        cancelled,
        num_ending=0,
        num_inflight_steps=0,
        num_free_blocks=6,
        num_steps=2,
        num_tokens_generated=2,
    )


def test_every_preemption_counts_and_the_runner_hears_of_each_ended_or_preempted_request() -> None:
    scheduler = Scheduler(config(num_blocks=4, block_size=2, max_model_len=7, pipeline_depth=1))
    kv = SimulatedKV(4, 2)
    for request_id in (1, 2, 3, 4):
        scheduler.add_request(
            Request(request_id, [request_id] * 2, SamplingParams(max_tokens=4), arrival_time=0)
        )
    scheduler.cancel(4)  # never planned: the runner never saw it, so nobody tells it
    steps = []
    while (plan := scheduler.schedule()) is not None:
        preemptions = scheduler.statistics().num_preemptions
        ended = (plan.finished_request_ids, plan.preempted_request_ids)
        steps.append((plan.request_ids, *ended, preemptions))
        scheduler.apply(kv.execute(plan))
    # Each plan names the requests preempted while it was planned (the runner drops what
    # it keeps for them outside the block tables) and those gone since the last plan.
    assert steps == [
        ((1, 2, 3), (), (), 0),
        ((1, 2), (), (3,), 1),  # 1 takes the last free block, 2 takes 3's
        ((1, 2), (), (), 1),
        ((1,), (), (2,), 2),  # 1 needs a third block: the newest running request (2) gives way
        ((2,), (1,), (), 2),  # 1 sampled its fourth and last token in the step before
        ((3,), (2,), (), 2),
        ((3,), (), (), 2),
        ((3,), (), (), 2),
    ]
    assert scheduler.statistics().num_preemptions == 2
    assert scheduler.is_idle()


def test_check_invariants_names_a_block_freed_under_a_step_in_flight() -> None:
    scheduler = Scheduler(config(pipeline_depth=1, enable_prefix_caching=False))
    scheduler.add_request(request(1))
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.requests[0].block_table == (0,)
    scheduler.cancel(1)  # step 0 still writes block 0: its release waits for the outcome
    scheduler.check_invariants()
    # The bug the rule is for: releasing at once. Every count still balances (no holder,
    # no reference), but the device is still writing into a block anyone may now take.
    scheduler.pool.release(scheduler._deferred.pop(0))
    with pytest.raises(AssertionError, match=r"^block 0 is free but step 0 in flight uses it$"):
        scheduler.check_invariants()


def test_check_invariants_names_a_queue_out_of_rank_order() -> None:
    scheduler = Scheduler(config())
    scheduler.add_request(request(1))
    scheduler.add_request(request(2))
    scheduler.check_invariants()
    scheduler._waiting.reverse()
    with pytest.raises(AssertionError, match=r"^a queue is out of rank order$"):
        scheduler.check_invariants()


def test_check_invariants_names_a_request_queued_twice() -> None:
    scheduler = Scheduler(config())
    scheduler.add_request(request(1))
    scheduler._waiting.append(scheduler._waiting[0])  # in order, the right status: only twice
    with pytest.raises(AssertionError, match=r"^a request is queued twice$"):
        scheduler.check_invariants()


def test_check_invariants_names_a_live_request_with_no_token_left_to_compute() -> None:
    scheduler = Scheduler(config())
    prefilling = request(1, 3)  # one block holds the whole prompt
    scheduler.add_request(prefilling)
    scheduler.schedule()
    scheduler.check_invariants()  # the prompt's chunk in flight: fine
    prefilling._num_computed_tokens = prefilling.num_tokens  # corrupt: nothing left
    with pytest.raises(AssertionError, match=r"^<Request 1 .*> has no token left to compute$"):
        scheduler.check_invariants()


def test_a_failed_request_records_the_message_and_the_clock_time() -> None:
    ticks = itertools.count(100)
    scheduler = Scheduler(config(pipeline_depth=1), clock=lambda: float(next(ticks)))
    failing = request(1)
    scheduler.add_request(failing)
    scheduler.schedule()  # admitted at 100
    scheduler.apply(StepFailure(0, "device lost"))  # applied at 101
    assert failing.status is RequestStatus.FAILED
    assert failing.failure == "device lost"
    assert (failing.first_scheduled_time, failing.end_time) == (100.0, 101.0)


def test_a_request_that_has_left_the_waiting_state_is_not_new_even_without_output() -> None:
    scheduler = Scheduler(config(max_num_batched_tokens=4))
    prefilling, cancelled = request(1, 10), request(2)
    scheduler.add_request(prefilling)
    scheduler.add_request(cancelled)
    scheduler.schedule()  # request 1 takes a 4-token chunk: prefilling, nothing sampled
    scheduler.cancel(2)
    for used in (prefilling, cancelled):
        assert used.num_generated_tokens == 0
        with pytest.raises(SchedulerError, match=rf"^request {used.request_id} is not new: "):
            Scheduler(config()).add_request(used)


def test_blocks_a_step_in_flight_returns_are_waited_for_not_taken_by_preemption() -> None:
    scheduler = Scheduler(config(num_blocks=4, block_size=2, max_model_len=8))
    kv = SimulatedKV(4, 2)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for request_id, prompt in ((1, [1, 2]), (2, [3, 4]), (3, [5, 6, 7])):
        scheduler.add_request(Request(request_id, prompt, params, arrival_time=0))
    first = scheduler.schedule()
    assert first is not None
    assert scheduler.pool.num_free == 0  # 1, 1 and 2 blocks
    outcomes = [kv.execute(first)]
    scheduler.cancel(2)  # its block comes back when step 0 completes
    # Request 1 needs one more block: exactly what step 0 returns, so it waits for it;
    # request 3's next position fits in its own second block.
    second = scheduler.schedule()
    assert second is not None
    assert second.request_ids == (3,)
    assert running_ids(scheduler) == (1, 3)
    scheduler.check_invariants()  # the queues themselves in that order
    outcomes.append(kv.execute(second))
    for outcome in outcomes:
        scheduler.apply(outcome)
    third = scheduler.schedule()
    assert third is not None
    assert third.request_ids == (1,)
    assert scheduler.statistics().num_preemptions == 0
