"""Gemma 2 (``Gemma2ForCausalLM``, GGUF ``gemma2``) as an architecture.

Gemma 3's layer without its q/k norms (:mod:`~twostroke.engine.models.gemma3`), every
departure the configuration's (:meth:`ModelConfig.from_hf_config
<twostroke.engine.models.config.ModelConfig.from_hf_config>` reads them as transformers'
``Gemma2Model`` computes): every other layer windowed (``sliding_window``,
``global_layers``), all rotating by one base; four ``(1 + weight)`` norms a layer in float32
(``norm_offset``); a gelu-tanh MLP; embeddings times ``sqrt(hidden_size)``; scores times
``query_pre_attn_scalar ** -0.5`` and then soft-capped, ``cap * tanh(scores / cap)``, before
the mask (``attn_logit_softcapping``: the plan picks an attention that computes it,
:func:`~twostroke.engine.models.choice.select_kernels`); logits soft-capped likewise.

llama.cpp's converter stores the q/k rows as transformers holds them (its ``gemma2`` rotates
halves) and every norm's weight plus one (``norm_offset`` 0 from a GGUF file).
"""

from __future__ import annotations

import attrs

from twostroke.engine.models import gemma3
from twostroke.engine.models.decoder import CheckpointNames
from twostroke.engine.models.gemma3 import Gemma3ForCausalLM

__all__ = ["NAMES", "Gemma2ForCausalLM"]

#: Gemma 2's checkpoint names: Gemma 3's without the q/k norms.
NAMES: CheckpointNames = attrs.evolve(
    gemma3.NAMES,
    norms=tuple(name for name in gemma3.NAMES.norms if not name.startswith("self_attn.")),
    gguf_layer={
        gguf: hf
        for gguf, hf in gemma3.NAMES.gguf_layer.items()
        if gguf not in ("attn_q_norm", "attn_k_norm")
    },
)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's model (its embeddings scaled as transformers'
    ``Gemma2Model`` scales them, rounded to the dtype), its departures the configuration's."""

    names = NAMES
