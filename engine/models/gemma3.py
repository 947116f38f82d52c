"""Gemma 3's text model as an architecture (``Gemma3ForCausalLM``, GGUF ``gemma3``).

Every departure from Llama is the configuration's (:meth:`ModelConfig.from_hf_config
<twostroke.engine.models.config.ModelConfig.from_hf_config>` reads them as transformers'
``Gemma3TextModel`` computes): sliding-window layers interleaved with global ones
(``sliding_window``, ``global_layers``), each kind with its rotary base
(``local_rope_theta``); four norms a layer, before and after each block
(``norm_placement="both"``), and per-head q/k norms, all ``(1 + weight)`` in float32
(``norm_offset``); a gelu-tanh MLP; embeddings times ``sqrt(hidden_size)``; scores times
``query_pre_attn_scalar ** -0.5``; logits soft-capped where the config asks.

llama.cpp's converter stores the q/k rows as transformers holds them (its ``gemma3`` rotates
halves) and every norm's weight plus one (``norm_offset`` 0 from a GGUF file).
"""

from __future__ import annotations

import attrs
import torch

from twostroke.engine.models import llama
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = ["NAMES", "Gemma3ForCausalLM"]

#: Gemma 3's checkpoint names: Llama's projections, its four norms a layer and q/k norms.
NAMES: CheckpointNames = attrs.evolve(
    llama.NAMES,
    norms=(
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "self_attn.q_norm",
        "self_attn.k_norm",
    ),
    gguf_layer={
        **llama.NAMES.gguf_layer,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    gguf_rotary_order=frozenset(),
)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3: the shared decoder layer, its departures the configuration's.

    The embeddings' scale is rounded to the model's dtype first, as transformers'
    ``Gemma3TextScaledWordEmbedding`` casts it (``sqrt(1152)`` is 34.0 in bfloat16).
    """

    names = NAMES

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, dtype=dtype, device=device)
        self.embedding_scale = float(torch.tensor(config.embedding_scale, dtype=dtype))
