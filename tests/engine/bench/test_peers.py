"""The Hugging Face peers on the real model (slow: loads SmolLM2 from its GGUF)."""

from __future__ import annotations

import pytest

from twostroke.engine.bench.metrics import metrics
from twostroke.engine.bench.model import ModelSpec, ensure_hf_dir
from twostroke.engine.bench.peers import HFStaticDriver
from twostroke.engine.bench.workload import BenchRequest, Workload


@pytest.mark.slow
# A few seconds once the session's Hugging Face copy of SmolLM2 exists (the fixture spends
# about 20 s making it on a 2-core AVX2 machine with another job busy, for this test and the
# parity test with transformers); the timeout keeps room for making it here.
@pytest.mark.timeout(240)
def test_hf_static_on_two_tiny_requests(smollm2_hf_fp32: ModelSpec) -> None:
    model = smollm2_hf_fp32
    workload = Workload(
        requests=(BenchRequest(range(100, 112), 4), BenchRequest(range(200, 205), 3)),
        arrival_times=None,
        seed=0,
        description="two tiny requests",
    )
    marker = max(path.stat().st_mtime_ns for path in model.hf_dir.iterdir())
    result = HFStaticDriver(batch_size=2).run(workload, model=model)
    assert result.available, result.reason
    assert [t.output_tokens for t in result.timings] == [4, 3]
    # One batch: both requests see the same steps; the shorter stops counting at 3.
    assert result.timings[1].chunk_times == result.timings[0].chunk_times[:3]
    assert metrics(result).output_tokens == 7
    assert result.extra["weights"] == "GGUF dequantized (dense)"
    # The Hugging Face copy (for vLLM) is current, so the driver read it and wrote nothing.
    assert ensure_hf_dir(model) == (model.hf_dir, 0.0)
    assert max(path.stat().st_mtime_ns for path in model.hf_dir.iterdir()) == marker
