"""The HTTP endpoint driver against a real ``twostroke serve`` on the toy model."""

from __future__ import annotations

import pytest

from tests.engine.server.conftest import served
from twostroke.engine.bench.http_peer import EndpointDriver, parse_endpoint
from twostroke.engine.bench.metrics import metrics
from twostroke.engine.bench.workload import offline_workload, with_tools


def test_parse_endpoint() -> None:
    assert parse_endpoint("http://127.0.0.1:8000") == EndpointDriver(
        name="http:127.0.0.1:8000", base_url="http://127.0.0.1:8000/v1"
    )
    named = parse_endpoint("vllm=http://localhost:8001/v1/")
    assert (named.name, named.base_url) == ("vllm", "http://localhost:8001/v1")
    with pytest.raises(ValueError, match="--endpoint must be"):
        parse_endpoint("localhost:8000")


@pytest.mark.anyio
async def test_a_workload_over_http_gives_a_clients_timings() -> None:
    workload = offline_workload(
        lambda text: list(text.encode()), n=6, prompt_len=(4, 12), output_len=(3, 9), seed=1
    )
    async with served(api_key="sk-bench") as server:
        driver = EndpointDriver(name="toy", base_url=f"{server.base_url}/v1", api_key="sk-bench")
        result = await driver._run(workload)
    assert result.available
    assert result.extra["served_model"] == "toy"
    assert [t.output_tokens for t in result.timings] == [r.max_tokens for r in workload.requests]
    assert [t.prompt_tokens for t in result.timings] == [
        len(r.prompt_token_ids) for r in workload.requests
    ]
    figures = metrics(result)
    assert figures.output_throughput > 0
    assert figures.ttft.mean > 0


@pytest.mark.anyio
async def test_requests_that_offer_tools_are_not_sent_to_completions() -> None:
    workload = with_tools(offline_workload(lambda text: list(text.encode()), n=2), 1)
    result = await EndpointDriver(name="x", base_url="http://127.0.0.1:9/v1")._run(workload)
    assert not result.available
    assert result.reason.startswith("requests that offer tools need /v1/chat/completions")
