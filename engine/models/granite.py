"""Granite 3 as an architecture (``GraniteForCausalLM``, GGUF ``granite``): Llama's layer
with four multipliers, all the configuration's: the embeddings' (``embedding_scale``), the
attention scores' in place of ``head_dim ** -0.5`` (``attention_scale``), each block's
output before it joins the residual stream (``residual_scale``), and the logits' divisor
(``logit_scale``).

llama.cpp's converter (``GraniteModel``, a ``LlamaModel``) permutes Granite's q/k rows into
its rotary order as it does Llama's, so they are put back at load.
"""

from __future__ import annotations

import attrs

from twostroke.engine.models import llama
from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = ["NAMES", "GraniteForCausalLM"]

#: Granite's checkpoint names: Llama's, its GGUF q/k rows in llama.cpp's rotary order.
NAMES: CheckpointNames = attrs.evolve(llama.NAMES, gguf_rotary_order=frozenset({"granite"}))


class GraniteForCausalLM(CausalLM):
    """Granite 3: the shared decoder layer and the configuration's four multipliers."""

    names = NAMES
