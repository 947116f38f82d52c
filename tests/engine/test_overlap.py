"""The one-step lookahead: identical output at depth 1 and 2, at most one wasted token."""

from __future__ import annotations

import collections
from typing import Any

import anyio
import pytest

from twostroke.engine import Engine, SamplingParams
from twostroke.engine.runners.protocol import RunnerOutput
from twostroke.engine.runners.toy import ToyRunner
from twostroke.gpu.completion import Launched
from twostroke.states.plan import StepPlan

from .conftest import toy_engine

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
async def test_depth_one_and_two_give_identical_tokens_on_the_real_model() -> None:
    prompts = [
        [{"role": "user", "content": "Name three colours."}],
        [{"role": "user", "content": "What is 2 + 2?"}],
        "The quick brown fox",
        "Once upon a time, in a land far away,",
    ]
    kinds = [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=11, presence_penalty=0.5),
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
