"""The Hugging Face peers on the real model (slow: loads SmolLM2 from its GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest

from twostroke.engine.bench.metrics import metrics
from twostroke.engine.bench.model import ModelSpec, ensure_hf_dir
from twostroke.engine.bench.peers import HFStaticDriver
from twostroke.engine.bench.workload import BenchRequest, Workload


@pytest.mark.slow
# About 40 s on a 2-core AVX2 machine with another job busy, most of it transformers' own GGUF
# reading (dequantization, tokenizer): the timeout keeps four times that.
@pytest.mark.timeout(240)
def test_hf_static_on_two_tiny_requests(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    model = ModelSpec.resolve("smollm2", work_dir=tmp_path, threads=2)
    workload = Workload(
        requests=(BenchRequest(range(100, 112), 4), BenchRequest(range(200, 205), 3)),
        arrival_times=None,
        seed=0,
        description="two tiny requests",
    )
    result = HFStaticDriver(batch_size=2).run(workload, model=model)
    assert result.available, result.reason
    assert [t.output_tokens for t in result.timings] == [4, 3]
    # One batch: both requests see the same steps; the shorter stops counting at 3.
    assert result.timings[1].chunk_times == result.timings[0].chunk_times[:3]
    assert metrics(result).output_tokens == 7
    assert result.extra["weights"] == "GGUF dequantized (dense)"
    # The Hugging Face copy for vLLM was written once, and is reused.
    assert (model.hf_dir / "config.json").is_file()
    assert ensure_hf_dir(model) == (model.hf_dir, 0.0)
