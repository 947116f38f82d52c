"""The shape table: every real shape's config.json is one transformers' own class accepts,
with the fields the models ship."""

from __future__ import annotations

import warnings

import pytest

from twostroke.engine.synthetic.shapes import (
    SHAPES,
    SMOLLM2_VOCAB_SIZE,
    TEST_SHAPES,
    UnknownShape,
    shape_named,
)

transformers = pytest.importorskip("transformers")

REQUIRED = (
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "llama-3.2-1b",
    "gemma-3-1b",
    "phi-4-mini",
    "olmoe-1b-7b",
    "qwen3-30b-a3b",
)


def test_the_issue_s_shapes_are_there() -> None:
    assert set(REQUIRED) <= set(SHAPES)


@pytest.mark.parametrize("name", [*SHAPES, *TEST_SHAPES])
def test_transformers_accepts_each_config(name: str) -> None:
    shape = shape_named(name)
    fields = shape.hf_config(bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = transformers.AutoConfig.for_model(**fields)
    assert (
        type(config).__name__
        == {
            "llama": "LlamaConfig",
            "qwen3": "Qwen3Config",
            "gemma3": "Gemma3TextConfig",
            "phi3": "Phi3Config",
            "qwen3moe": "Qwen3MoeConfig",
            "olmoe": "OlmoeConfig",
        }[shape.family]
    )
    assert config.vocab_size == SMOLLM2_VOCAB_SIZE
    assert config.hidden_size == shape.hidden_size
    assert config.intermediate_size == shape.intermediate_size
    assert config.num_hidden_layers == shape.num_layers
    assert config.num_attention_heads == shape.num_heads
    assert config.num_key_value_heads == shape.num_kv_heads
    assert config.tie_word_embeddings is shape.tied
    assert config.rope_parameters is not None
    if shape.num_experts:
        assert config.num_experts == shape.num_experts
        assert config.num_experts_per_tok == shape.experts_per_token


def test_real_sizes() -> None:
    """A few figures of the real models' configs, which a slip in the table would change."""
    assert SHAPES["qwen3-4b"].head_dim == 128
    assert SHAPES["qwen3-4b"].num_layers == 36
    assert SHAPES["llama-3.2-1b"].config["rope_scaling"]["rope_type"] == "llama3"
    gemma = SHAPES["gemma-3-1b"]
    assert gemma.head_dim == 256
    assert gemma.config["sliding_window"] == 512
    assert gemma.config["layer_types"].count("full_attention") == 4  # layers 6, 12, 18, 24
    phi = SHAPES["phi-4-mini"]
    assert len(phi.config["rope_scaling"]["long_factor"]) == 48  # 0.75 * 128 / 2
    assert phi.config["partial_rotary_factor"] == 0.75


def test_unknown_shape_names_the_rule_and_the_value() -> None:
    with pytest.raises(UnknownShape, match=r"must be one of qwen3-0\.6b, .*; got 'qwen9'"):
        shape_named("qwen9")


def test_real_sizes_of_the_mixtures() -> None:
    """OLMoE-1B-7B's and Qwen3-30B-A3B's figures, as their config.json files give them."""
    olmoe = SHAPES["olmoe-1b-7b"]
    assert (olmoe.num_layers, olmoe.hidden_size, olmoe.num_heads, olmoe.num_kv_heads) == (
        16,
        2048,
        16,
        16,
    )
    assert (olmoe.num_experts, olmoe.experts_per_token, olmoe.expert_intermediate_size) == (
        64,
        8,
        1024,
    )
    assert olmoe.config["norm_topk_prob"] is False
    assert not olmoe.tied
    qwen = SHAPES["qwen3-30b-a3b"]
    assert (qwen.num_layers, qwen.hidden_size, qwen.num_heads, qwen.num_kv_heads) == (
        48,
        2048,
        32,
        4,
    )
    assert qwen.head_dim == 128
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_intermediate_size) == (
        128,
        8,
        768,
    )
    assert qwen.config["norm_topk_prob"] is True
    assert qwen.config["mlp_only_layers"] == []
    assert SHAPES["qwen3-4b"].num_experts == 0


def test_a_shape_s_first_layers() -> None:
    """``NAME@N``: the first N layers, every other field the real model's."""
    whole = shape_named("qwen3-30b-a3b")
    part = shape_named("qwen3-30b-a3b@12")
    assert part.name == "qwen3-30b-a3b@12"
    assert part.num_layers == 12
    assert part.source == "Qwen/Qwen3-30B-A3B/config.json, its first 12 layers"
    assert {**part.config, "num_hidden_layers": 48} == dict(whole.config)
    gemma = shape_named("gemma-3-1b@7")
    local, full = "sliding_attention", "full_attention"
    assert gemma.config["layer_types"] == [local, local, local, local, local, full, local]
    assert shape_named("test-olmoe@2").config == shape_named("test-olmoe").config


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("qwen3-30b-a3b@0", r"must be in \[1, 48\] for qwen3-30b-a3b, got 0 in 'qwen3-30b-a3b@0'"),
        ("test-olmoe@3", r"must be in \[1, 2\] for test-olmoe, got 3 in 'test-olmoe@3'"),
    ],
)
def test_a_layer_count_out_of_range_names_the_rule(name: str, match: str) -> None:
    with pytest.raises(UnknownShape, match=match):
        shape_named(name)


def test_an_unknown_shape_with_layers_names_the_whole_name() -> None:
    with pytest.raises(UnknownShape, match=r"got 'qwen9@4'"):
        shape_named("qwen9@4")
    with pytest.raises(UnknownShape, match=r"got 'qwen3-4b@four'"):
        shape_named("qwen3-4b@four")
