"""The decoder's projection layer: dense, packed for oneDNN or twostroke's own kernel, or
holding reduced-precision weights.

:class:`Linear` is ``y = x W^T + b`` with uninitialized parameters (the loader fills them).
Once loaded, its weight may be replaced for speed, never back: packed into oneDNN's blocked
layout (:meth:`Linear.pack`, where :func:`can_pack` says it works), laid out in panels for
the compiled bfloat16 kernel (:meth:`Linear.pack_panels`, see
:mod:`~twostroke.engine.kernels.projection`) or held in float16 / int8 for fbgemm
(:meth:`Linear.quantize`, see :mod:`~twostroke.engine.models.quantization`).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from twostroke.engine.kernels.projection import PanelWeight, ProjectionKernel
from twostroke.engine.models.quantization import Quantization, QuantizedWeight

__all__ = ["Linear", "WeightForm", "can_pack", "empty_parameter", "pack", "packed_linear"]

#: How a projection holds its weight, each form with its kernel: ``"dense"`` (``F.linear``:
#: MKL in float32, oneDNN in bfloat16), ``"onednn"`` (packed once for oneDNN),
#: ``"fp16"`` and ``"int8"`` (reduced precision for fbgemm,
#: :mod:`~twostroke.engine.models.quantization`), ``"panels"`` (laid out for the compiled
#: bfloat16 projection, :mod:`~twostroke.engine.kernels.projection`).
WeightForm = Literal["dense", "onednn", "fp16", "int8", "panels"]


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialized, frozen parameter: the loader fills it."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b`` with uninitialized parameters (the loader fills them).

    On the CPU, :meth:`pack` turns the weight into oneDNN's blocked layout once loaded (see
    :func:`can_pack` for when): a product with a packed weight skips the per-call reorder.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.packed = False
        self.quantized: QuantizedWeight | None = None
        self.panels: PanelWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return self.panels(x)
        if self.quantized is not None:
            return self.quantized(x)
        if self.packed:
            return packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        """Replace the weight by its oneDNN-packed copy (see :func:`can_pack`); no way back."""
        if not self.packed and self.quantized is None and self.panels is None:
            self.weight = nn.Parameter(pack(self.weight), requires_grad=False)
            self.packed = True

    def quantize(self, kind: Quantization) -> None:
        """Replace weight and bias by a :class:`QuantizedWeight`; no way back.

        The dense weight is dropped (an empty tensor stays in its place), so the module
        holds one copy of its weights.
        """
        if self.quantized is None and not self.packed and self.panels is None:
            self.quantized = QuantizedWeight(self.weight, self.bias, kind)
            self._drop_weight()

    def pack_panels(self, kernel: ProjectionKernel, into: torch.Tensor | None = None) -> None:
        """Replace weight and bias by ``kernel``'s panels (a bfloat16 weight); no way back.

        Like :meth:`quantize`, the dense weight is dropped, so the module holds one copy.
        ``into`` is where the panels go (see :meth:`ProjectionKernel.pack`).
        """
        if self.panels is None and self.quantized is None and not self.packed:
            self.panels = kernel.pack(self.weight, self.bias, into=into)
            self._drop_weight()

    def _drop_weight(self) -> None:
        self.weight = empty_parameter(0, dtype=self.weight.dtype, device=self.weight.device)
        self.bias = None


def can_pack(dtype: torch.dtype, device: torch.device, *, exact: bool = True) -> bool:
    """Whether :meth:`Linear.pack` works here: bfloat16, or float32 unless ``exact``, on a CPU.

    * bfloat16: its plain products already run in oneDNN, so packed ones give the same
      results bit for bit (about 2x faster for one row and 1.3x for 32, measured on an
      AVX-512-BF16 EPYC).
    * float32: plain products run in MKL, whose results are transformers' own. oneDNN's
      packed products round differently (about 1e-6 of a projection's largest output; up
      to 1.3e-4 on SmolLM2's logits) and are faster: SmolLM2's 30-layer projection stack
      took 36.0 ms packed against 43.7 ms at one row and 107 against 164 ms at 32 rows
      (2 threads, AVX2 EPYC, docs/performance.md). So float32 packs only where transformers'
      arithmetic is not asked for (``exact=False``: ``dtype="auto"``); ``dtype="float32"``
      keeps MKL's products.
    * float16: not packed.

    oneDNN's packed products are the private ops behind ``torch.compile``'s CPU weight
    freezing, so rather than trust a version number this runs one tiny product both ways
    and packs only if the op exists and agrees with ``F.linear`` (bit for bit in bfloat16,
    to float32 rounding otherwise).

    Args:
        dtype: The weights' dtype.
        device: Where they live.
        exact: Whether float32 must compute exactly what ``F.linear`` does.
    """
    if device.type != "cpu":
        return False
    if dtype == torch.bfloat16 or (dtype == torch.float32 and not exact):
        return _packing_works(dtype)
    return False


#: The batch size oneDNN lays a packed weight out for, per dtype. float32: vLLM-CPU's
#: choice (32, its ``create_onednn_mm``), and the fastest here at every batch measured, 1 to
#: 256 rows (hint 1 was 1.06-1.58x slower from 1 to 64 rows). bfloat16: 1, as measured when
#: its packing was added.
_PACK_BATCH_HINT = {torch.bfloat16: 1, torch.float32: 32}


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 16, generator=generator).to(dtype)
    bias = torch.randn(24, generator=generator).to(dtype)
    x = torch.randn(3, 16, generator=generator).to(dtype)
    try:
        with torch.inference_mode():
            packed = packed_linear(x, pack(weight), bias)
    except (RuntimeError, AttributeError):  # op missing, or the CPU lacks the dtype
        return False
    expected = F.linear(x, weight, bias)
    if dtype == torch.bfloat16:
        return torch.equal(packed, expected)
    return bool(torch.allclose(packed, expected, rtol=1e-5, atol=1e-5))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout for its dtype's batch hint (see :func:`can_pack`)."""
    hint = _PACK_BATCH_HINT[weight.dtype]
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), hint)
    return packed


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` with a weight :func:`pack` packed."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out
