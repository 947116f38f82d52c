"""The bench's data-parallel systems, on the toy model (local replicas: no children)."""

from __future__ import annotations

import pathlib

import pytest

from twostroke.engine.bench.coordinator_driver import CoordinatorDriver, coordinator_drivers
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import offline_workload
from twostroke.engine.runners.toy import ByteTokenizer


def test_the_coordinator_systems_run_a_workload_and_report_it(tmp_path: pathlib.Path) -> None:
    workload = offline_workload(
        ByteTokenizer().encode, n=6, prompt_len=(4, 12), output_len=(3, 9), seed=1
    )
    model = ModelSpec(name="toy", source=str(tmp_path), dtype="float32", threads=3)
    drivers = coordinator_drivers(2, "local", num_blocks=256, block_size=4)
    assert [d.name for d in drivers] == ["twostroke-dp1-local", "twostroke-dp2-local"]
    assert all(d.check() is None for d in drivers)
    assert [d.threads_per_replica(model) for d in drivers] == [3, 1]
    result = drivers[1].run(workload, model=model)
    assert result.name == "twostroke-dp2-local"
    assert [t.output_tokens for t in result.timings] == [r.max_tokens for r in workload.requests]
    assert result.extra["replicas"] == "2 x local"
    assert coordinator_drivers(1, "process")[0].name == "twostroke-dp1-process"


def test_the_ray_system_says_what_it_needs_without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    assert CoordinatorDriver(2, "ray").check() == "needs Ray: pip install 'twostroke[ray]'"
