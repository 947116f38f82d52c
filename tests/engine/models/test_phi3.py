"""Phi-3 / Phi-4-mini against transformers and llama.cpp: fused qkv and gate/up tensors,
partial rotary embeddings, LongRoPE's short and long factors, a sliding window.

Which LongRoPE set a position takes: each token its own position's (short inside the original
context, long beyond; :func:`~twostroke.engine.models.layers.rotary_tables`). transformers
picks one set per forward call by the call's highest position, so the reference feeds it the
original context in one call and every later token in a call of its own (:func:`stepwise`):
each token then takes its own position's set there too. llama.cpp takes one set for its whole
context (long where the context passes the original one), so it is compared on a model that
stays inside the original context (short) and on one whose two sets are equal (long).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.engine.models import parity
from tests.engine.models.llamacpp_reference import write_gguf
from twostroke.engine.models.config import ModelConfig, RopeScaling
from twostroke.engine.models.layers import (
    inverse_frequencies,
    long_inverse_frequencies,
    rotary_attention_factor,
    rotary_tables,
)
from twostroke.engine.models.loading import LoadedModel, open_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: One factor per rotated pair: 16-wide heads, 0.75 of them rotated, 6 pairs.
SHORT = [1.0, 1.1, 1.3, 1.7, 2.0, 2.5]
LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]


def _longrope(short: list[float], long: list[float], share: float = 0.75) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": share,
        "short_factor": short,
        "long_factor": long,
    }


#: ``short``: every test sequence (40 at most) inside a trained context of 256 (llama.cpp's
#: context, which it rounds up to 256, too: it takes the short factors); ``long``: a
#: trained context of 16, which the 23- and 40-token sequences and the greedy runs pass, and
#: a sliding window of 13 shorter than them; ``long-only``: a context of 16 whose two sets of
#: factors are equal (so every position takes the long ones, as llama.cpp does with a
#: context past 16), half of each head rotated.
VARIANTS: dict[str, dict[str, Any]] = {
    "short": {
        "rope_parameters": _longrope(SHORT, LONG),
        "original_max_position_embeddings": 256,
        "max_position_embeddings": 1024,
    },
    "long": {
        "rope_parameters": _longrope(SHORT, LONG),
        "original_max_position_embeddings": 16,
        "max_position_embeddings": 64,
        "sliding_window": 13,
    },
    "long-only": {
        "rope_parameters": _longrope(LONG[:4], LONG[:4], share=0.5),
        "original_max_position_embeddings": 16,
        "max_position_embeddings": 64,
    },
}


def stepwise(reference: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' logits at every position: the original context in one call, then each
    token in a call of its own through its cache (so each takes its own position's factors)."""
    first = min(len(tokens), reference.config.rope_parameters["original_max_position_embeddings"])
    rows = []
    with torch.no_grad():
        out = reference(torch.tensor([tokens[:first]]), use_cache=True)
        rows.append(out.logits[0])
        for token in tokens[first:]:
            out = reference(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            rows.append(out.logits[0])
    return torch.cat(rows).float()


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp(f"phi3-{request.param}")
    reference = parity.make_model(
        transformers.Phi3Config, transformers.Phi3ForCausalLM, path, **VARIANTS[request.param]
    )
    return reference, path, open_model(path, dtype=torch.float32, device=parity.CPU)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_logits_match_transformers(
    phi3: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = phi3
    assert loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling.kind == "longrope"
    assert loaded.config.rotary_dim in (12, 8)
    parity.check_logits(reference, loaded, chunk_size, stepwise)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_greedy_tokens_match_transformers(
    phi3: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = phi3
    parity.check_greedy(reference, loaded, chunk_size, stepwise)


def test_bfloat16_tracks_float32(phi3: tuple[Any, Path, LoadedModel]) -> None:
    _, path, loaded = phi3
    parity.check_bfloat16(path, loaded)


def test_the_fastest_plan_runs_the_layers_one_by_one(phi3: tuple[Any, Path, LoadedModel]) -> None:
    _, path, _ = phi3
    parity.check_plan(path)
    plan = open_model(path, dtype=torch.bfloat16, device=parity.CPU, exact=False).plan
    assert "partial rotary embeddings" in plan.describe()


@pytest.mark.parametrize(("matrices", "exact"), [("f32", True), ("q8_0", True), ("q8_0", False)])
def test_logits_match_llamacpp(
    phi3: tuple[Any, Path, LoadedModel], matrices: str, exact: bool, tmp_path: Path
) -> None:
    reference, _, loaded = phi3
    if loaded.config.sliding_window is not None:
        # llama.cpp's phi3 ignores the window ("Phi SWA is currently disabled"), and takes
        # the long factors from position 0: test_gguf_reads_longrope_and_the_window
        # checks this file against transformers instead.
        return
    parity.check_llamacpp(reference, "phi3", tmp_path, matrices, exact=exact)


def test_gguf_reads_longrope_and_the_window(tmp_path: Path) -> None:
    """The GGUF file of the ``long`` model (its factors as tensors, its window and rotated
    width as keys) computes what transformers does, as the Hugging Face folder does."""
    reference = parity.make_model(
        transformers.Phi3Config, transformers.Phi3ForCausalLM, tmp_path, **VARIANTS["long"]
    )
    path = tmp_path / "phi3.gguf"
    write_gguf(path, reference, "phi3")
    loaded = open_model(path, dtype=torch.float32, device=parity.CPU)
    config = loaded.config
    assert config.architecture == "Phi3ForCausalLM"
    assert (config.sliding_window, config.rotary_dim) == (13, 12)
    assert config.rope_scaling is not None
    assert config.rope_scaling.short_factor == pytest.approx(SHORT)
    assert config.rope_scaling.long_factor == pytest.approx(LONG)
    parity.check_logits(reference, loaded, 5, stepwise)


def test_rotary_tables_equal_transformers_on_either_side_of_the_original_context() -> None:
    """Bit for bit: positions inside the trained context take transformers' short tables (a
    call whose positions stay inside), those beyond its long tables (a call of that position
    alone), each multiplied by LongRoPE's attention factor."""
    hf = transformers.Phi3Config(**{**parity.TINY, **VARIANTS["long"]})
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf)
    config = ModelConfig.from_hf_config({**hf.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    positions = torch.arange(40)
    long = long_inverse_frequencies(config)
    assert long is not None
    factor = rotary_attention_factor(config)
    short_cos, _ = rotary_tables(positions, inverse_frequencies(config), torch.float32, factor)
    cos, sin = rotary_tables(
        positions, inverse_frequencies(config), torch.float32, factor, (long, 16)
    )
    x = torch.zeros(1, 1, dtype=torch.float32)
    expected = [rotary(x, torch.arange(16)[None])]
    expected += [rotary(x, torch.tensor([[p]])) for p in range(16, 40)]
    want_cos = torch.cat([c[0] for c, _ in expected])
    want_sin = torch.cat([s[0] for _, s in expected])
    assert torch.equal(cos[:, 0], want_cos)
    half = want_sin.shape[-1] // 2
    assert torch.equal(sin[:, 0], torch.cat((-want_sin[:, :half], want_sin[:, half:]), dim=-1))
    # The long set starts at the original context, and differs from the short one there.
    assert torch.equal(cos[:16], short_cos[:16])
    assert not torch.equal(cos[16:], short_cos[16:])
    assert factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(16)))


def test_phi4_mini_config_reads_as_transformers_does() -> None:
    """Phi-4-mini's config.json (transformers 4's layout: ``rope_scaling``, a top-level
    original context and rotary share): 96 of 128 rotated, LongRoPE over 4096 positions of
    131072, no window (its 262144 passes the context)."""
    from twostroke.engine.synthetic.shapes import SHAPES

    # (the shape leaves the vocabulary to the tokenizer it is written with)
    config = ModelConfig.from_hf_config({**SHAPES["phi-4-mini"].config, "vocab_size": 200064})
    assert (config.head_dim, config.rotary_dim, config.sliding_window) == (128, 96, None)
    scaling = config.rope_scaling
    assert scaling is not None
    assert (scaling.kind, scaling.original_max_position_embeddings) == ("longrope", 4096)
    assert scaling.attention_factor == pytest.approx(
        math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))
    )
    assert len(scaling.long_factor) == 48
    assert config.departures == ("partial rotary embeddings",)
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_old_names_of_longrope_and_wrong_factor_counts() -> None:
    data = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "original_max_position_embeddings": 16,
        "partial_rotary_factor": 0.75,
        "attention_bias": True,  # transformers' Phi-3 has no biases whatever it says
        "rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG},
    }
    config = ModelConfig.from_hf_config(data)
    assert config.rope_scaling is not None
    assert config.rope_scaling.kind == "longrope"
    assert not config.qkv_bias
    assert not config.o_bias
    with pytest.raises(ValueError, match=r"longrope's factors must have rotary_dim / 2 = 8 .*6"):
        ModelConfig.from_hf_config({**data, "partial_rotary_factor": 1.0})
    with pytest.raises(ValueError, match=r"short_factor and long_factor of one length.* 6 and 5"):
        RopeScaling(kind="longrope", factor=4.0, short_factor=SHORT, long_factor=LONG[:5])
    with pytest.raises(ValueError, match=r"rotary_dim must be even .* head_dim = 16, got 7"):
        ModelConfig.from_hf_config({**data, "partial_rotary_factor": 0.45, "rope_scaling": None})
