"""Cancellation, failure and death, in virtual time (trio MockClock + FakeDevice).

The fake device behaves like a GPU queue: a launch returns at once and its completion fires
``step_time`` virtual seconds after the device becomes free, so "a step is in flight" is a
real, controllable state here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from twostroke.engine import Engine, EngineDead, RequestCancelled, RequestFailed, SamplingParams
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.gpu.completion import Completion, Launched
from twostroke.gpu.fake import FakeDevice
from twostroke.states.plan import StepPlan

from .conftest import expected_tokens, toy_engine

pytestmark = pytest.mark.anyio
TOKENIZER = ByteTokenizer()
#: Virtual seconds per step: short, because the completion really polls (every poll is a
#: scheduler round trip even in virtual time) and its backoff is capped at 500 µs.
STEP = 0.001


@pytest.fixture
def anyio_backend() -> Any:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


async def test_timeout_cancels_the_request_and_frees_its_blocks() -> None:
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    async with toy_engine(device=FakeDevice(step_time=STEP)) as engine:
        with anyio.move_on_after(5.5 * STEP) as scope:
            await engine.generate(TOKENIZER.encode("time me out"), params)
        assert scope.cancelled_caught
        # The step in flight still owns the blocks; they come back when it completes.
        await engine.wait_idle()
        stats = engine.statistics()
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.num_tokens_generated <= 7
        assert (
            await engine.generate(TOKENIZER.encode("next"), SamplingParams(max_tokens=3))
        ).token_ids


@given(
    delay=st.floats(min_value=0, max_value=30, allow_nan=False).map(lambda d: d * STEP),
    victim=st.integers(min_value=0, max_value=5),
    depth=st.sampled_from([1, 2]),
)
async def test_cancelling_at_any_moment_loses_nothing(
    delay: float, victim: int, depth: int
) -> None:
    """Cancel one of six requests at a random virtual moment of its life."""
    prompts = [f"fuzz {i} " * (1 + i) for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outcomes: dict[int, Any] = {}
    async with toy_engine(
        device=FakeDevice(step_time=STEP),
        num_blocks=24,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        pipeline_depth=depth,
    ) as engine:

        async def run(index: int) -> None:
            handle = engine.submit(prompts[index], params)
            if index == victim:
                await anyio.sleep(delay)
                handle.cancel()
            try:
                outcomes[index] = await handle.result()
            except RequestCancelled as exc:
                outcomes[index] = exc

        async with anyio.create_task_group() as task_group:
            for index in range(len(prompts)):
                task_group.start_soon(run, index)
    for index, outcome in outcomes.items():
        if index == victim and isinstance(outcome, RequestCancelled):
            continue
        assert list(outcome.token_ids) == expected_tokens(prompts[index], params)


async def test_a_failing_step_fails_exactly_its_requests() -> None:
    failed_plan: list[StepPlan] = []

    def fail_when(plan: StepPlan) -> bool:
        if not failed_plan and 3 in plan.request_ids:
            failed_plan.append(plan)
            return True
        return False

    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outcomes: dict[int, Any] = {}
    async with toy_engine(
        runner=ToyRunner(fail_when=fail_when),
        device=FakeDevice(step_time=STEP),
        max_num_seqs=3,
    ) as engine:

        async def run(index: int) -> None:
            try:
                outcomes[index] = await engine.generate(TOKENIZER.encode(f"prompt {index}"), params)
            except RequestFailed as exc:
                outcomes[index] = exc

        async with anyio.create_task_group() as task_group:
            for index in range(6):
                task_group.start_soon(run, index)
                await anyio.sleep(0.5 * STEP)
    # By request id, which the engine gives in the order it queues requests, not the order
    # the tasks started in. Prompts are token ids throughout this module: text would
    # tokenize in a worker thread, while which the virtual clock jumps ahead.
    in_failed_step = set(failed_plan[0].request_ids)
    assert len(outcomes) == 6
    for index, outcome in outcomes.items():
        if outcome.request_id in in_failed_step:
            assert isinstance(outcome, RequestFailed), index
            assert isinstance(outcome.__cause__, RuntimeError)
            assert "injected failure" in str(outcome)
        else:
            assert list(outcome.token_ids) == expected_tokens(f"prompt {index}", params)


class DyingDevice(FakeDevice):
    """A device whose launch machinery itself breaks on the third step."""

    def __init__(self) -> None:
        super().__init__(step_time=STEP)
        self.launches = 0

    async def run(self, work: Callable[[], Launched[Any]], completion: Completion[Any]) -> None:
        self.launches += 1
        if self.launches == 3:
            raise OSError("device lost")
        await super().run(work, completion)


async def test_a_dead_stroke_fails_every_waiter_and_the_block_raises() -> None:
    errors: list[tuple[float, BaseException]] = []
    died_at: list[float] = []
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def waiter(handle: Any) -> None:
        try:
            await handle.result()
        except EngineDead as exc:
            errors.append((anyio.current_time(), exc))

    async with anyio.create_task_group() as outside:
        with pytest.raises(EngineDead, match="device lost") as raised:
            async with Engine.open(
                runner=ToyRunner(), tokenizer=TOKENIZER, device=DyingDevice(), num_blocks=64
            ) as engine:
                for index in range(3):
                    outside.start_soon(waiter, engine.submit(f"w{index}", params))
                try:
                    await engine.generate(TOKENIZER.encode("body"), params)
                finally:
                    died_at.append(anyio.current_time())
    assert isinstance(raised.value.__cause__, OSError)
    assert len(errors) == 3
    for when, error in errors:
        assert when == died_at[0]
        assert isinstance(error.__cause__, OSError)


async def test_public_calls_are_checkpoints() -> None:
    async with toy_engine(device=FakeDevice(step_time=STEP)) as engine:
        with trio.testing.assert_checkpoints():
            await engine.wait_idle()
        handle = engine.submit("x", SamplingParams(max_tokens=2))
        await handle.result()
        with trio.testing.assert_checkpoints():
            await handle.result()


async def test_lookahead_keeps_the_device_busy() -> None:
    """With depth 2 the next plan is queued before a step ends: no bubbles in virtual time."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    timings: dict[int, float] = {}
    for depth in (1, 2):
        async with toy_engine(device=FakeDevice(step_time=STEP), pipeline_depth=depth) as engine:
            start = trio.current_time()
            await engine.generate(TOKENIZER.encode("busy"), params)
            timings[depth] = trio.current_time() - start
    assert timings[2] == pytest.approx(20 * STEP, rel=0.05)
    assert timings[1] >= timings[2]
