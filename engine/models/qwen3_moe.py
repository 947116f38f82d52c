"""Qwen3-MoE as an architecture (``Qwen3MoeForCausalLM``, GGUF ``qwen3moe``): Qwen3's attention
(per-head q/k norms) and a mixture of experts in place of the MLP
(:class:`~twostroke.engine.models.experts.SparseMoE`): 128 experts, 8 a token in the released
models, their router's picked probabilities divided by their sum (``norm_topk_prob``). Layers
in ``mlp_only_layers`` (or skipped by ``decoder_sparse_step``) keep the dense MLP.

llama.cpp's converter stores the experts stacked (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``: ``[experts, rows, columns]``) and the router as ``ffn_gate_inp``; an HF
checkpoint names them one by one (``mlp.experts.<n>.gate_proj.weight``) and the router
``mlp.gate.weight``.
"""

from __future__ import annotations

import attrs

from twostroke.engine.models import qwen3
from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = ["NAMES", "Qwen3MoeForCausalLM"]

#: Qwen3-MoE's checkpoint names: Qwen3's and the experts' GGUF names.
NAMES: CheckpointNames = attrs.evolve(
    qwen3.NAMES,
    gguf_layer={
        **qwen3.NAMES.gguf_layer,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    },
)


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE: Qwen3's layer with a mixture of experts for its MLP."""

    names = NAMES
