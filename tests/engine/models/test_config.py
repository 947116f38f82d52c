"""ModelConfig from transformers configs and GGUF metadata, and what it refuses."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import transformers

from twostroke.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling


def hf(config: Any, architecture: str, **overrides: Any) -> dict[str, Any]:
    return {**config.to_dict(), "architectures": [architecture], **overrides}


SMALL = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_llama_config() -> None:
    data = hf(transformers.LlamaConfig(**SMALL, eos_token_id=[5, 6]), "LlamaForCausalLM")
    config = ModelConfig.from_hf_config(data)
    assert (config.hidden_size, config.head_dim, config.num_kv_heads) == (32, 8, 2)
    assert config.eos_token_ids == (5, 6)
    assert config.rope_scaling is None
    assert not (config.qkv_bias)
    assert not (config.o_bias)
    assert not (config.mlp_bias)


def test_llama_attention_bias_covers_every_projection() -> None:
    data = hf(transformers.LlamaConfig(**SMALL, attention_bias=True), "LlamaForCausalLM")
    config = ModelConfig.from_hf_config(data)
    assert config.qkv_bias
    assert config.o_bias


def test_qwen2_has_qkv_bias_only() -> None:
    data = hf(transformers.Qwen2Config(**SMALL), "Qwen2ForCausalLM")
    config = ModelConfig.from_hf_config(data)
    assert config.qkv_bias
    assert not config.o_bias


def test_sliding_windows_are_read_per_layer_as_transformers_reads_them() -> None:
    """Mistral windows every layer and keeps its whole context; Qwen2 windows the layers from
    max_window_layers on where it asks; a layer_types list says per layer; a window as long
    as the context is none."""
    mistral = ModelConfig.from_hf_config(
        hf(
            transformers.MistralConfig(**SMALL, sliding_window=64, max_position_embeddings=4096),
            "MistralForCausalLM",
        )
    )
    assert (mistral.max_position_embeddings, mistral.sliding_window) == (4096, 64)
    assert [mistral.window_of(i) for i in range(mistral.num_layers)] == [64] * mistral.num_layers
    # (transformers writes sliding_window null where use_sliding_window is false.)
    qwen2 = hf(transformers.Qwen2Config(**SMALL), "Qwen2ForCausalLM") | {"sliding_window": 16}
    assert ModelConfig.from_hf_config(qwen2 | {"use_sliding_window": False}).sliding_window is None
    windowed = ModelConfig.from_hf_config(
        qwen2 | {"use_sliding_window": True, "max_window_layers": 1, "layer_types": None}
    )
    assert windowed.global_layers == (0,)
    assert windowed.window_of(0) is None
    assert windowed.window_of(1) == 16
    types = ["full_attention", "sliding_attention"] * (SMALL["num_hidden_layers"] // 2)
    listed = ModelConfig.from_hf_config(qwen2 | {"use_sliding_window": True, "layer_types": types})
    assert listed.global_layers == tuple(range(0, SMALL["num_hidden_layers"], 2))
    whole = qwen2 | {"use_sliding_window": True, "sliding_window": qwen2["max_position_embeddings"]}
    assert ModelConfig.from_hf_config(whole).sliding_window is None
    with pytest.raises(ValueError, match=r"layer_types must be 'sliding_attention' or 'full_"):
        ModelConfig.from_hf_config(
            qwen2 | {"use_sliding_window": True, "layer_types": ["x"] * len(types)}
        )
    with pytest.raises(ValueError, match=r"global_layers are the exceptions to a sliding window"):
        attrs.evolve(mistral, sliding_window=None, global_layers=(0,))


def test_transformers_4_rope_layout() -> None:
    data = hf(transformers.LlamaConfig(**SMALL), "LlamaForCausalLM")
    del data["rope_parameters"]
    data["rope_theta"] = 500000.0
    data["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = ModelConfig.from_hf_config(data)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            r"unsupported architecture \['GPT2LMHeadModel'\] \(twostroke lacks its learned "
            r"position embeddings and LayerNorm\); supported: LlamaForCausalLM, .*",
        ),
        (
            {"architectures": ["FalconH1ForCausalLM"]},
            r"unsupported architecture \['FalconH1ForCausalLM'\] \(twostroke lacks its hybrid "
            r"Mamba layers\); supported: " + ", ".join(SUPPORTED_ARCHITECTURES),
        ),
        (
            {"architectures": ["BrandNewForCausalLM"]},
            r"unsupported architecture \['BrandNewForCausalLM'\]; supported: LlamaForCausalLM, .*",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act must be 'silu' \(SwiGLU\), got 'gelu'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"unsupported rope_type 'dynamic'; supported: 'default', 'linear', 'llama3', 'yarn'",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
            r"the configuration lacks 'factor'",
        ),
        ({"hidden_size": None}, r"the configuration lacks 'hidden_size'"),
        (
            {"num_key_value_heads": 3},
            r"num_heads must be a multiple of num_kv_heads, got num_heads=4 and num_kv_heads=3",
        ),
        ({"vocab_size": 0}, r"vocab_size must be >= 1, got 0"),
        ({"rms_norm_eps": 0.0}, r"rms_norm_eps must be > 0, got 0.0"),
        # Divided by before the fields are checked: ZeroDivisionError once.
        ({"num_attention_heads": 0}, r"^num_attention_heads must be an int >= 1, got 0$"),
        ({"num_key_value_heads": 0}, r"^num_key_value_heads must be an int >= 1, got 0$"),
        ({"hidden_size": "32"}, r"^hidden_size must be an int >= 1, got '32'$"),
        (
            {"hidden_size": 30, "head_dim": None},
            r"^hidden_size must be a multiple of the head count without 'head_dim', got 30 "
            r"and 4 heads$",
        ),
    ],
)
def test_hf_config_errors(overrides: dict[str, Any], message: str) -> None:
    data = hf(transformers.LlamaConfig(**SMALL), "LlamaForCausalLM", **overrides)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(data)


GGUF = {
    "general.architecture": "llama",
    "general.name": "tiny",
    "llama.block_count": 2,
    "llama.context_length": 256,
    "llama.embedding_length": 32,
    "llama.feed_forward_length": 48,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.rope.freq_base": 100000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "tokenizer.ggml.tokens": ["a"] * 100,
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}


def test_gguf_metadata() -> None:
    config = ModelConfig.from_gguf_metadata(GGUF, ["token_embd.weight", "blk.0.attn_q.weight"])
    assert config.architecture == "LlamaForCausalLM"
    assert config.vocab_size == 100  # from the tokenizer when the key is absent
    assert config.tie_word_embeddings  # no output.weight
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert (config.head_dim, config.rope_theta) == (8, 100000.0)
    untied = ModelConfig.from_gguf_metadata(
        {**GGUF, "general.name": "Mistral 7B"}, ["output.weight", "blk.0.attn_q.bias"]
    )
    assert not untied.tie_word_embeddings
    assert untied.qkv_bias
    assert untied.architecture == "MistralForCausalLM"


def test_gguf_rope_frequency_factors_must_fit_the_head() -> None:
    factors = (1.0, 2.0, 4.0, 8.0)
    config = ModelConfig.from_gguf_metadata(GGUF, [], rope_frequency_factors=factors)
    assert config.rope_frequency_factors == factors
    with pytest.raises(
        ValueError,
        match=r"rope_frequency_factors must have head_dim / 2 = 4 "
        r"entries, got 2",
    ):
        ModelConfig.from_gguf_metadata(GGUF, [], rope_frequency_factors=(1.0, 2.0))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"general.architecture": "falcon"},
            r"unsupported GGUF architecture 'falcon'; supported: llama, qwen2",
        ),
        (
            {"llama.rope.scaling.type": "dynamic"},
            r"unsupported rope scaling 'dynamic'; supported: 'none', 'linear', 'yarn'",
        ),
        ({"llama.embedding_length": None}, r"the configuration lacks 'llama\.embedding_length'"),
        (
            {"tokenizer.ggml.tokens": None},
            r"GGUF metadata lacks llama\.vocab_size and tokenizer\.ggml\.tokens",
        ),
        (
            {"llama.attention.head_count": 0},
            r"^llama\.attention\.head_count must be an int >= 1, got 0$",
        ),
        (
            {"llama.attention.head_count": [4, 4]},  # per layer: llama.cpp's, not ours
            r"^llama\.attention\.head_count must be an int >= 1, got \[4, 4\]$",
        ),
        (
            {"llama.attention.key_length": 0},
            r"^llama\.attention\.key_length must be an int >= 1, got 0$",
        ),
        (
            {"llama.embedding_length": 30},
            r"^embedding_length must be a multiple of the head count without "
            r"'llama\.attention\.key_length', got 30 and 4 heads$",
        ),
    ],
)
def test_gguf_metadata_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_gguf_metadata({**GGUF, **overrides}, [])


def _llama(**overrides: Any) -> ModelConfig:
    data = hf(transformers.LlamaConfig(**SMALL, bos_token_id=1), "LlamaForCausalLM")
    return attrs.evolve(ModelConfig.from_hf_config(data), **overrides)


@pytest.mark.parametrize(
    "config",
    [
        _llama(),
        _llama(rope_scaling=RopeScaling(kind="llama3", factor=8.0), eos_token_ids=(2, 7)),
        _llama(rope_frequency_factors=(1.0, 2.0, 3.0, 4.0), bos_token_id=None, qkv_bias=True),
    ],
)
def test_plain_values_round_trip_through_json(config: ModelConfig) -> None:
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_from_dict_rejects_unknown_and_invalid_fields() -> None:
    values = _llama().to_dict()
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        ModelConfig.from_dict({**values, "colour": "blue"})
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        ModelConfig.from_dict({**values, "num_layers": 0})
