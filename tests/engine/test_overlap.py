"""The one-step lookahead: identical output at depth 1 and 2, at most one wasted token."""

from __future__ import annotations

import collections
import threading
import types
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import pytest

from twostroke.engine import Engine, SamplingParams
from twostroke.engine import engine as engine_module
from twostroke.engine.runners.toy import ToyRunner
from twostroke.engine.strokes import launcher
from twostroke.engine.strokes.launcher import LaunchTimer
from twostroke.gpu.completion import Launched
from twostroke.states.plan import RunnerOutput, StepPlan

from .conftest import toy_engine

# A bound for the thread handshakes below, only reached if the code under test is broken.
DEADLOCK = 10.0

pytestmark = pytest.mark.anyio


class RecordingRunner(ToyRunner):
    """The toy runner, remembering every plan it executed."""

    def __init__(self) -> None:
        super().__init__(eos_rate=0.05)
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> Launched[RunnerOutput]:
        self.plans.append(plan)
        return super().execute(plan)


async def test_a_finished_request_wastes_at_most_one_token() -> None:
    runner = RecordingRunner()
    outputs: dict[int, Any] = {}
    async with toy_engine(runner=runner, num_blocks=128) as engine:

        async def run(index: int) -> None:
            output = await engine.generate(f"waste {index}", SamplingParams(max_tokens=40))
            outputs[output.request_id] = output

        async with anyio.create_task_group() as task_group:
            for index in range(12):
                task_group.start_soon(run, index)
    samples = collections.Counter(
        entry.request_id for plan in runner.plans for entry in plan.requests if entry.sample
    )
    assert any(o.finish_reason.value == "stop" for o in outputs.values())
    for request_id, output in outputs.items():
        wasted = samples[request_id] - len(output.token_ids)
        assert 0 <= wasted <= 1, (request_id, wasted)
        if output.finish_reason.value == "length":
            assert wasted == 0  # the scheduler knows a length limit in advance


@pytest.mark.slow
# Two engines on SmolLM2, 12 requests of 16 tokens (24 took 32 s on each backend in make
# test on a 2-core AVX2 machine with another job busy, the suite's fourth-longest): the
# timeout keeps four times that. The model's path on one backend: both run the toy's.
@pytest.mark.timeout(160)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_depth_one_and_two_give_identical_tokens_on_the_real_model() -> None:
    prompts = [
        [{"role": "user", "content": "Name three colours."}],
        [{"role": "user", "content": "What is 2 + 2?"}],
        "The quick brown fox",
        "Once upon a time, in a land far away,",
    ]
    kinds = [
        SamplingParams(max_tokens=16, temperature=0),
        SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=11, presence_penalty=0.5),
    ]
    results: dict[int, list[tuple[int, ...]]] = {}
    for depth in (1, 2):
        async with Engine.open(
            "smollm2",
            device="cpu",
            dtype="float32",
            pipeline_depth=depth,
            num_blocks=256,
            max_num_batched_tokens=32,  # forces chunked prefill and mixed steps
            torch_threads=1,  # a shared 2-core machine: a second thread waits on a busy core
        ) as engine:
            outputs: dict[tuple[int, int], tuple[int, ...]] = {}

            async def run(
                p: int, k: int, engine: Engine = engine, outputs: dict[Any, Any] = outputs
            ) -> None:
                outputs[p, k] = (await engine.generate(prompts[p], kinds[k])).token_ids

            async with anyio.create_task_group() as task_group:
                for p in range(len(prompts)):
                    for k in range(len(kinds)):
                        task_group.start_soon(run, p, k)
        results[depth] = [outputs[key] for key in sorted(outputs)]
    assert results[1] == results[2]
    assert all(len(tokens) > 0 for tokens in results[2])


class GatedRunner(ToyRunner):
    """The toy runner; step 0 waits for ``release`` and every step start is signalled."""

    def __init__(self) -> None:
        super().__init__(eos_rate=0.0)
        self.release = threading.Event()
        self.started: list[threading.Event] = [threading.Event() for _ in range(8)]
        self.steps = 0

    def execute(self, plan: StepPlan) -> Launched[RunnerOutput]:
        step, self.steps = self.steps, self.steps + 1
        if step < len(self.started):
            self.started[step].set()
        if step == 0:
            assert self.release.wait(DEADLOCK)
        return super().execute(plan)


async def test_at_depth_2_the_cpu_starts_the_next_step_without_the_event_loop() -> None:
    # Step 1 is planned while step 0 runs. The loop thread then blocks (synchronously) from
    # the release of step 0 until step 1 has started: if the device needed the loop to hand
    # step 1 over, this would deadlock.
    runner = GatedRunner()
    async with (
        toy_engine(runner=runner, pipeline_depth=2) as engine,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(engine.generate, "overlap", SamplingParams(max_tokens=6, ignore_eos=True))
        assert await anyio.to_thread.run_sync(runner.started[0].wait, DEADLOCK)
        await anyio.wait_all_tasks_blocked()  # step 1 is planned and queued by now
        runner.release.set()
        assert runner.started[1].wait(DEADLOCK)  # the loop is held here
    stats = engine.statistics()
    assert stats.forward_seconds > 0
    assert stats.forward_idle_seconds >= 0


class ClockedRunner(ToyRunner):
    """The toy runner on a fake clock: a launch takes 10 s, reading a result back 1 s."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__(eos_rate=0.0)
        self.clock = clock

    def execute(self, plan: StepPlan) -> Launched[RunnerOutput]:
        self.clock[0] += 10.0
        launched = super().execute(plan)

        def readback() -> RunnerOutput:
            self.clock[0] += 1.0
            return launched.readback()

        return Launched(event=launched.event, readback=readback)


async def test_forward_time_is_the_launches_and_idle_time_the_gaps_of_a_busy_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [0.0]
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(launcher, "LaunchTimer", partial(LaunchTimer, lambda: clock[0]))
    params = SamplingParams(max_tokens=3, ignore_eos=True)  # 3 steps: a prefill, 2 decodes
    async with toy_engine(runner=ClockedRunner(clock), pipeline_depth=1) as engine:
        await engine.generate("first", params)
        first = engine.statistics()
        clock[0] += 1000.0  # the engine idles between the requests: not idle time
        await engine.generate("second", params)
        second = engine.statistics()
    # At depth 1 the device waits, between two steps of a run, for the bookkeeping to read
    # the step back (1 s here) and plan the next one.
    assert (first.num_steps, first.forward_seconds, first.forward_idle_seconds) == (3, 30.0, 2.0)
    assert (second.num_steps, second.forward_seconds, second.forward_idle_seconds) == (6, 60.0, 4.0)
