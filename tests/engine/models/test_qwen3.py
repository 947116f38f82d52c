"""Qwen3 against transformers and llama.cpp: per-head q/k norms, and YaRN (also Qwen2's)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.engine.models import parity
from twostroke.engine.models.config import ModelConfig, RopeScaling
from twostroke.engine.models.loading import LoadedModel, open_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: YaRN over a trained context of 256 positions: the ramp falls inside the 8 frequencies of
#: a 16-wide head, so interpolated, blended and kept frequencies all occur.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
}
VARIANTS = {
    "plain": {},
    "yarn": {"rope_parameters": YARN, "max_position_embeddings": 1024},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def qwen3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    reference = parity.make_model(
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        path,
        head_dim=16,
        **VARIANTS[request.param],
    )
    return reference, path, open_model(path, dtype=torch.float32, device=parity.CPU)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_logits_match_transformers(
    qwen3: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = qwen3
    assert loaded.config.qk_norm == "head"
    parity.check_logits(reference, loaded, chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_greedy_tokens_match_transformers(
    qwen3: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = qwen3
    parity.check_greedy(reference, loaded, chunk_size)


def test_bfloat16_tracks_float32(qwen3: tuple[Any, Path, LoadedModel]) -> None:
    _, path, loaded = qwen3
    parity.check_bfloat16(path, loaded)


@pytest.mark.parametrize(("matrices", "exact"), [("f32", True), ("q8_0", True), ("q8_0", False)])
def test_logits_match_llamacpp(
    qwen3: tuple[Any, Path, LoadedModel], matrices: str, exact: bool, tmp_path: Path
) -> None:
    reference, _, _ = qwen3
    parity.check_llamacpp(reference, "qwen3", tmp_path, matrices, exact=exact)


def test_qwen2_reads_yarn_and_matches_transformers(tmp_path: Path) -> None:
    """Qwen2's YaRN is the same rule (its config.json in transformers 4's layout here)."""
    reference = parity.make_model(
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        tmp_path,
        rope_parameters=YARN,
        max_position_embeddings=1024,
    )
    loaded = open_model(tmp_path, dtype=torch.float32, device=parity.CPU)
    assert loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling.kind == "yarn"
    parity.check_logits(reference, loaded, 3)


def test_yarn_is_read_from_either_config_layout() -> None:
    base = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 131072,
    }
    legacy = {**base, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    legacy["rope_scaling"]["original_max_position_embeddings"] = 32768
    config = ModelConfig.from_hf_config(legacy)
    assert config.rope_scaling == RopeScaling(
        kind="yarn",
        factor=4.0,
        original_max_position_embeddings=32768,
        attention_factor=0.1 * math.log(4.0) + 1.0,
    )
    assert config.qk_norm == "head"
    assert config.departures == ()  # the stack computes the heads' norms


def test_yarn_from_gguf_metadata() -> None:
    metadata = {
        "general.architecture": "qwen3",
        "qwen3.embedding_length": 8,
        "qwen3.feed_forward_length": 8,
        "qwen3.block_count": 1,
        "qwen3.attention.head_count": 2,
        "qwen3.context_length": 131072,
        "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3.rope.scaling.type": "yarn",
        "qwen3.rope.scaling.factor": 4.0,
        "qwen3.rope.scaling.original_context_length": 32768,
        "tokenizer.ggml.token_count": 8,
    }
    config = ModelConfig.from_gguf_metadata(metadata, ["output.weight"])
    assert config.architecture == "Qwen3ForCausalLM"
    assert config.rope_scaling is not None
    assert config.rope_scaling.kind == "yarn"
    assert config.rope_scaling.original_max_position_embeddings == 32768
    with pytest.raises(
        ValueError, match=r"unsupported rope scaling 'longrope'; supported: .*'yarn'"
    ):
        ModelConfig.from_gguf_metadata(
            {**metadata, "qwen3.rope.scaling.type": "longrope"}, ["output.weight"]
        )


def test_the_plan_keeps_the_stack_for_the_heads_norms() -> None:
    """The compiled stack computes Qwen3's per-head q/k norms: no departure turns it off
    (where it is off here, the line says another reason: no bfloat16 panels on this CPU)."""
    from twostroke.engine.models.choice import select_kernels

    config = ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        qk_norm="head",
    )
    kernels = select_kernels(config, dtype=torch.bfloat16, device=parity.CPU, exact=False)
    line = kernels.describe()
    assert "Llama's layer" not in line
    assert (kernels.stack is not None) == ("stack compiled" in line)


def test_the_fastest_plan_runs_the_stack_where_it_builds(
    qwen3: tuple[Any, Path, LoadedModel],
) -> None:
    """Its layers' norms are in the compiled stack; tests/engine/kernels/test_stack.py holds
    the stack to the per-layer path bit for bit on a Qwen3."""
    _, path, _ = qwen3
    loaded = open_model(path, dtype=torch.bfloat16, device=parity.CPU, exact=False)
    assert "Llama's layer" not in loaded.plan.describe()
    assert (loaded.module.stack is not None) == ("stack compiled" in loaded.plan.describe())
