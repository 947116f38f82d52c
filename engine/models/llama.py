"""The Llama family as an architecture: Llama 2/3.x, Mistral, Qwen2, SmolLM.

One module per architecture, as vLLM's ``model_executor/models/`` and llama.cpp's
``src/models/``: it composes the shared layers (:mod:`~twostroke.engine.models.decoder_layer`:
pre-norm grouped-query attention with rotary embeddings, SwiGLU) into a
:class:`~twostroke.engine.models.decoder.CausalLM`, and holds its table of names from HF
and GGUF checkpoints to parameters (:data:`NAMES`). A ``llama`` GGUF file's q/k rows are in
llama.cpp's rotary order, undone at load (:func:`unpermute_rotary`, :func:`rotary_columns`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = [
    "NAMES",
    "LlamaForCausalLM",
    "hf_tensor_name",
    "rotary_columns",
    "unpermute_rotary",
]

#: The Llama family's checkpoint names.
NAMES = CheckpointNames(
    fused={
        ("self_attn", "q_proj"): ("self_attn.qkv_proj", 0),
        ("self_attn", "k_proj"): ("self_attn.qkv_proj", 1),
        ("self_attn", "v_proj"): ("self_attn.qkv_proj", 2),
        ("self_attn", "o_proj"): ("self_attn.o_proj", None),
        ("mlp", "gate_proj"): ("mlp.gate_up_proj", 0),
        ("mlp", "up_proj"): ("mlp.gate_up_proj", 1),
        ("mlp", "down_proj"): ("mlp.down_proj", None),
    },
    parts=(
        ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.o_proj", ("self_attn.o_proj",)),
        ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.down_proj", ("mlp.down_proj",)),
    ),
    norms=("input_layernorm", "post_attention_layernorm"),
    ignored=re.compile(r".*rotary_emb\.inv_freq$"),
    gguf_global={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    gguf_layer={
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    gguf_rotary_order=frozenset({"llama"}),
)


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral and Qwen2 (``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``Qwen2ForCausalLM``; GGUF ``llama`` and ``qwen2``): the shared decoder layer, RMSNorm,
    rotary embeddings with Llama 3's scaling, optional q/k/v biases (Qwen2)."""

    names = NAMES


def hf_tensor_name(gguf_name: str) -> str | None:
    """transformers' name for a llama.cpp tensor name of the family, or ``None``."""
    return NAMES.hf_name(gguf_name)


def unpermute_rotary(weights: Any, num_heads: int) -> Any:
    """Undo llama.cpp's interleaving of the rotary halves in q/k projections.

    llama.cpp rotates adjacent pairs, transformers rotates the two halves of each head, so
    the converter permuted the rows of every head; this is transformers' inverse.
    """
    half = weights.shape[0] // num_heads // 2
    grouped = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(2, 1).reshape(weights.shape))


def rotary_columns(rows: int, num_heads: int) -> torch.Tensor:
    """Where each stored q/k row's product goes: the inverse of the permutation
    :func:`unpermute_rotary` applies to the rows (a GGUF file's blocks stay as stored, their
    products' columns are put back)."""
    source = unpermute_rotary(np.arange(rows, dtype=np.int64)[:, None], num_heads)[:, 0]
    return torch.from_numpy(np.argsort(source).astype(np.int32))
