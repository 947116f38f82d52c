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


@pytest.fixture(scope="module")
def bare_tokens() -> list[Any]:
    """The bare engine's tokens, kept by the first backend's test for the second's: the
    reference does not depend on the event loop (the replicas' batches already differ from
    the bare engine's, and the tokens must not), so one bare engine serves both."""
    return []


async def test_process_replicas_give_a_bare_engines_tokens_on_smollm2(
    bare_tokens: list[Any],
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    if not bare_tokens:
        async with Engine.open("smollm2", **OPTIONS) as engine:
            bare_tokens.extend(await _generate_all(engine, params))
    expected = bare_tokens
    async with Coordinator.open(
        "smollm2", replicas=2, placement="process", **OPTIONS
    ) as coordinator:
        got = await _generate_all(coordinator, params)
        engines = [replica.engine for replica in coordinator.statistics().replicas]
    assert got == expected
    assert all(engine is not None and engine.num_steps > 0 for engine in engines)
