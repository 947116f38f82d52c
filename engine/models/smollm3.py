"""SmolLM3 as an architecture (``SmolLM3ForCausalLM``, GGUF ``smollm3``): Llama's layer, but
some layers do not rotate their queries and keys (NoPE, ``nope_layers``): those whose
``no_rope_layers`` flag is 0 in ``config.json``, every fourth in a GGUF file (llama.cpp
stores no key for it and hard-codes the step).

llama.cpp's converter (``SmolLM3Model``, a ``LlamaModel``) permutes the q/k rows into its
rotary order as it does Llama's, so they are put back at load.
"""

from __future__ import annotations

import attrs

from twostroke.engine.models import llama
from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = ["NAMES", "SmolLM3ForCausalLM"]

#: SmolLM3's checkpoint names: Llama's, its GGUF q/k rows in llama.cpp's rotary order.
NAMES: CheckpointNames = attrs.evolve(llama.NAMES, gguf_rotary_order=frozenset({"smollm3"}))


class SmolLM3ForCausalLM(CausalLM):
    """SmolLM3: the shared decoder layer, NoPE where the configuration says."""

    names = NAMES
