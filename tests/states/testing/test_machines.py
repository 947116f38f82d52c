"""The public test toolkit: its strategies draw what they promise, and its checks can fail."""

from __future__ import annotations

import itertools
import re

import attrs
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from twostroke.states import request as request_module
from twostroke.states.constraints import Choice
from twostroke.states.errors import RequestRejected
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, StepPlan, StepReport
from twostroke.states.request import ConstraintCompiled, Request, RequestStatus
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.testing import (
    ReferenceMatcher,
    RequestMachine,
    RequestSpec,
    SchedulerMachine,
    SimulatedEngine,
    SimulatedKV,
    SimulationError,
    Workload,
    drive,
    request_specs,
    requests,
    scheduler_configs,
    step_bound,
    toy_next_token,
    waiting_ids,
    workloads,
)

# Meta tests look for a planted bug: generate only, no shrinking, no example database.
FIND = settings(
    max_examples=200,
    stateful_step_count=30,
    phases=[Phase.generate],
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)

CONFIG = SchedulerConfig(
    num_blocks=6, block_size=2, max_num_batched_tokens=8, max_num_seqs=3, max_model_len=13
)


# --- strategies -----------------------------------------------------------------------------


@given(scheduler_configs())
def test_configs_are_small_and_valid(config: SchedulerConfig) -> None:
    assert 2 <= config.num_blocks <= 12
    assert 1 <= config.block_size <= 4
    assert 2 <= config.max_model_len <= config.num_blocks * config.block_size + 1
    assert config.pipeline_depth in (1, 2)


@given(st.data())
def test_requests_drawn_for_a_config_are_accepted(data: st.DataObject) -> None:
    config = data.draw(scheduler_configs())
    request = data.draw(requests(config, request_id=5))
    assert request.request_id == 5
    assert request.status is RequestStatus.WAITING
    scheduler = Scheduler(config)
    scheduler.add_request(request)
    assert waiting_ids(scheduler) == (5,)


@given(st.data())
def test_fits_predicts_rejection(data: st.DataObject) -> None:
    config = data.draw(scheduler_configs())
    spec = data.draw(request_specs(max_prompt_tokens=40, max_tokens=20))
    try:
        Scheduler(config).add_request(spec.build(1))
    except RequestRejected:
        assert not spec.fits(config)
    else:
        assert spec.fits(config)


@given(st.data())
def test_workloads_arrive_in_order(data: st.DataObject) -> None:
    workload = data.draw(workloads(CONFIG, max_requests=5, max_gap=2))
    assert 1 <= len(workload.requests) <= 5
    assert workload.arrivals[0] == 0
    assert all(0 <= b - a <= 2 for a, b in itertools.pairwise(workload.arrivals))
    built = workload.build()
    assert [request.request_id for _, request in built] == list(range(len(built)))
    assert all(spec.fits(CONFIG) for spec in workload.requests)


@pytest.mark.parametrize(
    ("arrivals", "message"),
    [
        ((0,), "arrivals must have one entry per request (2), got 1"),
        ((0, -1), "arrivals must be >= 0, got (0, -1)"),
        ((2, 1), "arrivals must not decrease, got (2, 1)"),
    ],
)
def test_workload_arrivals_are_validated(arrivals: tuple[int, ...], message: str) -> None:
    spec = RequestSpec([1])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Workload(requests=[spec, spec], arrivals=arrivals)


# --- drive ----------------------------------------------------------------------------------


def test_drive_serves_a_workload_and_reports_it() -> None:
    specs = [RequestSpec([3, 1, 4], SamplingParams(max_tokens=5, ignore_eos=True))] * 3
    result = drive(Scheduler(CONFIG), Workload(requests=specs, arrivals=[0, 0, 4]))
    assert set(result.outputs) == {0, 1, 2}
    assert all(len(tokens) == 5 for tokens in result.outputs.values())
    assert result.statuses == dict.fromkeys(range(3), RequestStatus.FINISHED)
    assert 0 < result.num_steps <= result.max_steps
    assert result.statistics.num_free_blocks == CONFIG.num_blocks


def test_step_bound_counts_only_live_requests() -> None:
    live = Request(1, [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0)
    assert step_bound(CONFIG, [live]) == 2 + 3 * 5 + 4 * 2 + 4
    assert step_bound(CONFIG, []) == CONFIG.pipeline_depth


def test_drive_fails_a_scheduler_that_starves() -> None:
    specs = [RequestSpec([1] * 6, SamplingParams(max_tokens=6, ignore_eos=True))] * 3
    with pytest.raises(SimulationError, match=r"^not idle after 2 steps \(the bound\)"):
        drive(Scheduler(CONFIG), specs_workload(specs), max_steps=2)


def specs_workload(specs: list[RequestSpec]) -> Workload:
    return Workload(requests=specs)


class SwapsBlockTables(Scheduler):
    """Plans the first request of each multi-request step on the second one's blocks."""

    def schedule(self) -> StepPlan | None:
        plan = super().schedule()
        if plan is None or len(plan.requests) < 2:
            return plan
        first, second, *rest = plan.requests
        swapped = attrs.evolve(first, block_table=second.block_table)
        return StepPlan(plan.step_id, (swapped, second, *rest), plan.finished_request_ids)


class LeaksABlock(Scheduler):
    """Takes a free block out of the pool after a step completes, and never returns it."""

    leaked = False

    def apply(self, outcome: object) -> StepReport:
        report = super().apply(outcome)  # type: ignore[arg-type]
        if not self.leaked and self.pool.num_free:
            self.pool.allocate(1)
            self.leaked = True
        return report


class CorruptsTokens(Scheduler):
    """Applies a different token than the device sampled."""

    def apply(self, outcome: object) -> StepReport:
        if isinstance(outcome, RunnerOutput):
            sampled = {r: t + 1 for r, t in outcome.sampled.items()}
            outcome = RunnerOutput(outcome.step_id, sampled)
        return super().apply(outcome)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (
            SwapsBlockTables,
            r"reads position \d+ .* (last written by|writes in the same step)|produced|held for",
        ),
        (LeaksABlock, r"references but 0 holders|blocks not conserved|are not free after"),
        (CorruptsTokens, r"request \d+ produced"),
    ],
)
def test_drive_catches_a_broken_scheduler(broken: type[Scheduler], message: str) -> None:
    specs = [RequestSpec([2, 7, 1, 8], SamplingParams(max_tokens=4, ignore_eos=True))] * 2
    # SimulationError, or the scheduler's own check_invariants (both AssertionError).
    with pytest.raises(AssertionError, match=message):
        drive(broken(CONFIG), specs_workload(specs))


def test_the_simulated_device_refuses_a_pending_input_without_a_sample() -> None:
    scheduler = Scheduler(CONFIG)
    scheduler.add_request(RequestSpec([1, 2], SamplingParams(max_tokens=4)).build(1))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert first is not None
    assert second is not None
    with pytest.raises(SimulationError, match="has a pending input but the previous step"):
        SimulatedKV(6, 2).execute(second)


def test_toy_next_token_depends_on_every_position() -> None:
    base = [5, 9, 2, 7]
    for position in range(len(base)):
        changed = [*base]
        changed[position] += 1
        assert toy_next_token(changed) != toy_next_token(base) or position == -1
    assert 0 <= toy_next_token(base) < 64


# --- the machines can fail --------------------------------------------------------------------


def test_the_scheduler_machine_finds_a_broken_scheduler() -> None:
    class Leaky(SchedulerMachine.for_config(st.just(CONFIG))):  # type: ignore[misc]
        scheduler_class = LeaksABlock

    # Whichever block-accounting check sees the leak first: conservation, or the release of
    # an ended request's blocks.
    leak = "references but 0 holders|blocks not conserved|are not free after step"
    with pytest.raises(AssertionError, match=leak):
        run_state_machine_as_test(Leaky, settings=FIND)


def test_the_request_machine_finds_a_table_that_disagrees() -> None:
    table = {status: dict(row) for status, row in RequestMachine.reference_transitions.items()}
    del table[RequestStatus.WAITING][next(iter(table[RequestStatus.WAITING]))]

    class Wrong(RequestMachine):
        reference_transitions = table

    with pytest.raises(SimulationError):
        run_state_machine_as_test(Wrong, settings=FIND)


def test_the_request_machine_finds_a_request_that_ignores_its_constraint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request whose ``apply`` does not consult its matcher: every token is output."""
    monkeypatch.setattr(request_module, "_advance", lambda matcher, token_id: (None, False))
    with pytest.raises(SimulationError):
        run_state_machine_as_test(RequestMachine, settings=FIND)


def test_the_simulated_engine_looks_ahead_only_with_a_reference_matcher() -> None:
    spec = RequestSpec([1, 2], SamplingParams(max_tokens=4, constraint=Choice(["ab"])))
    request = spec.build(0, compiled=False)
    reference = spec.build(1)
    assert isinstance(reference.matcher, ReferenceMatcher)
    request.apply(ConstraintCompiled(_Wrapped(reference.matcher)))
    engine = SimulatedEngine(Scheduler(CONFIG))
    engine.submit(request)
    message = "the simulated engine looks ahead with a ReferenceMatcher, got _Wrapped for request 0"
    with pytest.raises(TypeError, match=f"^{message}$"):
        engine.plan()


class _Wrapped:
    """Another kind of matcher, which the simulation cannot copy to look ahead."""

    def __init__(self, inner: ReferenceMatcher) -> None:
        self._inner = inner
        self.vocab_size = inner.vocab_size
        self.num_tokens = inner.num_tokens
        self.accepting = inner.accepting
        self.terminated = inner.terminated

    def advance(self, token_id: int) -> bool:
        return self._inner.advance(token_id)

    def allowed_token_ids(self) -> frozenset[int]:
        return self._inner.allowed_token_ids()

    def fill_bitmask(self, row: memoryview) -> None:
        self._inner.fill_bitmask(row)

    def fork(self) -> ReferenceMatcher:
        return self._inner.fork()


def test_for_config_accepts_a_fixed_config() -> None:
    machine = SchedulerMachine.for_config(CONFIG)
    assert issubclass(machine, SchedulerMachine)
    run_state_machine_as_test(machine, settings=settings(FIND, max_examples=5))
