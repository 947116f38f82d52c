"""SmolLM2 through process replicas: the same tokens as a bare engine (slow: real model)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from twostroke.engine import Coordinator, Engine, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

PROMPTS: list[Any] = [
    [{"role": "user", "content": "Name three colours."}],
    "The quick brown fox",
    [{"role": "user", "content": "What is 2 + 2?"}],
    "Once upon a time, in a land far away,",
]
OPTIONS = {"device": "cpu", "dtype": "float32", "num_blocks": 128, "torch_threads": 1}


async def _generate_all(engine: Engine | Coordinator, params: SamplingParams) -> list[Any]:
    """Every prompt at once (one batch, as the replicas see them), in prompt order."""
    got: list[tuple[int, ...]] = [()] * len(PROMPTS)

    async def one(index: int) -> None:
        got[index] = (await engine.generate(PROMPTS[index], params)).token_ids

    async with anyio.create_task_group() as task_group:
        for index in range(len(PROMPTS)):
            task_group.start_soon(one, index)
    return got


# The model's path on one backend: process replicas on both run the toy's (test_process.py);
# the trio run cost two more replica processes loading SmolLM2 (about 25 CPU s).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_process_replicas_give_a_bare_engines_tokens_on_smollm2() -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    async with Engine.open("smollm2", **OPTIONS) as engine:
        expected = await _generate_all(engine, params)
    async with Coordinator.open(
        "smollm2", replicas=2, placement="process", **OPTIONS
    ) as coordinator:
        got = await _generate_all(coordinator, params)
        engines = [replica.engine for replica in coordinator.statistics().replicas]
    assert got == expected
    assert all(engine is not None and engine.num_steps > 0 for engine in engines)
