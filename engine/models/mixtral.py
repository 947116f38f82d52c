"""Mixtral as an architecture (``MixtralForCausalLM``; in GGUF, llama.cpp's ``llama`` with
expert tensors): Llama's attention and a mixture of experts in place of every MLP
(:class:`~twostroke.engine.models.experts.SparseMoE`: 8 experts, 2 a token, the picked
probabilities divided by their sum).

Its HF checkpoint names the mixture ``block_sparse_moe`` and an expert's matrices ``w1``
(gate), ``w3`` (up) and ``w2`` (down), where the shared mixture's names are ``mlp``'s and
``gate_proj``/``up_proj``/``down_proj`` (Qwen3-MoE's): :func:`shared_name` renames on the
way in and :func:`checkpoint_name` on the way out, so the loader's expected and missing
names are the checkpoint's own. llama.cpp's converter stores the experts stacked
(``ffn_gate_exps`` ...) and the router as ``ffn_gate_inp``, q/k rows permuted as a llama's.
"""

from __future__ import annotations

import re

import attrs
import torch

from twostroke.engine.checkpoints.gguf import BlockTensor
from twostroke.engine.models import llama
from twostroke.engine.models.decoder import CausalLM, CheckpointNames

__all__ = ["NAMES", "MixtralForCausalLM", "checkpoint_name", "shared_name"]

#: Mixtral's checkpoint names: Llama's and the experts' GGUF names.
NAMES: CheckpointNames = attrs.evolve(
    llama.NAMES,
    gguf_layer={
        **llama.NAMES.gguf_layer,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    },
)

#: transformers' MixtralBlockSparseTop2MLP matrices, by the shared mixture's names.
_EXPERT_MATRICES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_CHECKPOINT = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(.+)")
_SHARED = re.compile(r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.\d+\.\w+\.weight)")


def shared_name(name: str) -> str:
    """The shared mixture's name for a Mixtral checkpoint's tensor name (others unchanged)."""
    found = _CHECKPOINT.fullmatch(name)
    if found is None:
        return name
    prefix, rest = found.groups()
    parts = rest.split(".")
    if len(parts) == 4 and parts[0] == "experts" and parts[2] in _EXPERT_MATRICES:
        parts[2] = _EXPERT_MATRICES[parts[2]]
    return f"{prefix}mlp.{'.'.join(parts)}"


def checkpoint_name(name: str) -> str:
    """A Mixtral checkpoint's name for the shared mixture's tensor name (others unchanged)."""
    found = _SHARED.fullmatch(name)
    if found is None:
        return name
    prefix, rest = found.groups()
    parts = rest.split(".")
    if parts[0] == "experts":
        parts[2] = {shared: own for own, shared in _EXPERT_MATRICES.items()}[parts[2]]
    return f"{prefix}block_sparse_moe.{'.'.join(parts)}"


class MixtralForCausalLM(CausalLM):
    """Mixtral: Llama's layer with a mixture of experts for its MLP."""

    names = NAMES

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """:meth:`CausalLM.load_weight` of the checkpoint's name (or of the shared one)."""
        super().load_weight(shared_name(name), tensor)

    def weight(self, name: str) -> torch.Tensor:
        """:meth:`CausalLM.weight` of the checkpoint's name (or of the shared one)."""
        return super().weight(shared_name(name))

    def load_blocks(self, name: str, tensor: BlockTensor) -> None:
        """:meth:`CausalLM.load_blocks` of the checkpoint's name (or of the shared one)."""
        super().load_blocks(shared_name(name), tensor)

    def expected_weights(self) -> list[str]:
        """The checkpoint's names of the tensors the model needs, in order."""
        return [checkpoint_name(name) for name in super().expected_weights()]

    def missing_weights(self) -> list[str]:
        """The checkpoint's names of the expected tensors not loaded yet."""
        return [checkpoint_name(n) for n in super().expected_weights() if n not in self._loaded]
