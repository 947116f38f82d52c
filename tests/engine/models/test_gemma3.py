"""Gemma 3 against transformers and llama.cpp: interleaved sliding-window and global layers
with their own rotary bases, four (1 + weight) norms a layer and per-head q/k norms, a
gelu-tanh MLP, embeddings times sqrt(hidden_size), query_pre_attn_scalar, logit capping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.engine.models import parity
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.loading import LoadedModel, open_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: The global layers' rotary stretched (linear, as Gemma 3 4B's), the local ones' unscaled
#: by a base of their own.
ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
VARIANTS: dict[str, dict[str, Any]] = {
    # Every feature transformers reads: a global layer between local ones, windows of 6
    # positions on prompts of up to 40, a score scale that is not head_dim's, capped logits,
    # an untied output projection.
    "transformers": {
        "num_hidden_layers": 4,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ],
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 20.0,
        "tie_word_embeddings": False,
    },
    # What a GGUF file can say: llama.cpp's gemma3 takes every sixth layer as global and
    # head_dim as query_pre_attn_scalar (both its constants), and a tied output projection.
    "llamacpp": {"num_hidden_layers": 6, "query_pre_attn_scalar": 16},
}


def build(variant: str, factory: pytest.TempPathFactory) -> tuple[Any, Path, LoadedModel]:
    path = factory.mktemp(f"gemma3-{variant}")
    reference = parity.make_model(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        path,
        norms=(-0.5, 0.5),
        head_dim=16,
        sliding_window=6,
        rope_parameters=ROPE,
        **VARIANTS[variant],
    )
    return reference, path, open_model(path, dtype=torch.float32, device=parity.CPU)


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The variant a GGUF file can describe (its layer kinds and score scale)."""
    return build("llamacpp", tmp_path_factory)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_logits_match_transformers(
    gemma3: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = gemma3
    config = loaded.config
    assert (config.sliding_window, config.local_rope_theta, config.norm_offset) == (6, 1e4, 1.0)
    assert config.global_layers == tuple(
        i for i, kind in enumerate(reference.config.layer_types) if kind == "full_attention"
    )
    parity.check_logits(reference, loaded, chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_greedy_tokens_match_transformers(
    gemma3: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = gemma3
    parity.check_greedy(reference, loaded, chunk_size)


def test_bfloat16_tracks_float32(gemma3: tuple[Any, Path, LoadedModel]) -> None:
    _, path, loaded = gemma3
    parity.check_bfloat16(path, loaded)


def test_the_fastest_plan_runs_the_layers_one_by_one(
    gemma3: tuple[Any, Path, LoadedModel],
) -> None:
    _, path, _ = gemma3
    parity.check_plan(path)
    loaded = open_model(path, dtype=torch.bfloat16, device=parity.CPU, exact=False)
    line = loaded.plan.describe()
    if "glue compiled" in line:  # (where the compiled glue builds) it says what it leaves
        assert "its (offset + weight) norms and its gelu_tanh MLP as torch's operators" in line


@pytest.mark.parametrize(("matrices", "exact"), [("f32", True), ("q8_0", True), ("q8_0", False)])
def test_logits_match_llamacpp(
    gemma3_gguf: tuple[Any, Path, LoadedModel], matrices: str, exact: bool, tmp_path: Path
) -> None:
    reference, _, _ = gemma3_gguf
    # ggml's float32 GELU rounds its input to float16 and reads a table (GGML_GELU_FP16):
    # up to 4e-3 of each value; 1.3e-3 on these logits, measured.
    parity.check_llamacpp(reference, "gemma3", tmp_path, matrices, exact=exact, f32_bound=3e-3)


def test_the_gguf_file_reads_as_the_checkpoint(
    gemma3_gguf: tuple[Any, Path, LoadedModel], tmp_path: Path
) -> None:
    """The GGUF reading of the llama.cpp variant is its config.json's, but for the norms'
    offset (the file stores weight + 1), and computes the same logits."""
    from tests.engine.models.llamacpp_reference import write_gguf
    from tests.engine.models.test_llama import random_sequences

    reference, _, loaded = gemma3_gguf
    path = tmp_path / "gemma3.gguf"
    write_gguf(path, reference, "gemma3")
    from_file = open_model(path, dtype=torch.float32, device=parity.CPU)
    ignored = ("bos_token_id", "eos_token_ids", "norm_offset", "rms_norm_eps")
    theirs = {k: v for k, v in from_file.config.to_dict().items() if k not in ignored}
    ours = {k: v for k, v in loaded.config.to_dict().items() if k not in ignored}
    assert theirs == ours
    assert from_file.config.norm_offset == 0.0
    assert from_file.config.rms_norm_eps == pytest.approx(1e-6)  # a float32 in the file
    sequences = random_sequences([30], seed=3)
    [mine] = from_file.module.forward_logits(sequences, chunk_size=4)
    [expected] = loaded.module.forward_logits(sequences, chunk_size=4)
    torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)


def test_the_synthetic_shape_loads_and_runs(tmp_path: Path) -> None:
    """``twostroke synthesize``'s tiny Gemma 3 (llama.cpp's layout, norms shifted by one)
    loads from its GGUF file and from its Hugging Face folder alike, and both compute the
    same logits."""
    from twostroke.engine.artifacts.cache import ArtifactCache
    from twostroke.engine.synthetic.cached import synthetic_model

    cache = ArtifactCache(tmp_path / "cache")
    file = open_model(
        synthetic_model("test-gemma3", "gguf", "f16", cache=cache),
        dtype=torch.float32,
        device=parity.CPU,
    )
    folder = open_model(
        synthetic_model("test-gemma3", "hf", "float32", cache=cache),
        dtype=torch.float32,
        device=parity.CPU,
    )
    for loaded in (file, folder):
        assert loaded.config.architecture == "Gemma3ForCausalLM"
        assert loaded.config.sliding_window == 8
    tokens = [[5, 17, 300, 2, 9, 41, 8, 77, 3, 12, 6, 1000]]
    [a] = file.module.forward_logits(tokens, chunk_size=5)
    [b] = folder.module.forward_logits(tokens, chunk_size=5)
    assert torch.isfinite(a).all()
    # F16 matrices against the float32 folder's: rounding of the weights only.
    assert (a - b).abs().max() < 0.02 * b.abs().max()


GEMMA3_JSON: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 8,
    "hidden_size": 16,
    "intermediate_size": 8,
    "num_hidden_layers": 7,
    "num_attention_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "sliding_window": 4,
    "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
}


def test_the_older_config_layout_is_read_as_transformers_reads_it() -> None:
    """transformers 4's keys: rope_local_base_freq, sliding_window_pattern (default 6),
    and Gemma3TextConfig's defaults for what the file leaves out."""
    config = ModelConfig.from_hf_config(GEMMA3_JSON)
    assert config.global_layers == (5,)
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.attention_scale == 256**-0.5  # query_pre_attn_scalar's default
    assert config.embedding_scale == 4.0
    assert config.tie_word_embeddings
    pattern = ModelConfig.from_hf_config({**GEMMA3_JSON, "sliding_window_pattern": 2})
    assert pattern.global_layers == (1, 3, 5)
    # A window as long as the context still names the layers that rotate by the local base.
    long = ModelConfig.from_hf_config({**GEMMA3_JSON, "sliding_window": 64})
    assert (long.sliding_window, long.global_layers) == (64, (5,))
    assert config.departures == (
        "norms before and after attention and MLP",
        "(offset + weight) norms in float32",
        "a gelu_tanh MLP",
        "a rotary base of its own in its sliding-window layers",
        "an attention scale of its own",
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_activation", "gelu", r"hidden_activation must be 'gelu_pytorch_tanh', got 'gelu'"),
        (
            "use_bidirectional_attention",
            True,
            r"use_bidirectional_attention must be false: twostroke decodes causally",
        ),
        ("sliding_window", None, r"the configuration lacks 'sliding_window'"),
        (
            "rope_parameters",
            {"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
            r"rope_parameters\['sliding_attention'\] must rotate unscaled \(rope_type "
            r"'default'\), got 'linear'",
        ),
    ],
)
def test_what_twostroke_does_not_compute_is_refused(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**GEMMA3_JSON, field: value})


def test_a_local_base_needs_a_window() -> None:
    config = ModelConfig.from_hf_config(GEMMA3_JSON)
    with pytest.raises(
        ValueError,
        match=r"local_rope_theta is the sliding-window layers' rotary base, and there is no "
        r"sliding window: got local_rope_theta=10000.0 and sliding_window=None",
    ):
        config.from_dict({**config.to_dict(), "sliding_window": None, "global_layers": []})


def test_scores_capped_as_gemma2_caps_them_are_read() -> None:
    """transformers' Gemma 3 caps its scores as Gemma 2 does where the config asks (none of
    Google's do): the plan then attends with a kernel that caps them (test_gemma2)."""
    config = ModelConfig.from_hf_config({**GEMMA3_JSON, "attn_logit_softcapping": 50.0})
    assert config.attn_logit_softcapping == 50.0
