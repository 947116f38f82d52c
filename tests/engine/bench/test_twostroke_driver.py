"""twostroke's own bench systems on the real model (slow: loads SmolLM2 from its GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest

from twostroke.engine.bench import twostroke_driver
from twostroke.engine.bench.metrics import metrics
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.twostroke_driver import engine_drivers
from twostroke.engine.bench.workload import BenchRequest, Workload


@pytest.mark.slow
def test_the_engine_systems_warm_up_once_and_the_bare_loop_replays_their_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(twostroke_driver, "_WARMED", set())
    model = ModelSpec.resolve("smollm2", work_dir=tmp_path, dtype="float32", threads=1)
    workload = Workload(
        requests=(BenchRequest(range(100, 112), 4), BenchRequest(range(200, 205), 3)),
        arrival_times=None,
        seed=0,
        description="two tiny requests",
    )
    depth2, bare, depth1 = engine_drivers(max_num_seqs=4)
    results = [driver.run(workload, model=model) for driver in (depth2, bare, depth1)]
    for result in results:
        assert result.available, result.reason
        assert [t.output_tokens for t in result.timings] == [4, 3]
        assert metrics(result).output_tokens == 7
    first, _, second = results
    # The first engine system of the process ran the warm-up pass, untimed; the next did not.
    assert first.extra["warmup_s"] > 0
    assert second.extra["warmup_s"] == 0
    # The bare loop replayed exactly the depth-2 run's steps (the warm-up's are not recorded).
    assert results[1].extra["steps"] == first.extra["steps"]
