"""OLMoE as an architecture (``OlmoeForCausalLM``, GGUF ``olmoe``): Llama's pre-norm layer
with q/k RMSNorm over the whole projection (as OLMo 2's), and a mixture of experts in place of
every MLP (:class:`~twostroke.engine.models.experts.SparseMoE`: 64 experts, 8 a token, the
picked probabilities divided by their sum only where ``norm_topk_prob`` says; llama.cpp never
divides). Its checkpoint names are Qwen3-MoE's (``mlp.gate``, ``mlp.experts.N.gate_proj``,
``self_attn.q_norm``), and so are its GGUF names.
"""

from __future__ import annotations

from twostroke.engine.models import qwen3_moe
from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = ["NAMES", "OlmoeForCausalLM"]

#: OLMoE's checkpoint names: Qwen3-MoE's.
NAMES: CheckpointNames = qwen3_moe.NAMES


class OlmoeForCausalLM(CausalLM):
    """OLMoE: Llama's layer with whole-projection q/k norms and a mixture of experts."""

    names = NAMES
