"""Mixtral against transformers and llama.cpp: Llama's attention, a mixture of experts in
place of every layer's MLP (issue 51), loaded under its checkpoint's own names
(``block_sparse_moe``, ``w1``/``w2``/``w3``) and from llama.cpp's form (a ``llama`` file with
expert tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.engine.models import parity
from twostroke.engine.models.experts import SparseMoE
from twostroke.engine.models.loading import LoadedModel, open_model
from twostroke.engine.models.mixtral import MixtralForCausalLM, checkpoint_name, shared_name

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: 4 experts, 2 a token, each as wide as intermediate_size.
MOE: dict[str, Any] = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("mixtral")
    reference = parity.make_model(
        transformers.MixtralConfig, transformers.MixtralForCausalLM, path, **MOE
    )
    # Decisive routers: a tiny random model's near ties would let rounding (q8_0) move
    # tokens between experts, which is not what the quantization test is about.
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.mlp.gate.weight.mul_(20.0)
    reference.save_pretrained(path)
    return reference, path, open_model(path, dtype=torch.float32, device=parity.CPU)


def test_the_checkpoint_is_read_under_its_own_names(
    mixtral: tuple[Any, Path, LoadedModel],
) -> None:
    """save_pretrained writes block_sparse_moe.experts.<n>.w1/w2/w3 and the router as
    block_sparse_moe.gate: every one is expected, and none is missing after the load."""
    _, path, loaded = mixtral
    assert isinstance(loaded.module, MixtralForCausalLM)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in loaded.module.layers)
    with safe_open(str(path / "model.safetensors"), "pt") as stored:
        names = set(stored.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert set(loaded.module.expected_weights()) == names
    assert loaded.module.missing_weights() == []
    config = loaded.config
    assert (config.num_experts, config.experts_per_token, config.expert_intermediate_size) == (
        4,
        2,
        32,
    )
    assert config.normalize_expert_weights


def test_names_translate_both_ways() -> None:
    own = "model.layers.7.block_sparse_moe.experts.2.w3.weight"
    assert shared_name(own) == "model.layers.7.mlp.experts.2.up_proj.weight"
    assert checkpoint_name(shared_name(own)) == own
    router = "model.layers.0.block_sparse_moe.gate.weight"
    assert checkpoint_name(shared_name(router)) == router
    for other in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        assert shared_name(other) == checkpoint_name(other) == other


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_logits_match_transformers(
    mixtral: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = mixtral
    parity.check_logits(reference, loaded, chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_greedy_tokens_match_transformers(
    mixtral: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = mixtral
    parity.check_greedy(reference, loaded, chunk_size)


def test_q8_0_requantizes_the_attention_and_keeps_the_experts(
    mixtral: tuple[Any, Path, LoadedModel],
) -> None:
    """quantization="q8_0" on the checkpoint: the attention's projections in blocks (read
    through the checkpoint's names), the experts dense; logits within 5 % of float32's at
    every position but at most one a sequence, where rounding moves a token to another
    expert of a near tie (as test_qwen3_moe.py measured; a weight read wrongly costs every
    position)."""
    _, path, loaded = mixtral
    blocks = open_model(path, dtype=torch.float32, device=parity.CPU, quantization="q8_0")
    sequences = parity.random_sequences([5, 20])
    for ours, exact in zip(
        blocks.module.forward_logits(sequences),
        loaded.module.forward_logits(sequences),
        strict=True,
    ):
        assert (ours - exact).abs().max() < 0.05 * exact.abs().max()


def test_logits_match_llamacpp_f32(tmp_path: Path) -> None:
    """The F32 file (a llama with expert tensors, q/k rows permuted) within 1e-3 of
    llama.cpp's logits."""
    reference = parity.make_model(
        transformers.MixtralConfig, transformers.MixtralForCausalLM, tmp_path / "hf", **MOE
    )
    parity.check_llamacpp(reference, "llama", tmp_path, "f32", exact=True)
