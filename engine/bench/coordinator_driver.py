"""twostroke's data-parallel systems in a benchmark: the coordinator over N engine replicas.

``twostroke bench --replicas N --placement process`` adds two systems: the coordinator over
one replica (the relay's cost against ``twostroke-depth2``, the bare engine: target >= 0.97x)
and over N replicas (target: N processes on the machine's cores beat the best single engine
on them). Each replica loads the model itself, so start-up counts every replica's loading;
torch's threads are split between the replicas (the ``--threads`` budget less one for the
coordinator's event loop, at least one each).
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.streaming import stream_workload
from twostroke.engine.bench.workload import Workload
from twostroke.engine.coordinator import CoordinatorStatistics
from twostroke.engine.surface import open_surface

__all__ = ["CoordinatorDriver", "coordinator_drivers"]


class CoordinatorDriver:
    """The coordinator over ``replicas`` engine replicas, streaming every request.

    Args:
        replicas: How many engine replicas.
        placement: ``"local"``, ``"process"`` or ``"ray"``.
        engine_options: More :class:`~twostroke.engine.config.EngineConfig` fields.
    """

    def __init__(self, replicas: int, placement: str, **engine_options: Any) -> None:
        self.replicas = replicas
        self.placement = placement
        self.name = f"twostroke-dp{replicas}-{placement}"
        self.engine_options = engine_options

    def check(self) -> str | None:
        if self.placement == "ray":
            try:
                import ray  # noqa: F401
            except ImportError:
                return "needs Ray: pip install 'twostroke[ray]'"
        return None

    def threads_per_replica(self, model: ModelSpec) -> int:
        """torch threads each replica gets from the ``--threads`` budget (shared out, as the
        coordinator does)."""
        return max(1, model.threads // self.replicas)

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        started = time.perf_counter()
        timings, wall, stats, startup = anyio.run(self._serve, workload, model, started)
        threads = self.threads_per_replica(model)
        return SystemResult(
            name=self.name,
            available=True,
            startup_seconds=startup,
            wall_seconds=wall,
            timings=timings,
            extra={
                "dtype": model.dtype,
                "replicas": f"{self.replicas} x {self.placement}",
                "threads": f"{threads} torch per replica + 1 event loop each",
                "steps": stats.num_steps,
                "preemptions": stats.num_preemptions,
                "resubmitted": stats.num_resubmitted,
                "relay_s": round(stats.relay_seconds, 3),
                "bookkeeping_s": round(stats.bookkeeping_seconds, 3),
            },
        )

    async def _serve(
        self, workload: Workload, model: ModelSpec, started: float
    ) -> tuple[list[RequestTiming], float, CoordinatorStatistics, float]:
        options = {
            "device": "cpu",
            "dtype": model.dtype,
            "torch_threads": self.threads_per_replica(model),
            **self.engine_options,
        }
        # Opened as every front end opens one: replicas given, so a coordinator (over one
        # replica too: what the relay costs).
        opened = open_surface(
            model.engine_model, replicas=self.replicas, placement=self.placement, **options
        )
        async with opened as coordinator:
            startup = time.perf_counter() - started
            streamed = await stream_workload(coordinator, workload)
            await coordinator.wait_idle()  # fresh statistics from every replica
            stats = coordinator.statistics()
        assert isinstance(stats, CoordinatorStatistics)
        return list(streamed.timings), streamed.wall_seconds, stats, startup


def coordinator_drivers(replicas: int, placement: str, **engine_options: Any) -> list[Any]:
    """The coordinator over one replica (the relay's cost) and over ``replicas``."""
    drivers = [CoordinatorDriver(1, placement, **engine_options)]
    if replicas > 1:
        drivers.append(CoordinatorDriver(replicas, placement, **engine_options))
    return drivers
