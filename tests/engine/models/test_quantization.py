"""Reduced-precision projection weights: the kernels against F.linear, the model against
float32, the fallback where a kernel does not run, and quality on SmolLM2 (slow)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.engine.models.test_llama import _config, make_tiny_model, random_sequences
from twostroke.engine.config import EngineConfig
from twostroke.engine.models.choice import Projections, select_kernels, torch_kernels
from twostroke.engine.models.forms import QUANTIZATIONS, FullPrecision, QuantizedWeight
from twostroke.engine.models.llama import LlamaForCausalLM
from twostroke.engine.models.loading import open_model
from twostroke.engine.models.quantization import QuantizationUnavailable, kernel_available
from twostroke.gpu.threads import torch_threads

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")
HELDOUT = Path(__file__).resolve().parent.parent / "data" / "heldout.txt"

#: Error of the largest output, relative, each kind may make on random data: fp16 weights
#: round to 11 bits (about 2e-4 measured), int8 weights per channel and 7-bit activations
#: per tensor about 2e-2.
TOLERANCE = {"fp16": 2e-3, "int8": 6e-2}


def available(kind: Any) -> bool:
    return kernel_available(kind, CPU)


@pytest.mark.parametrize("kind", QUANTIZATIONS)
@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 40),
    in_features=st.integers(1, 80),
    out_features=st.integers(1, 80),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(rows=1, in_features=13, out_features=1, bias=False, seed=5)
@example(rows=1, in_features=13, out_features=1, bias=True, seed=5)
def test_quantized_weight_matches_linear(
    kind: Any, rows: int, in_features: int, out_features: int, bias: bool, seed: int
) -> None:
    if not available(kind):
        pytest.skip(f"{kind}'s kernel does not run here")
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    with torch.inference_mode():
        out = QuantizedWeight(weight, b, kind)(x)
        bf16 = QuantizedWeight(weight, b, kind)(x.bfloat16())  # cast in, cast back out
    expected = F.linear(x, weight, b)
    assert out.shape == expected.shape
    assert out.dtype == torch.float32
    assert bf16.dtype == torch.bfloat16
    # Rounding errors add up term by term, so they scale with the sum of the terms' sizes,
    # not with the sum itself, which may nearly cancel (rows=1, in=13, out=1, seed=5: int8
    # missed a bound relative to |output| by far, with an error of the expected size).
    scale = (x.abs() @ weight.abs().T).max().clamp(min=1e-6)
    assert (out - expected).abs().max() <= TOLERANCE[kind] * scale


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quantized-llama")
    make_tiny_model("llama", path, seed=7)
    return path


@pytest.mark.parametrize("kind", QUANTIZATIONS)
def test_quantized_model_tracks_float32(tiny: Path, kind: Any) -> None:
    exact = open_model(tiny, dtype=torch.float32, device=CPU)
    if not available(kind):
        with pytest.warns(QuantizationUnavailable, match=f"quantization={kind!r}"):
            loaded = open_model(tiny, dtype=torch.float32, device=CPU, quantization=kind)
        assert loaded.quantization is None
        return
    loaded = open_model(tiny, dtype=torch.float32, device=CPU, quantization=kind)
    assert loaded.quantization == kind
    layer = loaded.module.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.method, QuantizedWeight)
    assert layer.mlp.gate_up_proj.weight.numel() == 0  # the dense copy is gone
    sequences = random_sequences([6, 21])
    expected = exact.module.forward_logits(sequences)
    for ours, theirs in zip(
        loaded.module.forward_logits(sequences, chunk_size=4), expected, strict=True
    ):
        assert (ours - theirs).abs().max() <= 10 * TOLERANCE[kind] * theirs.abs().max()
    chosen = loaded.module.kernels
    assert chosen.projection.layers == kind
    loaded.module.use_kernels(chosen)  # idempotent
    other = "int8" if kind == "fp16" else "fp16"
    with pytest.raises(RuntimeError, match="kernels are chosen once"):
        loaded.module.use_kernels(attrs.evolve(chosen, projection=Projections(other, "dense")))
    with pytest.raises(RuntimeError, match=r"cannot load 'model.norm.weight': .* quantized"):
        loaded.module.load_weight("model.norm.weight", torch.ones(64))


def test_packing_on_several_threads_gives_the_same_model(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if not available("fp16"):
        pytest.skip("fp16's kernel does not run here")
    serial = open_model(tiny, dtype=torch.float32, device=CPU, quantization="fp16")
    with torch_threads(3), caplog.at_level(logging.INFO, logger="twostroke.engine.models.loading"):
        parallel = open_model(tiny, dtype=torch.float32, device=CPU, quantization="fp16")
    assert [record.getMessage() for record in caplog.records] == [
        f"twostroke: packing {tiny.name}'s projection weights for fbgemm's fp16 kernel (3 threads)"
    ]
    sequences = random_sequences([6, 21])
    for ours, theirs in zip(
        parallel.module.forward_logits(sequences),
        serial.module.forward_logits(sequences),
        strict=True,
    ):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("threads", [0, 1.5])
def test_packing_threads_must_be_a_positive_int(threads: Any) -> None:
    model = LlamaForCausalLM(_config(), dtype=torch.float32, device=CPU)
    kernels = attrs.evolve(torch_kernels(CPU), projection=Projections("fp16", "dense"))
    error = ValueError if isinstance(threads, int) else TypeError
    with pytest.raises(error, match=r"^threads must be"):
        model.use_kernels(kernels, threads=threads)
    assert model.kernels.projection.quantization is None


def test_quantization_off_the_cpu_warns_and_keeps_the_weights() -> None:
    meta = torch.device("meta")
    with pytest.warns(QuantizationUnavailable, match=r"'fp16' is not available on meta"):
        kernels = select_kernels(
            _config(), dtype=torch.float32, device=meta, exact=False, quantization="fp16"
        )
    assert kernels.projection == Projections("dense", "dense")
    model = LlamaForCausalLM(_config(), dtype=torch.float32, device=meta)
    model.use_kernels(kernels)
    assert isinstance(model.layers[0].mlp.down_proj.method, FullPrecision)


def test_engine_config_takes_vllm_names_only() -> None:
    assert EngineConfig(quantization="int8").quantization == "int8"
    assert EngineConfig().quantization == "auto"
    assert EngineConfig(quantization=None).quantization is None
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")  # type: ignore[arg-type]


@pytest.mark.slow
def test_smollm2_fp16_weights_keep_perplexity() -> None:
    """On the held-out text, fp16 weights keep SmolLM2's perplexity within 1 % of float32's.

    int8 has no such bound: its per-tensor 7-bit activations triple the perplexity
    (docs/models.md has the measured table, from scripts/weight_quality.py).
    """
    from twostroke.engine.text.tokenizer import HFTokenizer

    if not available("fp16"):
        pytest.skip("fp16's kernel does not run here")
    loaded = open_model("smollm2", dtype=torch.float32, device=CPU)
    ids = HFTokenizer.from_pretrained(loaded.source).encode(HELDOUT.read_text())[:128]
    targets = torch.tensor(ids[1:])

    def perplexity() -> float:
        logits = loaded.module.forward_logits([ids], block_size=16)[0]
        return math.exp(F.cross_entropy(logits[:-1], targets).item())

    base = perplexity()
    loaded = open_model("smollm2", dtype=torch.float32, device=CPU, quantization="fp16")
    assert loaded.quantization == "fp16"
    assert abs(perplexity() / base - 1) < 0.01
