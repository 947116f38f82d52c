"""Granite 3 against transformers and llama.cpp: embedding, attention and residual multipliers,
logits scaling."""

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

FIELDS: dict[str, Any] = {
    "embedding_multiplier": 3.0,
    "attention_multiplier": 0.2,
    "residual_multiplier": 0.5,
    "logits_scaling": 4.0,
}


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("granite")
    reference = parity.make_model(
        transformers.GraniteConfig, transformers.GraniteForCausalLM, path, **FIELDS
    )
    return reference, path, open_model(path, dtype=torch.float32, device=parity.CPU)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_logits_match_transformers(
    granite: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = granite
    assert loaded.config.attention_scale == FIELDS["attention_multiplier"]
    assert loaded.config.logit_scale == FIELDS["logits_scaling"]
    parity.check_logits(reference, loaded, chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_greedy_tokens_match_transformers(
    granite: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = granite
    parity.check_greedy(reference, loaded, chunk_size)


def test_bfloat16_tracks_float32(granite: tuple[Any, Path, LoadedModel]) -> None:
    _, path, loaded = granite
    parity.check_bfloat16(path, loaded)


@pytest.mark.parametrize(("matrices", "exact"), [("f32", True), ("q8_0", True), ("q8_0", False)])
def test_logits_match_llamacpp(
    granite: tuple[Any, Path, LoadedModel], matrices: str, exact: bool, tmp_path: Path
) -> None:
    reference, _, _ = granite
    parity.check_llamacpp(reference, "granite", tmp_path, matrices, exact=exact)


def test_the_fastest_plan_runs_the_layers_one_by_one(
    granite: tuple[Any, Path, LoadedModel],
) -> None:
    _, path, _ = granite
    parity.check_plan(path)


def test_granite_gguf_needs_its_four_scales() -> None:
    metadata = {
        "general.architecture": "granite",
        "granite.embedding_length": 8,
        "granite.feed_forward_length": 8,
        "granite.block_count": 1,
        "granite.attention.head_count": 2,
        "granite.context_length": 64,
        "granite.attention.layer_norm_rms_epsilon": 1e-6,
        "granite.embedding_scale": 12.0,
        "granite.attention.scale": 0.015625,
        "granite.residual_scale": 0.22,
        "tokenizer.ggml.token_count": 8,
    }
    with pytest.raises(ValueError, match=r"the configuration lacks 'granite.logit_scale'"):
        ModelConfig.from_gguf_metadata(metadata, ["output.weight"])
    config = ModelConfig.from_gguf_metadata(
        {**metadata, "granite.logit_scale": 8.0}, ["output.weight"]
    )
    assert (config.embedding_scale, config.attention_scale) == (12.0, 0.015625)
    assert (config.residual_scale, config.logit_scale) == (0.22, 8.0)
    assert config.departures == ("an attention scale of its own", "a residual scale")
