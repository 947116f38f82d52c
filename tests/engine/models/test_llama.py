"""The decoder against transformers: logits through the paged cache, every layout of a step."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from twostroke.engine.attention.kernels import AttentionKernel
from twostroke.engine.models.choice import Projections, select_kernels
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.decoder import WeightError
from twostroke.engine.models.forms import FullPrecision, OneDNNWeight, QuantizedWeight, can_pack
from twostroke.engine.models.layers import inverse_frequencies
from twostroke.engine.models.linear import Linear
from twostroke.engine.models.llama import LlamaForCausalLM
from twostroke.engine.models.loading import LoadedModel, open_model
from twostroke.engine.models.quantization import QuantizationUnavailable

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")

#: Shapes of the tiny models; ``initializer_range`` is large so that logits are far apart
#: and greedy parity is not at the mercy of rounding.
TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def make_tiny_model(kind: str, path: Path, seed: int = 0, **overrides: Any) -> Any:
    """Create a random transformers model of ``kind`` ("llama", "qwen2", "mistral" or "qwen3"),
    save it to ``path``.

    Every parameter is drawn at random (norm weights and biases too, which transformers
    initializes to constants), so a weight loaded into the wrong place changes the logits.
    """
    torch.manual_seed(seed)
    if kind == "llama":
        config: Any = transformers.LlamaConfig(**{**TINY, **overrides})
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**{**TINY, **overrides})
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "mistral":
        config = transformers.MistralConfig(**{**TINY, **overrides})
        model = transformers.MistralForCausalLM(config)
    elif kind == "qwen3":  # (its own default head_dim is 128: the tiny one is hidden / heads)
        config = transformers.Qwen3Config(**{**TINY, "head_dim": 16, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    else:
        raise ValueError(f"kind must be 'llama', 'qwen2', 'mistral' or 'qwen3', got {kind!r}")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                parameter.normal_(0, 0.1)
    model.eval()
    model.save_pretrained(path)
    return model


def random_sequences(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, TINY["vocab_size"], (n,), generator=generator).tolist() for n in lengths
    ]


def reference_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    path = tmp_path_factory.mktemp("llama")
    reference = make_tiny_model("llama", path)
    return reference, open_model(path, dtype=torch.float32, device=CPU)


LENGTHS = [1, 2, 7, 12, 23, 40]


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 8])
def test_llama_logits_match_transformers(
    tiny_llama: tuple[Any, LoadedModel], chunk_size: int | None
) -> None:
    """Prefill whole, decode token by token, or mixed chunks: fp32 logits within 1e-4."""
    reference, loaded = tiny_llama
    sequences = random_sequences(LENGTHS)
    ours = loaded.module.forward_logits(sequences, chunk_size=chunk_size)
    for tokens, logits in zip(sequences, ours, strict=True):
        expected = reference_logits(reference, tokens)
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kernel", ["bag", "matmul", "sdpa", "native"])
def test_every_attention_kernel_matches_transformers_through_the_model(
    tiny_llama: tuple[Any, LoadedModel], kernel: AttentionKernel
) -> None:
    """``forward_logits`` runs the chosen kernel (the compiled one where it runs); each
    (the CPU's compiled and bag kernels, CUDA's SDPA) takes the model's strided queries and
    its cache writes: mixed chunks, fp32 logits within 1e-4."""
    reference, loaded = tiny_llama
    sequences = random_sequences(LENGTHS)
    ours = loaded.module.forward_logits(sequences, chunk_size=3, kernel=kernel)
    for tokens, logits in zip(sequences, ours, strict=True):
        torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        pytest.param("qwen2", {}, id="qwen2-bias"),
        pytest.param("qwen2", {"tie_word_embeddings": True}, id="qwen2-tied"),
        pytest.param("llama", {"attention_bias": True, "mlp_bias": True}, id="llama-biases"),
        pytest.param("llama", {"head_dim": 32}, id="llama-wide-heads"),
        pytest.param("llama", {"num_key_value_heads": 4}, id="llama-mha"),
        pytest.param("llama", {"num_key_value_heads": 1}, id="llama-mqa"),
        pytest.param(
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 50000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
            id="llama3-rope",
        ),
        pytest.param(
            "llama",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
            id="linear-rope",
        ),
        # Windows shorter than the 30-token sequence: every layer's (Mistral), the upper
        # layers' (Qwen2 from max_window_layers on).
        pytest.param("mistral", {"sliding_window": 7}, id="mistral-window"),
        pytest.param(
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
            id="qwen2-window",
        ),
    ],
)
def test_flavours_match_transformers(kind: str, overrides: dict[str, Any], tmp_path: Path) -> None:
    reference = make_tiny_model(kind, tmp_path, seed=3, **overrides)
    loaded = open_model(tmp_path, dtype=torch.float32, device=CPU)
    sequences = random_sequences([1, 9, 30], seed=4)
    for tokens, logits in zip(
        sequences, loaded.module.forward_logits(sequences, chunk_size=4), strict=True
    ):
        torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=1e-4, rtol=0)


def test_bfloat16_tracks_float32(tiny_llama: tuple[Any, LoadedModel], tmp_path: Path) -> None:
    """bf16 weights, activations and cache: close to fp32, and the cache is bf16."""
    reference, loaded = tiny_llama
    reference.save_pretrained(tmp_path)
    bf16 = open_model(tmp_path, dtype=torch.bfloat16, device=CPU)
    assert bf16.module.embed_tokens.dtype == torch.bfloat16
    assert bf16.module.allocate_kv_cache(2, 4).key.dtype == torch.bfloat16
    sequences = random_sequences([5, 33])
    exact = loaded.module.forward_logits(sequences)
    for low, high in zip(bf16.module.forward_logits(sequences, chunk_size=5), exact, strict=True):
        assert low.dtype == torch.float32
        scale = high.abs().max()
        assert (low - high).abs().max() < 0.05 * scale


def test_inverse_frequencies_equal_transformers() -> None:
    hf_config = transformers.LlamaConfig(
        **{
            **TINY,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        }
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, CPU)
    config = ModelConfig.from_hf_config(
        {**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    assert torch.equal(inverse_frequencies(config), expected)


def _config(**overrides: Any) -> ModelConfig:
    data = {**transformers.LlamaConfig(**TINY).to_dict(), "architectures": ["LlamaForCausalLM"]}
    return ModelConfig.from_hf_config({**data, **overrides})


def test_load_weight_rejects_unknown_names_and_wrong_shapes() -> None:
    model = LlamaForCausalLM(_config(), dtype=torch.float32, device=CPU)
    with pytest.raises(WeightError, match=r"unexpected tensor 'model.layers.9.mlp.up_proj.weight'"):
        model.load_weight("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))
    with pytest.raises(WeightError, match=r"unexpected tensor 'model.layers.0.mlp.up_proj.bias'"):
        model.load_weight("model.layers.0.mlp.up_proj.bias", torch.zeros(128))
    with pytest.raises(
        WeightError,
        match=r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\), "
        r"expected \(32, 64\)",
    ):
        model.load_weight("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))
    assert len(model.missing_weights()) == len(model.expected_weights())


def test_load_weight_fills_fused_slices_and_reports_missing() -> None:
    model = LlamaForCausalLM(_config(num_hidden_layers=1), dtype=torch.float32, device=CPU)
    model.load_weight("model.layers.0.self_attn.k_proj.weight", torch.full((32, 64), 2.0))
    model.load_weight("model.layers.0.mlp.up_proj.weight", torch.full((128, 64), 3.0))
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[64:96], torch.full((32, 64), 2.0))
    gate_up = model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up[128:], torch.full((128, 64), 3.0))
    missing = model.missing_weights()
    assert "model.layers.0.self_attn.k_proj.weight" not in missing
    assert "model.layers.0.self_attn.q_proj.weight" in missing
    assert "lm_head.weight" in missing


def test_tied_model_accepts_and_ignores_an_output_tensor() -> None:
    model = LlamaForCausalLM(_config(tie_word_embeddings=True), dtype=torch.float32, device=CPU)
    model.load_weight("lm_head.weight", torch.zeros(256, 64))
    model.load_weight("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))
    assert "lm_head.weight" not in model.expected_weights()
    # The output projection is the embedding, shared, not a parameter of its own.
    assert model.lm_head.weight is None
    assert isinstance(model.lm_head.method, FullPrecision)
    assert model.lm_head.method.weight is model.embed_tokens
    assert "lm_head.weight" not in model.state_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_packed_weights_compute_what_dense_weights_do(tied: bool, tmp_path: Path) -> None:
    """oneDNN-packed bf16 projections (where the CPU can) against plain ``F.linear``."""
    make_tiny_model("llama", tmp_path, seed=5, tie_word_embeddings=tied)
    dense = open_model(tmp_path, dtype=torch.bfloat16, device=CPU, pack_weights=False)
    packed = open_model(tmp_path, dtype=torch.bfloat16, device=CPU)
    assert dense.module.kernels.projection == Projections("dense", "dense")
    form = "onednn" if can_pack(torch.bfloat16, CPU) else "dense"
    assert packed.module.kernels.projection == Projections(form, form)
    sequences = random_sequences([3, 17], seed=6)
    expected = dense.module.forward_logits(sequences, chunk_size=4)
    for ours, theirs in zip(
        packed.module.forward_logits(sequences, chunk_size=4), expected, strict=True
    ):
        assert torch.equal(ours, theirs)


def test_a_model_takes_its_kernels_once_and_no_more_weights_after(tmp_path: Path) -> None:
    make_tiny_model("llama", tmp_path, seed=5)
    loaded = open_model(tmp_path, dtype=torch.bfloat16, device=CPU)
    module = loaded.module
    chosen = module.kernels
    module.use_kernels(chosen)  # the same choice again: nothing to do
    assert module.kernels is chosen
    other = attrs.evolve(chosen, attention="matmul")
    with pytest.raises(RuntimeError, match=r"kernels are chosen once: it computes with '.*'"):
        module.use_kernels(other)
    assert module.kernels is chosen
    with pytest.raises(
        RuntimeError, match=r"cannot load 'model.norm.weight': the kernels are chosen"
    ):
        module.load_weight("model.norm.weight", torch.ones(64))


def test_float32_weights_are_packed_only_when_transformers_arithmetic_is_not_asked() -> None:
    """float32 keeps MKL's products, transformers' own (bit for bit on SmolLM2), by default."""
    assert not can_pack(torch.float32, CPU)
    assert can_pack(torch.float32, CPU, exact=False) == torch.backends.mkldnn.is_available()
    assert not can_pack(torch.float16, CPU)
    assert not can_pack(torch.float16, CPU, exact=False)
    assert not can_pack(torch.bfloat16, torch.device("cuda", 0))
    assert not can_pack(torch.float32, torch.device("cuda", 0), exact=False)
    assert not can_pack(torch.bfloat16, torch.device("meta"))
    exact = select_kernels(_config(), dtype=torch.float32, device=CPU, exact=True)
    assert exact.projection == Projections("dense", "dense")


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 70),
    in_features=st.integers(1, 80),
    out_features=st.integers(1, 80),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_packed_float32_projection_is_f_linear_to_rounding(
    rows: int, in_features: int, out_features: int, bias: bool, seed: int
) -> None:
    """Random shapes: batches below, at and above the packing's batch hint of 32."""
    if not can_pack(torch.float32, CPU, exact=False):
        pytest.skip("oneDNN cannot pack float32 weights on this machine")
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    linear = Linear(in_features, out_features, bias=bias, dtype=torch.float32, device=CPU)
    with torch.inference_mode():
        linear.weight.copy_(weight)
        if linear.bias is not None and b is not None:
            linear.bias.copy_(b)
        linear.convert("onednn")
        out = linear(x)
    expected = F.linear(x, weight, b)
    assert isinstance(linear.method, OneDNNWeight)
    assert out.shape == expected.shape
    # Rounding errors add up term by term: they scale with the sum of the terms' sizes.
    terms = x.abs() @ weight.abs().T + (0 if b is None else b.abs())
    assert ((out - expected).abs() <= 1e-5 * terms + 1e-6).all()


@pytest.mark.parametrize("tied", [False, True])
def test_packed_float32_weights_compute_what_dense_weights_do_to_rounding(
    tied: bool, tmp_path: Path
) -> None:
    """oneDNN's packed float32 products (``exact=False``, ``dtype="auto"``) against MKL's."""
    if not can_pack(torch.float32, CPU, exact=False):
        pytest.skip("oneDNN cannot pack float32 weights on this machine")
    make_tiny_model("llama", tmp_path, seed=5, tie_word_embeddings=tied)
    dense = open_model(tmp_path, dtype=torch.float32, device=CPU)
    packed = open_model(tmp_path, dtype=torch.float32, device=CPU, exact=False)
    assert dense.module.kernels.projection == Projections("dense", "dense")
    assert packed.module.kernels.projection == Projections("onednn", "onednn")
    sequences = random_sequences([3, 17], seed=6)
    expected = dense.module.forward_logits(sequences, chunk_size=4)
    for ours, theirs in zip(
        packed.module.forward_logits(sequences, chunk_size=4), expected, strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_quantized_projections_stay_quantized_when_the_rest_is_packed(tmp_path: Path) -> None:
    """fp16 weights with ``exact=False``: the output projection is packed, the others not."""
    if not can_pack(torch.float32, CPU, exact=False):
        pytest.skip("oneDNN cannot pack float32 weights on this machine")
    make_tiny_model("llama", tmp_path, seed=5, tie_word_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantizationUnavailable)
        loaded = open_model(
            tmp_path, dtype=torch.float32, device=CPU, exact=False, quantization="fp16"
        )
    if loaded.quantization is None:
        pytest.skip("fbgemm's fp16 kernel does not run here")
    assert loaded.module.kernels.projection == Projections("fp16", "onednn")
    layer = loaded.module.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.method, QuantizedWeight)
    assert isinstance(loaded.module.lm_head.method, OneDNNWeight)
