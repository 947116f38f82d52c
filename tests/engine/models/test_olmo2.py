"""OLMo 2 against transformers and llama.cpp: norms after attention and MLP, q/k norms over the
whole projection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.engine.models import parity
from twostroke.engine.models.loading import LoadedModel, open_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIELDS: dict[str, Any] = {}


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("olmo2")
    reference = parity.make_model(
        transformers.Olmo2Config, transformers.Olmo2ForCausalLM, path, **FIELDS
    )
    return reference, path, open_model(path, dtype=torch.float32, device=parity.CPU)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_logits_match_transformers(
    olmo2: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = olmo2
    assert loaded.config.norm_placement == "post"
    assert loaded.config.qk_norm == "full"
    parity.check_logits(reference, loaded, chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_greedy_tokens_match_transformers(
    olmo2: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = olmo2
    parity.check_greedy(reference, loaded, chunk_size)


def test_bfloat16_tracks_float32(olmo2: tuple[Any, Path, LoadedModel]) -> None:
    _, path, loaded = olmo2
    parity.check_bfloat16(path, loaded)


@pytest.mark.parametrize(("matrices", "exact"), [("f32", True), ("q8_0", True), ("q8_0", False)])
def test_logits_match_llamacpp(
    olmo2: tuple[Any, Path, LoadedModel], matrices: str, exact: bool, tmp_path: Path
) -> None:
    reference, _, _ = olmo2
    parity.check_llamacpp(reference, "olmo2", tmp_path, matrices, exact=exact)


def test_the_fastest_plan_runs_the_layers_one_by_one(olmo2: tuple[Any, Path, LoadedModel]) -> None:
    _, path, _ = olmo2
    parity.check_plan(path)
