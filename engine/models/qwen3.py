"""Qwen3 as an architecture (``Qwen3ForCausalLM``, GGUF ``qwen3``): Llama's layer with each
head's queries and keys normalized (RMSNorm over ``head_dim``) before rotary, and no q/k/v
biases.

llama.cpp's converter stores Qwen3's q/k rows as transformers holds them (its ``qwen3`` rotates
halves, as transformers does), so nothing is undone at load. YaRN's long context is the
configuration's (:class:`~twostroke.engine.models.config.RopeScaling`), shared with Qwen2.
"""

from __future__ import annotations

import attrs

from twostroke.engine.models import llama
from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = ["NAMES", "Qwen3ForCausalLM"]

#: Qwen3's checkpoint names: Llama's and the q/k norms.
NAMES: CheckpointNames = attrs.evolve(
    llama.NAMES,
    norms=(*llama.NAMES.norms, "self_attn.q_norm", "self_attn.k_norm"),
    gguf_layer={
        **llama.NAMES.gguf_layer,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    gguf_rotary_order=frozenset(),
)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: the shared decoder layer with per-head q/k norms (``qk_norm="head"``)."""

    names = NAMES
