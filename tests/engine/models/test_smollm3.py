"""SmolLM3 against transformers and llama.cpp: layers without rotary embeddings (NoPE)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import transformers

from tests.engine.models import parity
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.loading import LoadedModel, open_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIELDS: dict[str, Any] = {"num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 1]}


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("smollm3")
    reference = parity.make_model(
        transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, path, **FIELDS
    )
    return reference, path, open_model(path, dtype=torch.float32, device=parity.CPU)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_logits_match_transformers(
    smollm3: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = smollm3
    assert loaded.config.nope_layers == (1,)
    parity.check_logits(reference, loaded, chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_greedy_tokens_match_transformers(
    smollm3: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = smollm3
    parity.check_greedy(reference, loaded, chunk_size)


def test_bfloat16_tracks_float32(smollm3: tuple[Any, Path, LoadedModel]) -> None:
    _, path, loaded = smollm3
    parity.check_bfloat16(path, loaded)


@pytest.mark.parametrize(("matrices", "exact"), [("f32", True), ("q8_0", True), ("q8_0", False)])
def test_logits_match_llamacpp(
    smollm3: tuple[Any, Path, LoadedModel], matrices: str, exact: bool, tmp_path: Path
) -> None:
    reference, _, _ = smollm3
    parity.check_llamacpp(reference, "smollm3", tmp_path, matrices, exact=exact)


def test_the_fastest_plan_runs_the_layers_one_by_one(
    smollm3: tuple[Any, Path, LoadedModel],
) -> None:
    _, path, _ = smollm3
    parity.check_plan(path)


def test_the_nope_layers_of_config_json_and_of_gguf() -> None:
    """``no_rope_layers`` flags 0 for NoPE; without it every ``no_rope_layer_interval``-th
    layer; a GGUF file every 4th (llama.cpp stores no key). The GGUF test above writes the
    transformers model's layer 1 as NoPE, which a ``smollm3`` file cannot say: llama.cpp and
    twostroke both take layer 3, so that comparison checks the file's rule, this one the
    reading."""
    base = {
        "architectures": ["SmolLM3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
    }
    assert ModelConfig.from_hf_config(base).nope_layers == (3, 7)
    assert ModelConfig.from_hf_config({**base, "no_rope_layer_interval": 2}).nope_layers == (
        1,
        3,
        5,
        7,
    )
    flags = {**base, "no_rope_layers": [1, 0, 1, 1, 1, 1, 0, 1]}
    assert ModelConfig.from_hf_config(flags).nope_layers == (1, 6)
    metadata = {
        "general.architecture": "smollm3",
        "smollm3.embedding_length": 8,
        "smollm3.feed_forward_length": 8,
        "smollm3.block_count": 8,
        "smollm3.attention.head_count": 2,
        "smollm3.context_length": 64,
        "smollm3.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.token_count": 8,
    }
    assert ModelConfig.from_gguf_metadata(metadata, ["output.weight"]).nope_layers == (3, 7)


def test_bad_nope_layers_name_the_rule() -> None:
    base = {
        "architectures": ["SmolLM3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
    }
    with pytest.raises(ValueError, match=r"no_rope_layers must be 2 flags of 0 or 1 .*\[1, 2\]"):
        ModelConfig.from_hf_config({**base, "no_rope_layers": [1, 2]})
    config = ModelConfig.from_hf_config(base)
    with pytest.raises(
        ValueError, match=r"nope_layers must be layer indices in \[0, 2\), got \[5\]"
    ):
        attrs.evolve(config, nope_layers=(5,))
