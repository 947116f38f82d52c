"""Mixtral against transformers and llama.cpp: Llama's attention, a mixture of experts in
place of every layer's MLP (issue 51), loaded under its checkpoint's own names
(``block_sparse_moe``, ``w1``/``w2``/``w3``) and from llama.cpp's form (a ``llama`` file with
expert tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from tests.engine.models import parity
from tests.engine.models.llamacpp_reference import write_gguf
from twostroke.engine.models.experts import SparseMoE
from twostroke.engine.models.forms import BlockWeight
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


def test_q8_0_requantizes_the_attention_and_the_experts(
    mixtral: tuple[Any, Path, LoadedModel],
) -> None:
    """quantization="q8_0" on the checkpoint: the attention's projections and every expert
    in Q8_0 blocks (read through the checkpoint's names: the experts' w1, w3 and w2), the
    router dense; logits within 5 % of float32's at every position but at most one a
    sequence, where rounding moves a token to another expert of a near tie (measured: one
    position of 25, 0.21 against a bound of 0.16, the others within 0.10; a weight read
    wrongly costs every position)."""
    _, path, loaded = mixtral
    blocks = open_model(path, dtype=torch.float32, device=parity.CPU, quantization="q8_0")
    assert "weights q8_0, experts in q8_0 blocks" in blocks.plan.describe()
    for layer in blocks.module.layers:
        mlp = layer.mlp
        assert isinstance(mlp, SparseMoE)
        assert mlp.forms is not None
        assert mlp.gate_up.numel() == mlp.down.numel() == 0
        assert all(isinstance(form, BlockWeight) for forms in mlp.forms for form in forms)
    sequences = parity.random_sequences([5, 20])
    for ours, exact in zip(
        blocks.module.forward_logits(sequences),
        loaded.module.forward_logits(sequences),
        strict=True,
    ):
        off = (ours - exact).abs().max(dim=-1).values > 0.05 * exact.abs().max()
        assert int(off.sum()) <= 1, off.nonzero().flatten().tolist()


def test_a_q8_0_file_keeps_its_experts_as_stored(
    mixtral: tuple[Any, Path, LoadedModel], tmp_path: Path
) -> None:
    """llama.cpp's form (a llama with expert tensors, q/k rows permuted) in Q8_0, computed
    as stored by float32 activations: every expert a view of the file's blocks, the logits
    within 1e-4 of the dequantized file's (float32 rounding of the sums)."""
    reference, _, _ = mixtral
    path = tmp_path / "mixtral-q8_0.gguf"
    write_gguf(path, reference, "llama", matrices="q8_0")
    stored = open_model(path, dtype=torch.float32, device=parity.CPU, quantization="gguf_f32")
    assert "weights gguf_f32, experts as stored (Q8_0)" in stored.plan.describe()
    exps = stored.plan.source.tensors["blk.1.ffn_down_exps.weight"].data
    mlp = stored.module.layers[1].mlp
    assert isinstance(mlp, SparseMoE)
    assert mlp.forms is not None
    for expert, (_, down) in enumerate(mlp.forms):
        [part] = down.parts
        assert np.shares_memory(part.data, exps)
        assert part.address == exps.__array_interface__["data"][0] + expert * part.nbytes
    dequantized = open_model(path, dtype=torch.float32, device=parity.CPU)
    sequences = parity.random_sequences([5, 20])
    for ours, plain in zip(
        stored.module.forward_logits(sequences, chunk_size=4),
        dequantized.module.forward_logits(sequences),
        strict=True,
    ):
        torch.testing.assert_close(ours, plain, atol=1e-4, rtol=0)


def test_logits_match_llamacpp_f32(tmp_path: Path) -> None:
    """The F32 file (a llama with expert tensors, q/k rows permuted) within 1e-3 of
    llama.cpp's logits."""
    reference = parity.make_model(
        transformers.MixtralConfig, transformers.MixtralForCausalLM, tmp_path / "hf", **MOE
    )
    parity.check_llamacpp(reference, "llama", tmp_path, "f32", exact=True)
