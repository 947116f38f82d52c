"""A failing step fails exactly its own requests, at depth 1 and 2, and the engine keeps serving.

With the one-step lookahead the plan of step N+1 is already made when step N fails, and its
rows for step N's requests may take their input from samples step N never produced. The
forward stroke drops those rows; every other row of step N+1 runs as planned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twostroke.engine import (
    Engine,
    RequestCancelled,
    RequestFailed,
    RequestHandle,
    RequestOutput,
    SamplingParams,
)
from twostroke.engine.runners.toy import ToyRunner
from twostroke.gpu.fake import FakeDevice
from twostroke.states.plan import StepPlan

from .conftest import expected_tokens, toy_engine

pytestmark = pytest.mark.anyio


class Injector:
    """Fails every step that contains a victim, from the victims' ``after``-th step on."""

    def __init__(self, victims: set[int], *, after: int = 0) -> None:
        self.victims = victims
        self.after = after
        self.failed_plans: list[StepPlan] = []

    def __call__(self, plan: StepPlan) -> bool:
        if self.victims & set(plan.request_ids):
            if self.after:
                self.after -= 1
                return False
            self.failed_plans.append(plan)
            return True
        return False

    @property
    def failed_ids(self) -> set[int]:
        return {rid for plan in self.failed_plans for rid in plan.request_ids}


async def _collect(handle: RequestHandle, outcomes: dict[int, Any]) -> None:
    try:
        outcomes[handle.request_id] = await handle.result()
    except (RequestFailed, RequestCancelled) as exc:
        outcomes[handle.request_id] = exc


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_streaming_victim_among_steady_arrivals_fails_alone(depth: int) -> None:
    """The reported defect: a failure must not cascade into the step planned after it."""
    injector = Injector(victims={0}, after=6)
    long_params = SamplingParams(max_tokens=40, ignore_eos=True)
    short_params = SamplingParams(max_tokens=4, ignore_eos=True)
    outcomes: dict[int, Any] = {}
    prompts: dict[int, tuple[str, SamplingParams]] = {}
    async with toy_engine(
        runner=ToyRunner(fail_when=injector),
        device=FakeDevice(step_time=0.0),
        pipeline_depth=depth,
        max_num_seqs=8,
    ) as engine:
        async with anyio.create_task_group() as task_group:
            async with engine.stream("the victim streams", long_params) as victim:
                prompts[victim.request_id] = ("the victim streams", long_params)
                with pytest.raises(RequestFailed, match="injected failure") as raised:
                    async for delta in victim:
                        # a short request arrives with every delta the victim receives
                        prompt = f"short {len(prompts)}"
                        handle = engine.submit(prompt, short_params)
                        prompts[handle.request_id] = (prompt, short_params)
                        task_group.start_soon(_collect, handle, outcomes)
                        assert delta.token_ids
                assert isinstance(raised.value.__cause__, RuntimeError)
            for index in range(6):  # and keep arriving after the failure
                prompt = f"after {index}"
                handle = engine.submit(prompt, short_params)
                prompts[handle.request_id] = (prompt, short_params)
                task_group.start_soon(_collect, handle, outcomes)
                await anyio.lowlevel.checkpoint()
        stats = engine.statistics()
    assert stats.num_failed_steps == len(injector.failed_plans) == 1
    failed_ids = injector.failed_ids
    for request_id, outcome in outcomes.items():
        if isinstance(outcome, RequestFailed):
            assert request_id in failed_ids, (request_id, outcome)
        else:
            prompt, params = prompts[request_id]
            assert isinstance(outcome, RequestOutput), outcome
            assert list(outcome.token_ids) == expected_tokens(prompt, params)
    assert len(outcomes) >= 8


#: One request a test may submit: its prompt and its parameters.
REQUESTS = st.tuples(
    st.sampled_from(["a", "bb", "a longer prompt here"]),
    st.builds(
        SamplingParams,
        max_tokens=st.integers(1, 12),
        ignore_eos=st.booleans(),
    ),
)
#: What happens at one launch: requests arriving, a live request cancelled (by its rank
#: among the live ones), and whether this step fails.
STEP_EVENTS = st.tuples(
    st.integers(0, 2),
    st.none() | st.integers(0, 7),
    st.integers(0, 4).map(lambda n: n == 0),
)


@settings(max_examples=30)
@given(
    requests=st.lists(REQUESTS, min_size=1, max_size=10),
    initial=st.integers(1, 3),
    steps=st.lists(STEP_EVENTS, max_size=40),
    depth=st.sampled_from([1, 2]),
)
async def test_random_failures_arrivals_and_cancels_lose_nothing(
    requests: list[tuple[str, SamplingParams]],
    initial: int,
    steps: list[tuple[int, int | None, bool]],
    depth: int,
) -> None:
    """Hypothesis decides what arrives, what is cancelled and what fails, step by step.

    The decisions are applied at each launch, on the loop thread between two steps, like the
    rules of a stateful machine firing between steps. After every step the engine's and the
    scheduler's invariants hold; at the end every request that got ``RequestFailed`` was in
    a failed step, every finished one equals its output alone, the engine counted exactly
    the injected failures, and every block is free (``toy_engine`` checks that when its
    block ends).
    """
    engines: list[Engine] = []
    pending = list(requests)
    events = list(steps)
    failed_plans: list[StepPlan] = []
    handles: dict[int, RequestHandle] = {}
    prompts: dict[int, tuple[str, SamplingParams]] = {}
    outcomes: dict[int, Any] = {}

    def submit(task_group: anyio.abc.TaskGroup) -> None:
        prompt, params = pending.pop(0)
        prompt = f"{prompt} {len(handles)}"
        handle = engines[0].submit(prompt, params)
        handles[handle.request_id] = handle
        prompts[handle.request_id] = (prompt, params)
        task_group.start_soon(_collect, handle, outcomes)

    def between_steps(task_group: anyio.abc.TaskGroup) -> Callable[[StepPlan], bool]:
        def fail_when(plan: StepPlan) -> bool:
            engines[0].check_invariants()
            if not events:
                return False
            arrivals, cancel, fail = events.pop(0)
            for _ in range(min(arrivals, len(pending))):
                submit(task_group)
            live = sorted(rid for rid, handle in handles.items() if not handle.done())
            if live and cancel is not None:
                handles[live[cancel % len(live)]].cancel()
            if fail:
                failed_plans.append(plan)
            return fail

        return fail_when

    async with anyio.create_task_group() as task_group:
        async with toy_engine(
            runner=ToyRunner(fail_when=between_steps(task_group)),
            device=FakeDevice(step_time=0.0),
            pipeline_depth=depth,
            num_blocks=12,
            block_size=4,
            max_num_batched_tokens=16,
            max_num_seqs=4,
        ) as engine:
            engines.append(engine)
            for _ in range(min(initial, len(pending))):
                submit(task_group)
            await engine.wait_idle()
            stats = engine.statistics()

    assert stats.num_failed_steps == len(failed_plans)
    failed_ids = {rid for plan in failed_plans for rid in plan.request_ids}
    assert set(outcomes) == set(handles)
    for request_id, outcome in outcomes.items():
        if isinstance(outcome, RequestFailed):
            assert request_id in failed_ids, (request_id, outcome)
        elif isinstance(outcome, RequestOutput):
            prompt, params = prompts[request_id]
            assert list(outcome.token_ids) == expected_tokens(prompt, params)
        else:
            assert isinstance(outcome, RequestCancelled)


class _ArmedRunner:
    """A torch runner whose model raises inside the forward of the steps ``fail_when`` picks.

    The failure happens inside :class:`TorchModelRunner` (a forward pre-hook on the model),
    so its own recovery path runs, not only the engine's.
    """

    def __init__(self, inner: Any, fail_when: Callable[[StepPlan], bool]) -> None:
        self._inner = inner
        self._fail_when = fail_when
        self._armed = False
        inner.model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: object) -> None:
        if self._armed:
            self._armed = False
            raise RuntimeError("injected failure inside the model's forward")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute(self, plan: StepPlan) -> Any:
        self._armed = self._fail_when(plan)
        return self._inner.execute(plan)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_two_failures_on_smollm2_fail_exactly_their_requests() -> None:
    from twostroke.engine.config import EngineConfig
    from twostroke.engine.runners.loading import load_runner
    from twostroke.gpu.device import CpuDevice

    # Two requests run at a time: requests 0-1, 2-3 and 4-5 form three waves, and the
    # failures of requests 1 and 4 take their waves with them (every request of a failed
    # step fails); wave 2-3 runs between the failures and must come out untouched.
    config = EngineConfig(
        dtype="float32", num_blocks=128, max_num_batched_tokens=64, max_num_seqs=2
    )
    device = CpuDevice()
    inner, tokenizer = load_runner("smollm2", device=device, config=config)
    # Requests 1 and 4 each fail on their fourth step: both are decoding by then, so the
    # step planned after each failure carries their lookahead rows (dropped by the engine).
    injector = Injector(victims={1}, after=3)
    second = Injector(victims={4}, after=3)
    runner = _ArmedRunner(inner, lambda plan: injector(plan) or second(plan))
    prompts = [
        "The capital of France is",
        "List three colours:",
        "Water boils at",
        "One, two, three,",
        "The opposite of hot is",
        "A haiku about the sea:",
    ]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outcomes: dict[int, Any] = {}
    async with Engine.open(
        runner=runner,
        tokenizer=tokenizer,
        device=device,
        pipeline_depth=2,
        **{
            name: getattr(config, name)
            for name in ("dtype", "num_blocks", "max_num_batched_tokens", "max_num_seqs")
        },
    ) as engine:
        async with anyio.create_task_group() as task_group:
            for prompt in prompts:
                task_group.start_soon(_collect, engine.submit(prompt, params), outcomes)
                await anyio.lowlevel.checkpoint()
        stats = engine.statistics()
        alone = [(await engine.generate(prompt, params)).token_ids for prompt in prompts]
        await engine.wait_idle()
        after = engine.statistics()
    assert stats.num_failed_steps == 2
    failed_ids = injector.failed_ids | second.failed_ids
    assert failed_ids == {0, 1, 4, 5}
    for request_id, outcome in outcomes.items():
        if request_id in failed_ids:
            assert isinstance(outcome, RequestFailed), (request_id, outcome)
            assert "injected failure inside the model" in str(outcome)
        else:
            assert isinstance(outcome, RequestOutput), (request_id, outcome)
            assert outcome.token_ids == alone[request_id]
    assert after.num_free_blocks == after.num_blocks
