"""torch's arithmetic for what the compiled kernels compute element by element.

Each compiled kernel is checked against these at build time (:mod:`.glue`), and the
decoder's torch glue (:class:`~twostroke.engine.models.layers.TorchGlue`) computes with the
same functions: one definition of transformers' arithmetic (``modeling_llama``), bit for bit
in float32, in as few torch calls as that allows (each call from Python hands the GIL back
and forth with the engine's bookkeeping stroke: docs/performance-log.md, "Fewer torch calls
per step").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "rotate_", "silu_mul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension, transformers' arithmetic."""
    shape = (x.shape[-1],)
    if x.dtype == torch.float32:
        return torch.rms_norm(x, shape, weight, eps)
    normalized = torch.rms_norm(x.float(), shape, None, eps)
    return weight * normalized.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's middle, ``silu(gate) * up``, of the fused gate/up projection's output.

    ``chunk``, not ``split`` (a Python method); the SiLU's fresh output takes the product.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Apply rotary embeddings to ``x`` ``[tokens, heads, dim]`` in place.

    transformers computes ``x * cos + cat(-x2, x1) * sin`` (``x1``, ``x2`` the halves of
    ``x``). ``roll`` makes ``cat(x2, x1)`` in one call, and ``signed_sin`` (``sin`` with
    its first half negated, made once per step by
    :func:`~twostroke.engine.models.layers.rotary_tables`) puts the minus
    sign in the product, where it is exact: the same values bit for bit, in four calls
    instead of seven.
    """
    rolled = x.roll(x.shape[-1] // 2, -1)
    rolled.mul_(signed_sin)
    x.mul_(cos).add_(rolled)
