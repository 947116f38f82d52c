"""Prefix caching through the engine: the same outputs on and off, visible in statistics."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from twostroke.engine import Engine, RequestOutput, SamplingParams
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.gpu.fake import FakeDevice

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful assistant who answers in lowercase words. " * 2
PROMPTS = [SYSTEM + question for question in ("why?", "how so?", "what next?", "who?")]


async def run(enable: bool, depth: int) -> tuple[list[RequestOutput], Any]:
    outputs: dict[int, RequestOutput] = {}
    async with Engine.open(
        runner=ToyRunner(eos_rate=0.0),
        tokenizer=ByteTokenizer(),
        device=FakeDevice(step_time=0.0),
        enable_prefix_caching=enable,
        pipeline_depth=depth,
        num_blocks=96,
        block_size=8,
        max_num_batched_tokens=64,
    ) as engine:
        params = SamplingParams(max_tokens=12)
        outputs[0] = await engine.generate(PROMPTS[0], params)  # computes the system prompt

        async def one(index: int) -> None:
            outputs[index] = await engine.generate(PROMPTS[index], params)

        async with anyio.create_task_group() as task_group:
            for index in range(1, len(PROMPTS)):
                task_group.start_soon(one, index)
        await engine.wait_idle()
        stats = engine.statistics()
    return [outputs[index] for index in range(len(PROMPTS))], stats


@pytest.mark.parametrize("depth", [1, 2])
async def test_caching_changes_no_output_and_reports_its_hits(depth: int) -> None:
    cached, with_cache = await run(True, depth)
    plain, without = await run(False, depth)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert [o.text for o in cached] == [o.text for o in plain]

    system_blocks = len(SYSTEM.encode()) // 8  # full blocks of the shared system prompt
    assert cached[0].usage.cached_prompt_tokens == 0
    for output in cached[1:]:
        assert output.usage.cached_prompt_tokens == system_blocks * 8
    assert all(output.usage.cached_prompt_tokens == 0 for output in plain)

    queried = sum(len(prompt.encode()) for prompt in PROMPTS)
    assert with_cache.num_prefix_cache_queries == queried
    assert with_cache.num_prefix_cache_hits == 3 * system_blocks * 8
    assert with_cache.prefix_cache_hit_rate == pytest.approx(3 * system_blocks * 8 / queried)
    assert with_cache.num_cached_blocks > 0
    assert with_cache.num_free_blocks == with_cache.num_blocks  # cached blocks are free
    assert with_cache.num_tokens_scheduled < without.num_tokens_scheduled
    assert without.num_prefix_cache_hits == 0
    assert without.num_cached_blocks == 0
    assert without.prefix_cache_hit_rate == 0.0
