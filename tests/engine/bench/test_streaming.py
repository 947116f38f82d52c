"""A workload streamed through the engine surface (the toy engine), every chunk timed."""

from __future__ import annotations

import pytest

from twostroke.engine.bench.streaming import request_constraint, stream_workload
from twostroke.engine.bench.workload import (
    BenchRequest,
    Workload,
    offline_workload,
    with_json_schemas,
    with_tools,
)
from twostroke.engine.errors import RequestRejected
from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.states.constraints import Grammar, JsonSchema

from ..conftest import toy_engine

pytestmark = pytest.mark.anyio


async def test_every_request_streams_its_max_tokens_and_every_chunk_is_timed() -> None:
    workload = offline_workload(
        ByteTokenizer().encode, n=5, prompt_len=(3, 10), output_len=(2, 9), seed=4
    )
    async with toy_engine() as engine:
        run = await stream_workload(engine, workload)
    assert len(run.timings) == len(run.request_ids) == len(workload.requests)
    assert len(set(run.request_ids)) == len(run.request_ids)
    for timing, request in zip(run.timings, workload.requests, strict=True):
        assert timing.prompt_tokens == len(request.prompt_token_ids)
        assert timing.output_tokens == request.max_tokens
        assert timing.chunk_times
        assert list(timing.chunk_times) == sorted(timing.chunk_times)
        assert timing.first_token == timing.chunk_times[0]
        assert timing.end == timing.chunk_times[-1]
        assert 0 <= timing.start <= timing.first_token
        assert timing.end <= run.wall_seconds


async def test_a_rejected_request_fails_the_run() -> None:
    workload = Workload(
        requests=(BenchRequest((1, 2, 3), 2), BenchRequest(tuple(range(1, 200)), 2)),
        arrival_times=None,
        seed=0,
        description="one request too long for the pool",
    )
    async with toy_engine(num_blocks=8, block_size=4) as engine:
        with pytest.raises(ExceptionGroup) as raised:
            await stream_workload(engine, workload)
    assert raised.group_contains(RequestRejected, match="the pool has only 8")


async def test_a_request_with_a_json_schema_streams_its_max_tokens_under_it() -> None:
    workload = with_json_schemas(
        offline_workload(ByteTokenizer().encode, n=6, prompt_len=(3, 10), output_len=(2, 30)),
        0.5,
    )
    async with toy_engine() as engine:
        run = await stream_workload(engine, workload)
        stats = engine.statistics()
    for timing, request in zip(run.timings, workload.requests, strict=True):
        assert timing.output_tokens == request.max_tokens
    # Every token of a constrained request sampled under a mask, and no other token did.
    constrained = [r.max_tokens for r in workload.requests if r.json_schema is not None]
    assert len(constrained) == 3
    assert stats.num_masked_rows == sum(constrained)


async def test_a_request_that_offers_tools_streams_text_under_the_lazy_constraint() -> None:
    """tool_choice "auto": every token of such a request is masked, the toy writes text (it
    never spells the trigger) and its EOS does not end the text branch, so it gets its
    max_tokens as the same request without tools."""
    plain = offline_workload(ByteTokenizer().encode, n=6, prompt_len=(3, 10), output_len=(2, 30))
    workload = with_tools(plain, 0.5)
    async with toy_engine() as engine:
        run = await stream_workload(engine, workload)
        stats = engine.statistics()
    for timing, request in zip(run.timings, workload.requests, strict=True):
        assert timing.output_tokens == request.max_tokens
    offered = [r.max_tokens for r in workload.requests if r.tools]
    assert len(offered) == 3
    assert stats.num_masked_rows == sum(offered)
    tools = request_constraint(workload.requests[[r.tools for r in workload.requests].index(True)])
    assert isinstance(tools, Grammar)
    assert tools.source.startswith('start: TEXT "\\u0000" | TEXT_FIRST calls\n')
    assert "get_weather" in tools.source
    assert "search_flights" in tools.source
    assert request_constraint(plain.requests[0]) is None
    both = request_constraint(BenchRequest((1,), 4, json_schema='{"type": "object"}', tools=True))
    assert isinstance(both, Grammar)
    assert "answer: %json" in both.source  # the schema on the text branch
    schema = request_constraint(BenchRequest((1,), 4, json_schema='{"type": "object"}'))
    assert schema == JsonSchema('{"type": "object"}')
