"""What each architecture's configuration says beyond Llama's: the
:class:`~twostroke.engine.models.config.ModelConfig` fields in which it departs, read from its
``config.json`` (:func:`hf_features`) or its GGUF keys (:func:`gguf_features`) as
transformers and llama.cpp read them, and the layers a sliding window covers
(:func:`sliding_window_of`). One place per architecture's reading, apart from the value it
fills."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twostroke.engine.models.fields import count, head_dim_of, require

__all__ = [
    "GEMMA2_DEFAULTS",
    "GEMMA3_DEFAULTS",
    "gguf_features",
    "hf_features",
    "sliding_window_of",
]


#: Every ``no_rope_layer_interval``-th layer of SmolLM3 has no rotary embeddings: llama.cpp's
#: ``smollm3`` stores no key for it and hard-codes 4 (``n_no_rope_layer_step``), the default
#: of transformers' ``SmolLM3Config``.
_SMOLLM3_NOPE_INTERVAL = 4


def sliding_window_of(
    data: Mapping[str, Any], max_positions: int, *, keep: bool = False
) -> tuple[int | None, tuple[int, ...]]:
    """A config's sliding window and the layers that see every position anyway, as
    transformers reads them: ``layer_types`` where the config lists it, else every
    ``sliding_window_pattern``-th layer global (Gemma's older configs), else every layer
    windowed (Mistral) or, for Qwen2, those from ``max_window_layers`` on; Qwen2 asks for
    a window only with ``use_sliding_window``. A window as long as the context is none,
    unless ``keep``."""
    window = data.get("sliding_window")
    if window is None or not data.get("use_sliding_window", True):
        return None, ()
    window = count(data, "sliding_window")
    if window >= max_positions and not keep:
        return None, ()
    num_layers = count(data, "num_hidden_layers")
    types = data.get("layer_types")
    if types is None and data.get("sliding_window_pattern") is not None:
        pattern = count(data, "sliding_window_pattern")
        types = [
            "full_attention" if (index + 1) % pattern == 0 else "sliding_attention"
            for index in range(num_layers)
        ]
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(
                f"layer_types must list one type per layer ({num_layers}), got {types!r}"
            )
        unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
        if unknown:
            raise ValueError(
                f"layer_types must be 'sliding_attention' or 'full_attention', got {unknown}"
            )
        return window, tuple(i for i, kind in enumerate(types) if kind == "full_attention")
    first = data.get("max_window_layers", 0) if "use_sliding_window" in data else 0
    return window, tuple(range(min(int(first), num_layers)))


def hf_features(architecture: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of :class:`~twostroke.engine.models.config.ModelConfig` in which
    ``architecture`` departs from Llama, read from its ``config.json`` as its transformers
    class reads them."""
    if architecture == "Gemma3ForCausalLM":
        return _gemma3_features(data)
    if architecture == "Gemma2ForCausalLM":
        return _gemma2_features(data)
    if architecture == "Qwen3ForCausalLM":
        return {"qk_norm": "head"}
    if architecture == "Qwen3MoeForCausalLM":
        return {"qk_norm": "head", **_qwen3_moe_features(data)}
    if architecture == "Olmo2ForCausalLM":
        return {"qk_norm": "full", "norm_placement": "post"}
    if architecture == "OlmoeForCausalLM":
        # OlmoeAttention: q/k RMSNorm over the whole projection, Llama's pre-norm layer;
        # OlmoeSparseMoeBlock: every layer a mixture, divided by its sum where it says.
        if data.get("clip_qkv") is not None:
            raise ValueError(
                f"clip_qkv is not supported (it must be null), got {data['clip_qkv']!r}"
            )
        return {
            "qk_norm": "full",
            "num_experts": count(data, "num_experts", default=64),
            "experts_per_token": count(data, "num_experts_per_tok", default=8),
            "expert_intermediate_size": count(data, "intermediate_size"),
            "normalize_expert_weights": bool(data.get("norm_topk_prob", False)),
        }
    if architecture == "MixtralForCausalLM":
        # MixtralSparseMoeBlock: every layer a mixture of experts as wide as
        # intermediate_size, the picked weights always divided by their sum.
        return {
            "num_experts": count(data, "num_local_experts", default=8),
            "experts_per_token": count(data, "num_experts_per_tok", default=2),
            "expert_intermediate_size": count(data, "intermediate_size"),
            "normalize_expert_weights": True,
        }
    if architecture == "SmolLM3ForCausalLM":
        layers = require(data, "num_hidden_layers")
        rotates = data.get("no_rope_layers")
        if rotates is None:  # SmolLM3Config's default: every interval-th layer is NoPE
            interval = count(data, "no_rope_layer_interval", default=_SMOLLM3_NOPE_INTERVAL)
            rotates = [int((index + 1) % interval != 0) for index in range(layers)]
        if len(rotates) != layers or any(flag not in (0, 1) for flag in rotates):
            raise ValueError(
                f"no_rope_layers must be {layers} flags of 0 or 1 (1: the layer rotates), "
                f"got {rotates!r}"
            )
        return {"nope_layers": tuple(i for i, flag in enumerate(rotates) if not flag)}
    if architecture == "Phi3ForCausalLM":
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        share = rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
        head_dim = head_dim_of(
            data,
            "head_dim",
            count(data, "hidden_size"),
            count(data, "num_attention_heads"),
            "hidden_size",
        )
        rotary_dim = int(head_dim * share)  # transformers' int(), as Phi3RotaryEmbedding
        return {"rotary_dim": None if rotary_dim == head_dim else rotary_dim}
    if architecture == "GraniteForCausalLM":
        # GraniteConfig's defaults; its attention always scales by attention_multiplier.
        return {
            "embedding_scale": data.get("embedding_multiplier", 1.0),
            "attention_scale": data.get("attention_multiplier", 1.0),
            "residual_scale": data.get("residual_multiplier", 1.0),
            "logit_scale": data.get("logits_scaling", 1.0),
        }
    return {}


def gguf_features(arch: str, metadata: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The fields of :class:`~twostroke.engine.models.config.ModelConfig` in which a GGUF
    architecture departs from Llama, as llama.cpp reads them (``llm_load_hparams``)."""
    if arch == "gemma3":
        return _gemma3_gguf_features(metadata, num_layers)
    if arch == "gemma2":
        return _gemma2_gguf_features(metadata, num_layers)
    if arch == "qwen3":
        return {"qk_norm": "head"}
    if arch == "qwen3moe":
        # llama.cpp's qwen3moe: every layer a mixture, the picked weights always divided by
        # their sum (its build_moe_ffn's norm_w is true; the converter keeps no dense layers).
        return {
            "qk_norm": "head",
            "num_experts": count(metadata, "qwen3moe.expert_count"),
            "experts_per_token": count(metadata, "qwen3moe.expert_used_count"),
            "expert_intermediate_size": count(metadata, "qwen3moe.expert_feed_forward_length"),
            "normalize_expert_weights": True,
        }
    if arch == "olmo2":
        return {"qk_norm": "full", "norm_placement": "post"}
    if arch == "olmoe":
        # llama.cpp's olmoe: q/k norms over the projection, every layer a mixture whose
        # picked weights are not divided by their sum (its build_moe_ffn's norm_w is false).
        return {
            "qk_norm": "full",
            "num_experts": count(metadata, "olmoe.expert_count"),
            "experts_per_token": count(metadata, "olmoe.expert_used_count"),
            "expert_intermediate_size": count(
                metadata,
                "olmoe.expert_feed_forward_length",
                default=count(metadata, "olmoe.feed_forward_length"),
            ),
            "normalize_expert_weights": False,
        }
    if arch == "llama" and metadata.get("llama.expert_count"):
        # Mixtral as llama.cpp's converter writes it: a llama with expert tensors.
        return {
            "num_experts": count(metadata, "llama.expert_count"),
            "experts_per_token": count(metadata, "llama.expert_used_count"),
            "expert_intermediate_size": count(metadata, "llama.feed_forward_length"),
            "normalize_expert_weights": True,
        }
    if arch == "smollm3":
        step = _SMOLLM3_NOPE_INTERVAL
        return {"nope_layers": tuple(i for i in range(num_layers) if (i + 1) % step == 0)}
    if arch == "phi3":
        hidden, heads = (
            count(metadata, f"phi3.{n}") for n in ("embedding_length", "attention.head_count")
        )
        head_dim = head_dim_of(
            metadata, "phi3.attention.key_length", hidden, heads, "embedding_length"
        )
        rotary_dim = count(metadata, "phi3.rope.dimension_count", default=head_dim)
        # Phi3MiniModel writes 0 for no window; one as long as the context is none.
        window = metadata.get("phi3.attention.sliding_window") or None
        if window is not None and window >= require(metadata, "phi3.context_length"):
            window = None
        return {
            "rotary_dim": None if rotary_dim == head_dim else rotary_dim,
            "sliding_window": window,
        }
    if arch == "granite":
        return {
            "embedding_scale": require(metadata, "granite.embedding_scale"),
            "attention_scale": require(metadata, "granite.attention.scale"),
            "residual_scale": require(metadata, "granite.residual_scale"),
            "logit_scale": require(metadata, "granite.logit_scale"),
        }
    return {}


def _qwen3_moe_features(data: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's experts as ``Qwen3MoeDecoderLayer`` places them: a mixture in every
    ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (``Qwen3MoeConfig``'s
    defaults where the file leaves a key out; it saves ``num_experts`` as
    ``num_local_experts``)."""
    layers = count(data, "num_hidden_layers")
    experts = data.get("num_experts", data.get("num_local_experts", 128))
    step = count(data, "decoder_sparse_step", default=1)
    only = data.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ValueError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return {
        "num_experts": count({"num_experts": experts}, "num_experts"),
        "experts_per_token": count(data, "num_experts_per_tok", default=8),
        "expert_intermediate_size": count(data, "moe_intermediate_size", default=768),
        "normalize_expert_weights": bool(data.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }


#: transformers' ``Gemma3TextConfig`` defaults for the keys a Gemma 3 ``config.json`` may
#: leave out (the Hub's older files spell the layer kinds as ``sliding_window_pattern``).
GEMMA3_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}

#: llama.cpp's ``gemma3`` stores no layer kinds: every sixth layer is global
#: (``set_swa_pattern(6)``), and the others rotate by a base of 10000 unless the file says.
_GEMMA3_GGUF_PATTERN = 6
_GEMMA3_GGUF_LOCAL_BASE = 10_000.0


def _gemma3_features(data: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's departures as transformers' ``Gemma3TextModel`` computes them: each layer
    kind's rotary base (``rope_parameters["sliding_attention"]``, or the older
    ``rope_local_base_freq``), ``(1 + weight)`` norms before and after each block,
    gelu-tanh, embeddings times ``sqrt(hidden_size)``, scores times
    ``query_pre_attn_scalar ** -0.5``. ``data`` has :data:`GEMMA3_DEFAULTS` filled in."""
    activation = data.get("hidden_activation")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh', got {activation!r}")
    if data.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention must be false: twostroke decodes causally")
    count(data, "sliding_window")  # the local layers' rotary base needs a window to name them
    rope = data.get("rope_parameters")
    local = rope.get("sliding_attention") if isinstance(rope, Mapping) else None
    theta = data["rope_local_base_freq"]
    if isinstance(local, Mapping):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise ValueError(
                "rope_parameters['sliding_attention'] must rotate unscaled (rope_type "
                f"'default'), got {kind!r}"
            )
        theta = local.get("rope_theta", theta)
    return {
        "qk_norm": "head",
        "norm_placement": "both",
        "norm_offset": 1.0,
        "hidden_activation": "gelu_tanh",
        "embedding_scale": count(data, "hidden_size") ** 0.5,
        "attention_scale": require(data, "query_pre_attn_scalar") ** -0.5,
        "local_rope_theta": theta,
        "final_logit_softcapping": data.get("final_logit_softcapping"),
        "attn_logit_softcapping": data.get("attn_logit_softcapping"),
    }


def _gemma3_gguf_features(metadata: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Gemma 3 as llama.cpp's ``gemma3`` reads it: the layer kinds and the local base are
    its constants (:data:`_GEMMA3_GGUF_PATTERN`), the norms' ``+ 1`` is in the stored
    weights, and ``query_pre_attn_scalar``, which the converter does not store, is the
    head width except for the 62-layer 27B (``hidden_size / heads``, as its config says)."""
    hidden = count(metadata, "gemma3.embedding_length")
    heads = count(metadata, "gemma3.attention.head_count")
    head_dim = count(metadata, "gemma3.attention.key_length", default=hidden // heads)
    scalar = hidden // heads if num_layers == 62 else head_dim
    features: dict[str, Any] = {
        "qk_norm": "head",
        "norm_placement": "both",
        "norm_offset": 0.0,
        "hidden_activation": "gelu_tanh",
        "embedding_scale": hidden**0.5,
        "attention_scale": scalar**-0.5,
        "final_logit_softcapping": metadata.get("gemma3.final_logit_softcapping") or None,
    }
    window = metadata.get("gemma3.attention.sliding_window") or 0
    if window:  # newer llama.cpp runs a file without one with every layer global
        pattern = _GEMMA3_GGUF_PATTERN
        features["sliding_window"] = count(metadata, "gemma3.attention.sliding_window")
        features["global_layers"] = tuple(
            i for i in range(num_layers) if i % pattern == pattern - 1
        )
        features["local_rope_theta"] = metadata.get(
            "gemma3.rope.freq_base_swa", _GEMMA3_GGUF_LOCAL_BASE
        )
    return features


#: transformers' ``Gemma2Config`` defaults for the keys a Gemma 2 ``config.json`` may leave
#: out: without ``layer_types``, every other layer is global (the even ones windowed).
GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 2,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "tie_word_embeddings": True,
}

#: llama.cpp's ``gemma2`` (``llm_load_hparams``): every other layer windowed
#: (``set_swa_pattern(2)``), 4096 positions unless the file says, scores capped at 50 and
#: logits at 30 unless it says.
_GEMMA2_GGUF_PATTERN = 2
_GEMMA2_GGUF_WINDOW = 4096
_GEMMA2_GGUF_ATTN_CAP = 50.0
_GEMMA2_GGUF_FINAL_CAP = 30.0


def _gemma2_features(data: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2's departures as transformers' ``Gemma2Model`` computes them: Gemma 3's layer
    without q/k norms and with one rotary base, and its scores soft-capped
    (``attn_logit_softcapping``). ``data`` has :data:`GEMMA2_DEFAULTS` filled in."""
    activation = data.get("hidden_activation")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh', got {activation!r}")
    if data.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention must be false: twostroke decodes causally")
    return {
        "norm_placement": "both",
        "norm_offset": 1.0,
        "hidden_activation": "gelu_tanh",
        "embedding_scale": count(data, "hidden_size") ** 0.5,
        "attention_scale": require(data, "query_pre_attn_scalar") ** -0.5,
        "final_logit_softcapping": data.get("final_logit_softcapping"),
        "attn_logit_softcapping": data.get("attn_logit_softcapping"),
    }


def _gemma2_gguf_features(metadata: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Gemma 2 as llama.cpp's ``gemma2`` reads it: the layer kinds and the defaults are its
    constants (:data:`_GEMMA2_GGUF_PATTERN`), the norms' ``+ 1`` is in the stored weights,
    and the score scale is the head width's except for the 46-layer 27B (``hidden_size /
    heads``, as its ``query_pre_attn_scalar``)."""
    hidden = count(metadata, "gemma2.embedding_length")
    heads = count(metadata, "gemma2.attention.head_count")
    head_dim = count(metadata, "gemma2.attention.key_length", default=hidden // heads)
    scalar = hidden // heads if num_layers == 46 else head_dim
    pattern = _GEMMA2_GGUF_PATTERN
    return {
        "norm_placement": "both",
        "norm_offset": 0.0,
        "hidden_activation": "gelu_tanh",
        "embedding_scale": hidden**0.5,
        "attention_scale": scalar**-0.5,
        "final_logit_softcapping": metadata.get(
            "gemma2.final_logit_softcapping", _GEMMA2_GGUF_FINAL_CAP
        ),
        "attn_logit_softcapping": metadata.get(
            "gemma2.attn_logit_softcapping", _GEMMA2_GGUF_ATTN_CAP
        ),
        "sliding_window": count(
            metadata, "gemma2.attention.sliding_window", default=_GEMMA2_GGUF_WINDOW
        ),
        "global_layers": tuple(i for i in range(num_layers) if i % pattern == pattern - 1),
    }
