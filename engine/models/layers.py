"""The decoder's element-wise layers: RMSNorm, rotary position embeddings, SwiGLU's middle,
and the glue that runs them between the matrix products.

All follow transformers' arithmetic to the bit in float32 (``modeling_llama`` and
``modeling_rope_utils``), in as few torch calls as that allows: each call from Python hands
the GIL back and forth with the engine's bookkeeping stroke (docs/performance-log.md, "Fewer
torch calls per step").

A decoder layer calls its element-wise work through a :class:`Glue`: each residual add with
the norm after it, the rotary embeddings with the cache write, SiLU times up, and the
greedy rows' ``argmax``. :class:`TorchGlue` is these layers' torch operators; the compiled
glue (:class:`~twostroke.engine.models.glue.CompiledGlue`) has the same methods, so the
decoder is written once and the run's plan (:mod:`~twostroke.engine.models.plan`) decides
which runs.
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs
import torch
from torch import nn

from twostroke.engine.attention.kv_cache import LayerCache
from twostroke.engine.attention.metadata import AttentionMetadata
from twostroke.engine.attention.ops import write_kv
from twostroke.engine.kernels.reference import rms_norm, rotate_, silu_mul
from twostroke.engine.models.config import ModelConfig, RopeScaling

__all__ = [
    "Glue",
    "RMSNorm",
    "TorchGlue",
    "inverse_frequencies",
    "long_inverse_frequencies",
    "rotary_attention_factor",
    "rotary_tables",
    "rotate_write",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does.

    ``torch.rms_norm`` is one fused kernel with transformers' arithmetic: in float32 its
    results are transformers' bit for bit (checked on SmolLM2's shapes), in one call
    instead of seven. In another dtype transformers casts the normalized float32 values
    before it multiplies by the weight, so that stays a step of its own.

    With an ``offset`` (Gemma's norm, :attr:`ModelConfig.norm_offset
    <twostroke.engine.models.config.ModelConfig.norm_offset>`) the weight is
    ``offset + weight`` and multiplies in float32 before the cast, as transformers'
    ``Gemma3RMSNorm`` computes it; the compiled glue computes Llama's norm only, so such a
    norm runs as torch's operators (:meth:`add_norm`).
    """

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        dtype: torch.dtype,
        device: torch.device,
        offset: float | None = None,
    ) -> None:
        super().__init__()
        empty = torch.empty(size, dtype=dtype, device=device)  # the loader fills it
        self.weight = nn.Parameter(empty, requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset is None:
            return rms_norm(x, self.weight, self.eps)
        # transformers adds the offset in float32 on every call; so does this, so that the
        # weight stays the checkpoint's (a GGUF file's holds the sum: offset 0, no add).
        scale = self.weight.float() + self.offset if self.offset else self.weight.float()
        normalized = torch.rms_norm(x.float(), (x.shape[-1],), scale, self.eps)
        return normalized.to(x.dtype)

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, glue: Glue
    ) -> torch.Tensor:
        """Add ``delta`` to ``residual`` in place (if given) and return the sum normalized:
        the glue's :meth:`~Glue.add_rms_norm` for Llama's norm, torch's operators for an
        offset one.

        Args:
            residual: ``[tokens, hidden]``, added to in place.
            delta: What is added, or ``None``.
            glue: The chosen glue.

        Returns:
            The sum, normalized, in ``residual``'s dtype.
        """
        if self.offset is None:
            return glue.add_rms_norm(residual, delta, self.weight, self.eps)
        if delta is not None:
            residual.add_(delta)
        normalized: torch.Tensor = self(residual)
        return normalized


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The rotary inverse frequencies ``[rotary_width / 2]`` in float32, scaling applied
    (LongRoPE's short factors: :func:`long_inverse_frequencies` are the others).

    Computed exactly as transformers' ``modeling_rope_utils`` does, so the tables agree.
    """
    dim = config.rotary_width
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "longrope":
        inv_freq = _longrope_frequencies(config.rope_theta, exponents, scaling.short_factor)
    elif scaling is not None and scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.kind == "llama3":
        old_context = scaling.original_max_position_embeddings
        low_wavelen = old_context / scaling.low_freq_factor
        high_wavelen = old_context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif scaling is not None and scaling.kind == "yarn":
        inv_freq = _yarn_frequencies(config.rope_theta, dim, scaling)
    if config.rope_frequency_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_frequency_factors, dtype=torch.float32)
    return inv_freq


def long_inverse_frequencies(config: ModelConfig) -> torch.Tensor | None:
    """LongRoPE's inverse frequencies beyond the original context (its long factors), or
    ``None`` where the model has no LongRoPE."""
    scaling = config.rope_scaling
    if scaling is None or scaling.kind != "longrope":
        return None
    dim = config.rotary_width
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return _longrope_frequencies(config.rope_theta, exponents, scaling.long_factor)


def _longrope_frequencies(
    base: float, exponents: torch.Tensor, factors: tuple[float, ...]
) -> torch.Tensor:
    """transformers' ``_compute_longrope_parameters``: ``1 / (factor * base ** exponent)``."""
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)


def _yarn_frequencies(base: float, dim: int, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's inverse frequencies, transformers' ``_compute_yarn_parameters`` step for step:
    each frequency a blend of itself and itself divided by ``factor``, by a linear ramp over
    the dimensions between ``beta_fast`` and ``beta_slow`` rotations in the original
    context."""
    context = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    return interpolation * (1 - kept) + extrapolation * kept


def rotary_attention_factor(config: ModelConfig) -> float:
    """What the rotary ``cos`` and ``sin`` tables are multiplied by: YaRN's or LongRoPE's
    attention factor (transformers' ``attention_scaling``), else 1."""
    scaling = config.rope_scaling
    scaled = scaling is not None and scaling.kind in ("yarn", "longrope")
    return scaling.attention_factor if scaling is not None and scaled else 1.0


def rotary_tables(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    dtype: torch.dtype,
    attention_factor: float = 1.0,
    long: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's ``cos`` and signed ``sin`` tables ``[tokens, 1, rotary_width]`` for
    :func:`rotate_`.

    The angles are computed in float32 and the tables cast to ``dtype``, as transformers
    does (after multiplying by ``attention_factor`` in float32, where it is not 1: see
    :func:`rotary_attention_factor`); ``sin``'s first half is negated (see :func:`rotate_`).
    Made once per step, shared by every layer.

    ``long`` is LongRoPE's other frequencies and the first position that takes them
    (:func:`long_inverse_frequencies`, the original context). transformers picks one set
    per forward call, long where the call's highest position is past the original context;
    in a batch of requests that would make a token's rotation depend on the others'
    lengths (and a chunk's on where the chunk ends). Here each token takes the set of its
    own position: a request's keys never depend on the batch, the chunking, the prefix
    cache or speculation, and its logits equal transformers' fed the same tokens through
    its cache one call per token past the original context. (transformers' ``generate``
    instead recomputes the whole cache with the long set once a sequence crosses, and
    llama.cpp takes one set for the whole context it was given.)
    """
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    if long is not None:
        long_inv_freq, first = long
        beyond = positions.to(torch.float32)[:, None] * long_inv_freq[None, :]
        angles = torch.where((positions >= first)[:, None], beyond, angles)
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.to(dtype), sin.to(dtype)
    sin[..., : sin.shape[-1] // 2].neg_()
    return cos, sin


def rotate_write(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    metadata: AttentionMetadata,
    layer: LayerCache,
) -> None:
    """Rotate the queries and keys of ``qkv`` in place and write its keys and values into
    the step's cache slots (:func:`rotate_`, then
    :func:`~twostroke.engine.attention.ops.write_kv`).

    Queries and keys rotate together, in the projection's output, which holds them and the
    values side by side: no split, no copy.
    """
    tokens, dim = qkv.shape[0], cos.shape[-1]
    query_key = qkv[:, : (num_heads + num_kv_heads) * dim].view(tokens, -1, dim)
    key_value = qkv[:, num_heads * dim :].view(tokens, 2, num_kv_heads, dim)
    rotate_(query_key, cos, signed_sin)
    write_kv(layer, key_value, metadata)


class Glue(Protocol):
    """The decoder's element-wise work between its matrix products (see the module)."""

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Add ``delta`` to ``residual`` in place (if given); return the sum, normalized."""
        ...

    def rotate_write(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
    ) -> None:
        """Rotate queries and keys in place; write keys and values into the cache."""
        ...

    def head_rms_norm(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> None:
        """RMSNorm of each query head and each key head in place (Qwen3's before rotary)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused gate/up projection's output."""
        ...

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's ``argmax``, as ``torch.argmax(logits, dim=-1)`` gives it."""
        ...


@attrs.frozen
class TorchGlue:
    """:class:`Glue` as torch's operators: transformers' arithmetic, bit for bit in float32,
    on any device (the decoder's glue wherever the compiled one is not chosen, and always
    where ``exact`` arithmetic is asked for)."""

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Add ``delta`` to ``residual`` in place (if given); :func:`rms_norm` of the sum.

        The in-place add is ``residual + delta`` (one rounding), as transformers' residual
        stream adds.
        """
        if delta is not None:
            residual.add_(delta)
        return rms_norm(residual, weight, eps)

    def rotate_write(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
    ) -> None:
        """:func:`rotate_write`."""
        rotate_write(qkv, num_heads, num_kv_heads, cos, signed_sin, metadata, layer)

    def head_rms_norm(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> None:
        """:func:`rms_norm` of each query head and each key head of ``qkv`` ``[tokens,
        (num_heads + 2 * num_kv_heads) * head_dim]`` in place, with the heads' weights
        ``[head_dim]`` (transformers' Qwen3 norms before rotary)."""
        tokens, dim = qkv.shape[0], q_weight.shape[0]
        q_width, k_width = num_heads * dim, num_kv_heads * dim
        for weight, part in (
            (q_weight, qkv[:, :q_width]),
            (k_weight, qkv[:, q_width : q_width + k_width]),
        ):
            part.copy_(rms_norm(part.view(tokens, -1, dim), weight, eps).view(tokens, -1))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """:func:`silu_mul`."""
        return silu_mul(gate_up)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``torch.argmax(logits, dim=-1)``."""
        return logits.argmax(dim=-1)
