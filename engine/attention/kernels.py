"""The kernels that attend a step's decodes, by name, and the compiled one for a cache.

:func:`~twostroke.engine.models.choice.select_kernels` chooses one when a model loads
(the cache's layout follows it); :mod:`~twostroke.engine.attention.metadata` lays each step
out for the kernel it is given, :mod:`~twostroke.engine.attention.ops` runs torch's kernels
and :mod:`~twostroke.engine.kernels.paged_attention` the compiled one.
"""

from __future__ import annotations

from typing import Literal

import torch

from twostroke.engine.kernels.paged_attention import PagedDecodeKernel, paged_decode_kernel

__all__ = [
    "AttentionKernel",
    "default_kernel",
    "native_kernel",
    "transposes_keys",
]

#: How decodes attend: ``"native"`` reads keys and values in place through the block tables
#: in one compiled call per layer (:mod:`~twostroke.engine.kernels.paged_attention`),
#: ``"bag"`` does with two ``embedding_bag`` calls (with either, the cache holds each block's keys
#: transposed), or over gathered histories: batched matrix products with a float32 softmax
#: between them (``"matmul"``), or ``scaled_dot_product_attention`` (``"sdpa"``).
AttentionKernel = Literal["native", "bag", "matmul", "sdpa"]


def default_kernel(device: torch.device) -> AttentionKernel:
    """SDPA on CUDA (its fused kernels win there), in-place bags elsewhere.

    On the CPU the bags beat gathering the histories for the products: SmolLM2's batch-32
    decode step, whole, measured in one process on an AVX2 EPYC (see docs/performance.md).
    """
    return "sdpa" if device.type == "cuda" else "bag"


def native_kernel(
    device: torch.device,
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
) -> PagedDecodeKernel:
    """The compiled decode attention for this cache on ``device`` (built on first use):
    queries and output in ``dtype``, the cache in ``cache_dtype`` (``None``: ``dtype``).

    Raises:
        ValueError: it does not run here: not the CPU, an element type it is not built
            for, or a failed build (logged, see
            :func:`~twostroke.engine.kernels.paged_attention.paged_decode_kernel`).
    """
    kernel = None
    if device.type == "cpu":
        kernel = paged_decode_kernel(
            block_size=block_size,
            head_dim=head_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            dtype=dtype,
            cache_dtype=cache_dtype,
        )
    if kernel is None:
        cache = "" if cache_dtype in (None, dtype) else f" over a {cache_dtype} cache"
        raise ValueError(
            f"the 'native' kernel does not run for {dtype}{cache} on {device.type} here "
            "(see twostroke.engine.kernels.paged_attention)"
        )
    return kernel


def transposes_keys(kernel: AttentionKernel) -> bool:
    """Whether ``kernel`` reads a cache whose blocks hold their keys as ``[head_dim,
    block_size]`` (the in-place kernels, ``"native"`` and ``"bag"``)."""
    return kernel in ("bag", "native")
