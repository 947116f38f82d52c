"""The bfloat16 projection kernel emulated in Python, for CPUs without AVX512-BF16.

The compiled projection (``projection_bf16.c``) runs only with AVX512-BF16, so on other CPUs
the paths built on it (a decoder's projections in panels, the tied head's panels, the
compiled decoder stack that calls the kernel by pointer) would go untested. This module
gives them a kernel with the same C signature (``twostroke_projection_fn`` of ``kernels.h``)
and the same panel layout, written as a ctypes callback: its address is a C function
pointer, so the compiled stack calls it as it calls the real one. Its products are float32
sums rounded to bfloat16 once, as the real kernel's, in torch's order; tests compare paths
that all run on it, never it against the real kernel.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from twostroke.engine.kernels.projection import ProjectionKernel

#: Output columns per panel, as the real kernel's.
PANEL = 48

_SIGNATURE = ctypes.CFUNCTYPE(
    None,
    ctypes.c_void_p,  # x
    ctypes.c_ssize_t,  # x_stride
    ctypes.c_ssize_t,  # rows
    ctypes.c_ssize_t,  # in_features
    ctypes.c_void_p,  # panels
    ctypes.c_ssize_t,  # out_features
    ctypes.c_void_p,  # bias (float32) or NULL
    ctypes.c_void_p,  # out
    ctypes.c_ssize_t,  # out_stride
)


def _at(address: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` at ``address``, as a tensor sharing the memory."""
    size = count * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=torch.uint8).view(
        dtype
    )


def _project(
    x: int,
    x_stride: int,
    rows: int,
    in_features: int,
    panels: int,
    out_features: int,
    bias: int | None,
    out: int,
    out_stride: int,
) -> None:
    if rows == 0:
        return
    count = -(-out_features // PANEL)
    weight = _at(panels, count * PANEL * in_features, torch.bfloat16)
    weight = weight.view(count, in_features // 2, PANEL, 2).permute(0, 2, 1, 3)
    weight = weight.reshape(count * PANEL, in_features)[:out_features].float()
    inputs = _at(x, (rows - 1) * x_stride + in_features, torch.bfloat16)
    product = inputs.as_strided((rows, in_features), (x_stride, 1)).float() @ weight.T
    if bias:
        product += _at(bias, out_features, torch.float32)
    written = _at(out, (rows - 1) * out_stride + out_features, torch.bfloat16)
    written.as_strided((rows, out_features), (out_stride, 1)).copy_(product.to(torch.bfloat16))


#: Kept for the life of the process: the stack holds its address.
_CALLBACK = _SIGNATURE(_project)


@functools.cache
def emulated_projection() -> ProjectionKernel:
    """The :class:`ProjectionKernel` whose entry point is the Python emulation (one per
    process, as the compiled one: a stack checks its layers were packed for its kernel)."""
    return ProjectionKernel(PANEL, Path("emulated"), function=_CALLBACK)
