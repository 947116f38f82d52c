"""The metrics a router built for vLLM balances by, under vLLM's own names (issue 53).

llm-d's inference scheduler, KServe's and the Gateway API inference extension's endpoint
picker read ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` and ``vllm:cache_config_info`` (its ``block_size`` and
``num_gpu_blocks`` labels). The server exports them always, equal to the ``twostroke:`` ones
of the same scrape, from the engine's statistics; behind a coordinator, from its totals.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from twostroke.engine import Engine, EngineStatistics, SamplingParams
from twostroke.engine.coordinator import Coordinator
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.engine.server import serve
from twostroke.engine.server.metrics import PREFIX, ROUTER_METRICS, ROUTER_PREFIX
from twostroke.engine.surface import EngineSurface
from twostroke.states.plan import StepPlan

from .conftest import http_client

pytestmark = pytest.mark.anyio

Samples = dict[str, list[tuple[dict[str, str], float]]]


class GatedRunner(ToyRunner):
    """The toy runner, whose steps wait for ``gate`` (on the device's thread, bounded)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def execute(self, plan: StepPlan) -> Any:
        self.gate.wait(timeout=30)
        return super().execute(plan)


@asynccontextmanager
async def scraped(surface: EngineSurface) -> AsyncIterator[httpx.AsyncClient]:
    """``surface`` served on 127.0.0.1, and a client for it."""
    async with anyio.create_task_group() as task_group:
        port = await task_group.start(partial(serve, surface, port=0))
        async with http_client(f"http://127.0.0.1:{port}", timeout=20) as http:
            yield http
        task_group.cancel_scope.cancel()


async def scrape(http: httpx.AsyncClient) -> Samples:
    """Every sample of ``/metrics``, by name: its labels and value."""
    reply = await http.get("/metrics")
    assert reply.status_code == 200, reply.text
    samples: Samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def gauges(stats: EngineStatistics) -> tuple[int, ...]:
    """What the four series are made of."""
    return (
        stats.num_running,
        stats.num_waiting,
        stats.num_free_blocks,
        stats.num_blocks,
        stats.num_kv_cache_tokens,
    )


async def settled(surface: EngineSurface, http: httpx.AsyncClient) -> tuple[Samples, Any]:
    """A scrape taken while the statistics did not move, and those statistics.

    The gated steps hold the queues and the pool still; only the planning of the step
    pipelined behind the one in flight may still change them, once: the scrape is taken
    again until the statistics before and after it agree.
    """
    with anyio.fail_after(20):
        while True:
            before = surface.statistics()
            samples = await scrape(http)
            after = surface.statistics()
            if gauges(before) == gauges(after):
                return samples, after


def router_series(samples: Samples, model_name: str) -> dict[str, tuple[dict[str, str], float]]:
    """The ``vllm:`` series, each checked equal to its ``twostroke:`` twin, by name."""
    routed = {name[len(ROUTER_PREFIX) :] for name in samples if name.startswith(ROUTER_PREFIX)}
    assert routed == set(ROUTER_METRICS)  # those four, and nothing else under vllm:
    series = {}
    for name in ROUTER_METRICS:
        (own,) = samples[PREFIX + name]
        (routers,) = samples[ROUTER_PREFIX + name]
        assert routers == own, name
        assert routers[0]["model_name"] == model_name
        series[name] = routers
    return series


def check_against(samples: Samples, stats: EngineStatistics, model_name: str) -> None:
    series = router_series(samples, model_name)
    assert series["num_requests_running"][1] == stats.num_running
    assert series["num_requests_waiting"][1] == stats.num_waiting
    used = stats.num_blocks - stats.num_free_blocks
    assert series["kv_cache_usage_perc"][1] == pytest.approx(used / stats.num_blocks, abs=1e-12)
    labels, value = series["cache_config_info"]
    assert value == 1
    assert labels == {
        "model_name": model_name,
        "block_size": "4",
        "num_gpu_blocks": str(stats.num_blocks),
        "kv_cache_size_tokens": str(4 * stats.num_blocks),
    }


async def test_the_router_metrics_are_the_engines_statistics_under_vllms_names() -> None:
    runner = GatedRunner()
    async with Engine.open(
        runner=runner, tokenizer=ByteTokenizer(), device="cpu", model_name="toy",
        num_blocks=64, block_size=4, max_num_seqs=1,
    ) as engine:  # fmt: skip
        async with scraped(engine) as http:
            check_against(await scrape(http), engine.statistics(), "toy")  # idle: all zero
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            handles = [engine.submit(text, params) for text in ("first one", "second", "third")]
            try:
                # One runs (max_num_seqs=1), held in its first step by the gate; two wait.
                samples, stats = await settled(engine, http)
            finally:
                runner.gate.set()
            for handle in handles:
                await handle.result()
        assert (stats.num_running, stats.num_waiting) == (1, 2)
        assert 0 < stats.num_free_blocks < stats.num_blocks
        check_against(samples, stats, "toy")


async def test_behind_a_coordinator_the_router_metrics_add_up_its_replicas() -> None:
    runners = [GatedRunner(), GatedRunner()]
    replica_options = [
        {"runner": runner, "tokenizer": ByteTokenizer(), "num_blocks": blocks}
        for runner, blocks in zip(runners, (64, 32), strict=True)
    ]
    async with Coordinator.open(
        replicas=2, replica_options=replica_options, device="cpu", model_name="toy",
        block_size=4, max_num_seqs=1,
    ) as coordinator:  # fmt: skip
        async with scraped(coordinator) as http:
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            prompts = ("first one", "second", "third", "fourth")
            handles = [coordinator.submit(text, params) for text in prompts]
            try:
                samples, stats = await settled(coordinator, http)
            finally:
                for runner in runners:
                    runner.gate.set()
            for handle in handles:
                await handle.result()
    replicas = [replica.engine for replica in stats.replicas]
    assert all(replica is not None for replica in replicas)
    assert stats.num_blocks == 64 + 32
    # Each replica runs one (max_num_seqs=1); the rest wait, wherever they were routed.
    assert (stats.num_running, stats.num_waiting) == (2, 2)
    assert stats.num_free_blocks == sum(r.num_free_blocks for r in replicas if r is not None)
    # The pooled usage: used blocks over all blocks, not the mean of the two fractions.
    check_against(samples, stats, "toy")
