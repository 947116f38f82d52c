"""One benchmark run's record: the workload, the model, every system's results, the machine.

Apart from :mod:`~twostroke.engine.bench.runner`, which makes it, and
:mod:`~twostroke.engine.bench.report`, which renders it, so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from twostroke.engine.bench.metrics import SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.quality import QualityReference
from twostroke.engine.bench.roof import WorkloadRoof
from twostroke.engine.bench.workload import Workload

__all__ = ["BenchRun"]


def _results(values: Iterable[SystemResult]) -> tuple[SystemResult, ...]:
    return tuple(values)


@attrs.frozen
class BenchRun:
    """One workload through several systems, with what a reader needs to repeat it.

    Attributes:
        workload: What every system ran.
        model: On which weights, dtype and threads.
        results: One per system, in the order they ran.
        started_at: ISO 8601 time the run began.
        machine: CPU, cores, OS, Python, torch.
        roof: The workload's floor on this machine (``None``: not computed).
        quality: The reference the systems' greedy outputs are compared with (``None``:
            not computed; :mod:`~twostroke.engine.bench.quality`).
    """

    workload: Workload
    model: ModelSpec
    results: tuple[SystemResult, ...] = attrs.field(converter=_results)
    started_at: str
    machine: Mapping[str, Any] = attrs.field(eq=False)
    roof: WorkloadRoof | None = None
    quality: QualityReference | None = None
