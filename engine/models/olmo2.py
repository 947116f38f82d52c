"""OLMo 2 as an architecture (``Olmo2ForCausalLM``, GGUF ``olmo2``): norms after attention and
after the MLP instead of before (``norm_placement="post"``), and queries and keys normalized
over the whole projection (``qk_norm="full"``) before rotary.

llama.cpp's converter stores OLMo 2's q/k rows as transformers holds them (its ``olmo2``
rotates halves), so nothing is undone at load.
"""

from __future__ import annotations

import attrs

from twostroke.engine.models import llama
from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = ["NAMES", "Olmo2ForCausalLM"]

#: OLMo 2's checkpoint names: Llama's projections, its own norms.
NAMES: CheckpointNames = attrs.evolve(
    llama.NAMES,
    norms=(
        "post_attention_layernorm",
        "post_feedforward_layernorm",
        "self_attn.q_norm",
        "self_attn.k_norm",
    ),
    gguf_layer={
        **{
            name: hf
            for name, hf in llama.NAMES.gguf_layer.items()
            if name not in ("attn_norm", "ffn_norm")
        },
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    gguf_rotary_order=frozenset(),
)


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2: the shared decoder layer, post-norm, with q/k norms over the projection."""

    names = NAMES
