"""Phi-3 and Phi-4-mini as an architecture (``Phi3ForCausalLM``, GGUF ``phi3``): Llama's layer
with its projections stored fused (``qkv_proj``, and ``gate_up_proj`` gate first, as
twostroke holds them), only the leading ``rotary_dim`` of each head rotated
(``partial_rotary_factor``), and LongRoPE's short and long factors for long contexts
(:class:`~twostroke.engine.models.rope.RopeScaling`, which set a position takes:
:func:`~twostroke.engine.models.layers.rotary_tables`).

llama.cpp's converter (``Phi3MiniModel``) stores the fused tensors as transformers holds them
(``attn_qkv``, and ``ffn_up`` of both halves), rows in transformers' order (its ``phi3``
rotates halves), and LongRoPE as two tensors, ``rope_factors_short`` and
``rope_factors_long``, with ``rope.scaling.attn_factor`` beside them. A sliding window
(Phi-3 mini 4k's 2047) is kept from either format, as transformers attends; llama.cpp
currently ignores it in ``phi3`` files.
"""

from __future__ import annotations

import re

from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = ["NAMES", "Phi3ForCausalLM"]

#: Phi-3's checkpoint names: each fused tensor fills its fused projection whole.
NAMES = CheckpointNames(
    fused={
        ("self_attn", "qkv_proj"): ("self_attn.qkv_proj", None),
        ("self_attn", "o_proj"): ("self_attn.o_proj", None),
        ("mlp", "gate_up_proj"): ("mlp.gate_up_proj", None),
        ("mlp", "down_proj"): ("mlp.down_proj", None),
    },
    parts=(
        ("self_attn.qkv_proj", ("self_attn.qkv_proj",)),
        ("self_attn.o_proj", ("self_attn.o_proj",)),
        ("mlp.gate_up_proj", ("mlp.gate_up_proj",)),
        ("mlp.down_proj", ("mlp.down_proj",)),
    ),
    norms=("input_layernorm", "post_attention_layernorm"),
    ignored=re.compile(r".*rotary_emb\.(inv_freq|original_inv_freq)$"),
    gguf_global={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    gguf_layer={
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
)


class Phi3ForCausalLM(CausalLM):
    """Phi-3 / Phi-4-mini: the shared decoder layer, fused checkpoint tensors, partial rotary
    embeddings and LongRoPE (the configuration's)."""

    names = NAMES
