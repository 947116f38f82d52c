"""Which kernel attends a step's decodes: by device, and on the CPU by what the machine built.

:mod:`~twostroke.engine.attention.metadata` lays a step out for the kernel chosen
here; :mod:`~twostroke.engine.attention.ops` and
:mod:`~twostroke.engine.kernels.build` hold the kernels. A runner chooses once, when it
allocates its KV cache (:func:`best_kernel`), since the cache's layout follows the kernel.
"""

from __future__ import annotations

from typing import Literal

import torch

from twostroke.engine.kernels.build import native_wanted
from twostroke.engine.kernels.paged_attention import PagedDecodeKernel, paged_decode_kernel

__all__ = [
    "AttentionKernel",
    "best_kernel",
    "default_kernel",
    "native_kernel",
    "transposes_keys",
]

#: How decodes attend: ``"native"`` reads keys and values in place through the block tables
#: in one compiled call per layer (:mod:`~twostroke.engine.kernels.build`), ``"bag"`` does
#: with two ``embedding_bag`` calls (with either, the cache holds each block's keys
#: transposed), or over gathered histories: batched matrix products with a float32 softmax
#: between them (``"matmul"``), or ``scaled_dot_product_attention`` (``"sdpa"``).
AttentionKernel = Literal["native", "bag", "matmul", "sdpa"]


def default_kernel(device: torch.device) -> AttentionKernel:
    """SDPA on CUDA (its fused kernels win there), in-place bags elsewhere.

    On the CPU the bags beat gathering the histories for the products: SmolLM2's batch-32
    decode step, whole, measured in one process on an AVX2 EPYC (see docs/performance.md).
    """
    return "sdpa" if device.type == "cuda" else "bag"


def best_kernel(
    device: torch.device,
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> AttentionKernel:
    """:func:`default_kernel`, or ``"native"`` in place of ``"bag"`` where it runs and is
    wanted (``TWOSTROKE_NATIVE=0`` keeps ``"bag"``).

    The compiled kernel reads the bag kernel's cache layout in one call per layer (1.7-1.9x
    faster on SmolLM2's batch-32 attention, docs/performance.md); it is built, or loaded
    from the cache, by this call
    (:func:`~twostroke.engine.kernels.paged_attention.paged_decode_kernel`).
    """
    kernel = default_kernel(device)
    if kernel != "bag" or not native_wanted():
        return kernel
    try:
        native_kernel(
            device,
            block_size=block_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
        )
    except ValueError:  # logged where the build failed
        return "bag"
    return "native"


def native_kernel(
    device: torch.device,
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> PagedDecodeKernel:
    """The compiled decode attention for this cache on ``device`` (built on first use).

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
        )
    if kernel is None:
        raise ValueError(
            f"the 'native' kernel does not run for {dtype} on {device.type} here "
            "(see twostroke.engine.kernels.build)"
        )
    return kernel


def transposes_keys(kernel: AttentionKernel) -> bool:
    """Whether ``kernel`` reads a cache whose blocks hold their keys as ``[head_dim,
    block_size]`` (the in-place kernels, ``"native"`` and ``"bag"``)."""
    return kernel in ("bag", "native")
