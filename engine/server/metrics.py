"""Prometheus metrics with vLLM's names under a ``twostroke:`` prefix.

A dashboard built for vLLM works after renaming ``vllm:`` to ``twostroke:``. The four series
a router that balances vLLM servers reads (llm-d's inference scheduler, KServe's, the Gateway
API inference extension's endpoint picker) are exported under ``vllm:`` too, always, with the
same values: ``num_requests_waiting``, ``num_requests_running``, ``kv_cache_usage_perc`` and
``cache_config_info`` (:data:`ROUTER_METRICS`; docs/scaling.md). The server keeps its own
:class:`~prometheus_client.CollectorRegistry` (never the process-wide default), so two
servers in one process do not collide. Gauges of the engine's state (running and waiting
requests, KV usage and size) and its preemption counter are read from ``statistics()`` at
scrape time; everything per request is recorded by the server as its requests end.
"""

from __future__ import annotations

from collections.abc import Iterator

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from twostroke.engine.outputs import RequestOutput
from twostroke.engine.statistics import EngineStatistics
from twostroke.engine.surface import EngineSurface

__all__ = ["PREFIX", "ROUTER_METRICS", "ROUTER_PREFIX", "ServerMetrics"]

PREFIX = "twostroke:"
#: The prefix routers built for vLLM look for.
ROUTER_PREFIX = "vllm:"
#: The metrics exported under both prefixes: what a router for vLLM reads by default.
ROUTER_METRICS = (
    "num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "cache_config_info",
)  # fmt: skip

# vLLM's buckets, so that histograms compare bucket for bucket.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

#: The ``finished_reason`` label values of ``request_success_total`` (vLLM's, plus ``error``).
FINISHED_REASONS = ("stop", "length", "abort", "error")


class _EngineCollector(Collector):
    """Reads the engine's gauges and its preemption count when Prometheus scrapes."""

    def __init__(self, engine: EngineSurface) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        # One snapshot for every family, so the vllm: copies equal the twostroke: ones.
        stats = self._engine.statistics()
        labels = [self._engine.model_name]
        gauges = (
            ("num_requests_running", "Requests computing now.", stats.num_running),
            ("num_requests_waiting", "Requests queued for admission.", stats.num_waiting),
            # Pinned blocks give way to any request, as cached ones do: not in use.
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
             1 - (stats.num_free_blocks + stats.num_pinned_blocks) / max(stats.num_blocks, 1)),
        )  # fmt: skip
        for prefix in (PREFIX, ROUTER_PREFIX):
            for name, documentation, value in gauges:
                gauge = GaugeMetricFamily(prefix + name, documentation, labels=["model_name"])
                gauge.add_metric(labels, value)
                yield gauge
            yield _cache_config_info(prefix, stats, labels)
        families = (
            (CounterMetricFamily, "num_preemptions", "Times a request's KV was taken back.",
             stats.num_preemptions),
            (CounterMetricFamily, "prefix_cache_queries",
             "Prompt tokens looked up in the prefix cache.", stats.num_prefix_cache_queries),
            (CounterMetricFamily, "prefix_cache_hits",
             "Prompt tokens found in the prefix cache.", stats.num_prefix_cache_hits),
        )  # fmt: skip
        for family, name, documentation, value in families:
            metric = family(PREFIX + name, documentation, labels=["model_name"])
            metric.add_metric(labels, value)
            yield metric
        yield from _speculation_metrics(stats, labels)


def _cache_config_info(prefix: str, stats: EngineStatistics, labels: list[str]) -> Metric:
    """The KV cache's shape as an info metric: a gauge fixed at 1 whose labels carry it.

    vLLM's labels, as strings (vLLM's carry every field of its cache config; routers read
    ``block_size`` and ``num_gpu_blocks``): behind a coordinator the blocks and tokens of its
    live replicas' pools added up. The block size is the tokens over the blocks: exactly
    the replicas' one when they share it (they do unless ``replica_options`` gives them
    different ones: then the blocks' mean, and ``kv_cache_size_tokens`` stays exact); 0
    while no pool has reported (a coordinator's remote replicas before their first
    statistics).
    """
    block_size = stats.num_kv_cache_tokens // stats.num_blocks if stats.num_blocks else 0
    info = GaugeMetricFamily(
        prefix + "cache_config_info",
        "The KV cache's configuration, in the labels (the value is always 1).",
        labels=["model_name", "block_size", "num_gpu_blocks", "kv_cache_size_tokens"],
    )
    shape = (block_size, stats.num_blocks, stats.num_kv_cache_tokens)
    info.add_metric([*labels, *map(str, shape)], 1)
    return info


def _speculation_metrics(stats: EngineStatistics, labels: list[str]) -> Iterator[Metric]:
    """Speculative decoding's counters, as vLLM names them (docs/speculative.md)."""
    counts = (
        ("spec_decode_num_drafts", "Rows that verified drafted tokens.",
         stats.num_spec_decode_drafts),
        ("spec_decode_num_draft_tokens", "Drafted tokens verified.",
         stats.num_spec_decode_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
         stats.num_spec_decode_accepted_tokens),
    )  # fmt: skip
    for name, documentation, value in counts:
        metric = CounterMetricFamily(PREFIX + name, documentation, labels=["model_name"])
        metric.add_metric(labels, value)
        yield metric
    per_position = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Drafted tokens accepted, by their position in the draft (0 is the first).",
        labels=["model_name", "position"],
    )
    for position, value in enumerate(stats.spec_decode_accepted_tokens_per_pos):
        per_position.add_metric([*labels, str(position)], value)
    yield per_position


class ServerMetrics:
    """The server's metrics and the registry that exposes them.

    Args:
        engine: The engine (or coordinator) served; read at scrape time.
    """

    def __init__(self, engine: EngineSurface) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine))
        name = engine.model_name
        registry = self.registry

        def counter(metric: str, documentation: str) -> prometheus_client.Counter:
            return prometheus_client.Counter(
                PREFIX + metric, documentation, ["model_name"], registry=registry
            )

        def histogram(
            metric: str, documentation: str, buckets: tuple[float, ...]
        ) -> prometheus_client.Histogram:
            return prometheus_client.Histogram(
                PREFIX + metric, documentation, ["model_name"], buckets=buckets, registry=registry
            )

        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests.").labels(name)
        self._generation_tokens = counter("generation_tokens", "Output tokens delivered.").labels(
            name
        )
        success = prometheus_client.Counter(
            PREFIX + "request_success",
            "Requests ended, by reason (abort: the client left; error: a step failed).",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self._finished = {reason: success.labels(name, reason) for reason in FINISHED_REASONS}
        self._ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS
        ).labels(name)
        self._tpot = histogram(
            "request_time_per_output_token_seconds",
            "(e2e - ttft) / (output tokens - 1), per request.",
            _TOKEN_LATENCY_BUCKETS,
        ).labels(name)
        self._itl = histogram(
            "inter_token_latency_seconds",
            "Time between successive streamed chunks, per token they carry.",
            _TOKEN_LATENCY_BUCKETS,
        ).labels(name)
        self._e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_LATENCY_BUCKETS
        ).labels(name)
        self._queue = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_LATENCY_BUCKETS
        ).labels(name)

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return prometheus_client.generate_latest(self.registry)

    def submitted(self, num_prompt_tokens: int) -> None:
        self._prompt_tokens.inc(num_prompt_tokens)

    def finished(self, output: RequestOutput) -> None:
        """A request finished (``stop`` or ``length``): count it and its timings."""
        self._finished[str(output.finish_reason)].inc()
        self._generation_tokens.inc(len(output.token_ids))
        metrics = output.metrics
        self._e2e.observe(metrics.e2e)
        if metrics.ttft is not None:
            self._ttft.observe(metrics.ttft)
        if metrics.tpot is not None:
            self._tpot.observe(metrics.tpot)
        if metrics.queue_time is not None:
            self._queue.observe(metrics.queue_time)

    def ended_early(self, reason: str, num_tokens_delivered: int) -> None:
        """A request ended without output: ``abort`` (cancelled by the server) or ``error``."""
        self._finished[reason].inc()
        self._generation_tokens.inc(num_tokens_delivered)

    def streamed(self, gap: float, num_tokens: int) -> None:
        """A chunk of ``num_tokens`` tokens went out ``gap`` seconds after the previous one."""
        if num_tokens > 0:
            per_token = gap / num_tokens
            for _ in range(num_tokens):
                self._itl.observe(per_token)
