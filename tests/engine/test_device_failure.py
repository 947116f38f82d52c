"""A device that is gone kills the engine; a step that fails on its own fails only its requests.

In virtual time (trio MockClock + FakeDevice). A lost CUDA context (after an illegal address,
a device-side assert, a launch failure) makes every later call fail: without telling that
from the failure of one step, the engine turns into a zombie that accepts requests only to
fail them, with ``check_health()`` green. After a failed step the engine probes the device;
a failed probe, or a step past ``step_timeout``, kills it: every open waiter gets
``EngineDead`` chained to the cause, the ``async with`` block raises it, nothing more is taken.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
import trio.testing

from twostroke.engine import (
    Engine,
    EngineDead,
    RequestFailed,
    RequestHandle,
    RequestOutput,
    SamplingParams,
)
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.gpu.fake import LOST_CONTEXT, FakeDevice
from twostroke.states.plan import StepPlan

from .conftest import expected_tokens

pytestmark = pytest.mark.anyio
#: Prompts are given as its token ids where they are awaited (``generate``): text would
#: tokenize in a worker thread, and the virtual clock jumps ahead while a thread runs.
TOKENIZER = ByteTokenizer()
STEP = 0.001
PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> Any:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


class ProbedDevice(FakeDevice):
    """A fake GPU that counts the engine's probes, and says whether it was abandoned."""

    def __init__(self, step_time: Any = STEP) -> None:
        super().__init__(step_time=step_time)
        self.probes = 0
        self.abandoned = False

    def abandon(self) -> None:
        self.abandoned = True

    async def probe(self) -> None:
        self.probes += 1
        await super().probe()


async def _outcome(handle: RequestHandle, outcomes: dict[int, Any]) -> None:
    try:
        outcomes[handle.request_id] = await handle.result()
    except (EngineDead, RequestFailed) as exc:
        outcomes[handle.request_id] = exc


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_lost_context_kills_the_engine_and_every_waiter_learns_why(depth: int) -> None:
    device = ProbedDevice()

    class Runner(ToyRunner):
        def execute(self, plan: StepPlan) -> Any:
            if plan.step_id == 5:  # a kernel of step 5 touches an illegal address
                device.lose_context()
                raise RuntimeError(LOST_CONTEXT)
            return super().execute(plan)

    outcomes: dict[int, Any] = {}
    engines: list[Engine] = []
    async with anyio.create_task_group() as outside:
        with pytest.raises(EngineDead, match="illegal memory access") as raised:
            async with Engine.open(
                runner=Runner(),
                tokenizer=TOKENIZER,
                device=device,
                num_blocks=64,
                block_size=4,
                pipeline_depth=depth,
            ) as engine:
                engines.append(engine)
                for index in range(6):
                    outside.start_soon(_outcome, engine.submit(f"r{index}", PARAMS), outcomes)
                # A request that keeps arriving after the device died is refused, not failed.
                for _ in range(200):
                    await anyio.sleep(STEP)
                    engine.submit("late", PARAMS)
                pytest.fail("a zombie: the engine took requests long after its device died")
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert "failed a probe" in "".join(raised.value.__cause__.__notes__)
    assert device.probes == 1
    assert not device.abandoned  # a lost context answers at once: nothing to give up
    assert sorted(outcomes) == list(range(6))
    for outcome in outcomes.values():
        assert isinstance(outcome, EngineDead), outcome
        assert outcome.__cause__ is raised.value.__cause__
    engine = engines[0]
    with pytest.raises(EngineDead, match="illegal memory access"):
        engine.check_health()
    with pytest.raises(EngineDead):
        engine.submit("after", PARAMS)
    assert engine.statistics().num_failed_steps == 0  # died of it: not a failed step


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("step 3: a plan the runner cannot run"),
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
    ids=["runner-error", "out-of-memory"],
)
async def test_a_step_that_fails_on_a_live_device_fails_only_its_requests(
    error: Exception,
) -> None:
    """The probe passes (or, out of memory, is not even run): the engine serves on."""
    device = ProbedDevice()
    failed: list[StepPlan] = []

    class Runner(ToyRunner):
        def execute(self, plan: StepPlan) -> Any:
            if plan.step_id == 3:
                failed.append(plan)
                raise error
            return super().execute(plan)

    outcomes: dict[int, Any] = {}
    async with Engine.open(
        runner=Runner(), tokenizer=TOKENIZER, device=device, num_blocks=64, block_size=4
    ) as engine:
        async with anyio.create_task_group() as task_group:
            for index in range(4):
                task_group.start_soon(_outcome, engine.submit(f"r{index}", PARAMS), outcomes)
                await anyio.sleep(STEP)
        engine.check_health()
        after = await engine.generate(TOKENIZER.encode("after"), PARAMS)
        stats = engine.statistics()
    assert list(after.token_ids) == expected_tokens("after", PARAMS)
    assert stats.num_failed_steps == 1
    assert device.probes == (0 if isinstance(error, MemoryError | torch.OutOfMemoryError) else 1)
    for request_id, outcome in outcomes.items():
        if request_id in failed[0].request_ids:
            assert isinstance(outcome, RequestFailed)
            assert outcome.__cause__ is error
        else:
            assert isinstance(outcome, RequestOutput)


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_step_that_never_completes_kills_the_engine_at_the_deadline(depth: int) -> None:
    """Step 4 takes a virtual eternity; with ``step_timeout`` the engine dies, not hangs."""
    steps = iter(range(10**6))
    device = ProbedDevice(step_time=lambda: 1e9 if next(steps) == 4 else STEP)
    outcomes: dict[int, Any] = {}
    # Virtual time (40 step timeouts): without the deadline, the test fails rather than hangs.
    with anyio.fail_after(2.0):
        async with anyio.create_task_group() as outside:
            with pytest.raises(EngineDead, match="did not complete") as raised:
                async with Engine.open(
                    runner=ToyRunner(),
                    tokenizer=TOKENIZER,
                    device=device,
                    num_blocks=64,
                    block_size=4,
                    pipeline_depth=depth,
                    step_timeout=0.05,
                ) as engine:
                    for index in range(3):
                        handle = engine.submit(f"r{index}", PARAMS)
                        outside.start_soon(_outcome, handle, outcomes)
                    await engine.generate(TOKENIZER.encode("body"), PARAMS)
    assert isinstance(raised.value.__cause__, TimeoutError)
    assert "step 4 did not complete" in str(raised.value.__cause__)
    # The deadline counts from when the engine starts waiting for the step.
    assert anyio.current_time() < 4 * STEP + 0.05 + 2 * STEP
    assert len(outcomes) == 3
    assert all(isinstance(outcome, EngineDead) for outcome in outcomes.values())
    # The step may hold the device's thread forever: leaving the block must not wait for it.
    assert device.abandoned
    assert device.probes == 0


async def test_a_probe_past_the_deadline_counts_as_a_hung_device() -> None:
    class HangingProbe(ProbedDevice):
        async def probe(self) -> None:
            self.probes += 1
            await anyio.sleep_forever()

    device = HangingProbe()
    runner = ToyRunner(fail_when=lambda plan: plan.step_id == 2)
    with anyio.fail_after(20.0), pytest.raises(EngineDead, match="failure in step 2") as raised:
        async with Engine.open(
            runner=runner,
            tokenizer=TOKENIZER,
            device=device,
            num_blocks=64,
            block_size=4,
            step_timeout=1.0,
        ) as engine:
            await engine.generate(TOKENIZER.encode("body"), PARAMS)
    assert device.probes == 1
    assert device.abandoned
    notes = "".join(raised.value.__cause__.__notes__)  # type: ignore[union-attr]
    assert "failed a probe" in notes
    assert "TimeoutError" in notes


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "step_timeout must be > 0, got 0"),
        (-1.5, ValueError, "step_timeout must be > 0, got -1.5"),
        ("5", TypeError, "step_timeout must be a number, got str '5'"),
    ],
)
def test_step_timeout_is_a_positive_number_or_none(
    value: object, error: type[Exception], message: str
) -> None:
    from twostroke.engine import EngineConfig

    assert EngineConfig().step_timeout is None
    assert EngineConfig(step_timeout=2).step_timeout == 2
    with pytest.raises(error) as raised:
        EngineConfig(step_timeout=value)  # type: ignore[arg-type]
    assert str(raised.value) == message
