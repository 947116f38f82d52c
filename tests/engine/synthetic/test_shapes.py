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

REQUIRED = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "llama-3.2-1b", "gemma-3-1b", "phi-4-mini")


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
        }[shape.family]
    )
    assert config.vocab_size == SMOLLM2_VOCAB_SIZE
    assert config.hidden_size == shape.hidden_size
    assert config.intermediate_size == shape.intermediate_size
    assert config.num_hidden_layers == shape.num_layers
    assert config.num_attention_heads == shape.num_heads
    assert config.num_key_value_heads == shape.num_kv_heads
    assert config.tie_word_embeddings is True
    assert config.rope_parameters is not None


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
