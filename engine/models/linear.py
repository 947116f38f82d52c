"""The decoder's projection layer, and the forms its weight takes: one callable each.

:class:`Linear` is ``y = x W^T + b`` computed by one :class:`LinearMethod`, an object that
holds the weight in the form its kernel reads and multiplies by it when called, as vLLM
gives each layer one ``quant_method``. A projection starts in full precision
(:class:`FullPrecision`, ``F.linear`` on uninitialized parameters the loader fills); once
loaded, the model's chosen form (:class:`~twostroke.engine.kernels.selection.Projections`)
replaces it, once, never back:

* :class:`OneDNNWeight`: packed into oneDNN's blocked layout (where :func:`can_pack` says
  it works);
* :class:`~twostroke.engine.models.quantization.QuantizedWeight`: float16 or int8 for
  fbgemm (:mod:`~twostroke.engine.models.quantization`);
* :class:`~twostroke.engine.kernels.projection.PanelWeight`: laid out in panels for the
  compiled bfloat16 kernel (:mod:`~twostroke.engine.kernels.projection`).

* :class:`~twostroke.engine.kernels.gguf_blocks.BlockWeight`: a GGUF file's Q8_0, Q4_0,
  Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K blocks as stored, read in place from its memory map (the
  ``"blocks"`` form: the model builds it from the blocks the loader handed it, never from a
  full-precision weight).
"""

from __future__ import annotations

import functools
from typing import Literal, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from twostroke.engine.kernels.projection import PanelWeight, ProjectionKernel
from twostroke.engine.models.quantization import QuantizedWeight

__all__ = [
    "FullPrecision",
    "Linear",
    "LinearMethod",
    "OneDNNWeight",
    "SplitByRows",
    "WeightForm",
    "can_pack",
    "empty_parameter",
    "pack",
    "packed_linear",
    "weight_method",
]

#: How a projection holds its weight, each form with its kernel: ``"dense"`` (``F.linear``:
#: MKL in float32, oneDNN in bfloat16), ``"onednn"`` (packed once for oneDNN),
#: ``"fp16"`` and ``"int8"`` (reduced precision for fbgemm,
#: :mod:`~twostroke.engine.models.quantization`), ``"panels"`` (laid out for the compiled
#: bfloat16 projection, :mod:`~twostroke.engine.kernels.projection`), ``"blocks"`` (a GGUF
#: file's blocks as stored, :mod:`~twostroke.engine.kernels.gguf_blocks`).
WeightForm = Literal["dense", "onednn", "fp16", "int8", "panels", "blocks"]


class LinearMethod(Protocol):
    """One projection's weight (and bias) in the form a kernel reads: ``method(x)`` is
    ``x W^T + b`` for ``x`` ``[..., in_features]``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@attrs.frozen
class FullPrecision:
    """The weight as it was loaded: ``F.linear`` (MKL's products in float32, oneDNN's plain
    ones in bfloat16: transformers' own).

    Attributes:
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or ``None``.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@attrs.frozen
class OneDNNWeight:
    """The weight packed once in oneDNN's blocked layout (:func:`pack`): a product skips
    the per-call reorder (see :func:`can_pack` for where it is made, and what it costs).

    In float32 a product of one row is computed as two (the row twice): oneDNN's one-row
    path can sum a row another way than its path for more, by the instruction set, the
    weight's shape and the threads that packed it (below AVX2 it did for SmolLM2's every
    projection packed on one thread, as the loader packs), while from two rows on a row's
    result was the same among 2 to 300 rows, at one thread or two, on every rung, measured.
    So a row's result never depends on the rows beside it: greedy answers must not change
    with the traffic (docs/models.md, "One answer per request"). bfloat16's one-row
    products agreed with the rest everywhere measured.

    Attributes:
        weight: The packed weight.
        bias: ``[out_features]`` or ``None``.
        one_row_apart: Whether a one-row product is computed as two.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    one_row_apart: bool = False

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> OneDNNWeight:
        """Pack ``weight`` (its dtype's batch hint); ``bias`` is kept as it is."""
        return cls(pack(weight), bias, weight.dtype == torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_row_apart and x.numel() == x.shape[-1]:
            row = x.reshape(1, -1)
            out = packed_linear(torch.cat((row, row)), self.weight, self.bias)[:1]
            return out.view(*x.shape[:-1], out.shape[-1])
        return packed_linear(x, self.weight, self.bias)


@attrs.frozen
class SplitByRows:
    """Two forms of one weight, chosen by the rows of each product: the compiled panels up
    to ``most_rows`` rows, oneDNN's packed weight beyond (where its bfloat16 products run on
    AMX tiles: :data:`~twostroke.engine.kernels.selection.AMX_PANEL_ROWS`). The two round
    the same float32 sums to bfloat16 in another order, so a row's result can depend on the
    rows beside it, to bfloat16 rounding.

    Attributes:
        few: The panels (what the compiled stack reads).
        many: The oneDNN-packed weight.
        most_rows: The most rows ``few`` takes.
    """

    few: PanelWeight
    many: OneDNNWeight
    most_rows: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return self.few(x) if rows <= self.most_rows else self.many(x)


def weight_method(
    form: WeightForm,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    kernel: ProjectionKernel | None = None,
    into: torch.Tensor | None = None,
    panel_rows: int | None = None,
) -> LinearMethod:
    """``weight`` and ``bias`` (full precision) in ``form``; the originals are not kept
    unless ``form`` is ``"dense"``.

    Args:
        form: The form.
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or ``None``.
        kernel: The compiled projection, for ``"panels"``.
        into: Where the panels go (see
            :meth:`~twostroke.engine.kernels.projection.ProjectionKernel.pack`).
        panel_rows: For ``"panels"``, the most rows the panels take: a :class:`SplitByRows`
            keeps a oneDNN-packed copy for more (``None``: the panels take all).

    Raises:
        ValueError: ``"panels"`` without a kernel, or ``"blocks"`` (blocks come from a
            GGUF file, not from a full-precision weight).
    """
    if form == "blocks":
        raise ValueError(
            "the 'blocks' form is a GGUF file's blocks as stored: it is not made from a "
            "full-precision weight"
        )
    if form == "dense":
        return FullPrecision(weight, bias)
    if form == "onednn":
        return OneDNNWeight.pack(weight, bias)
    if form == "panels":
        if kernel is None:
            raise ValueError("the 'panels' form needs the compiled projection kernel")
        panels = kernel.pack(weight, bias, into=into)
        if panel_rows is None:
            return panels
        return SplitByRows(panels, OneDNNWeight.pack(weight, bias), panel_rows)
    return QuantizedWeight(weight, bias, form)


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialized, frozen parameter: the loader fills it."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b``, computed by :attr:`method` (see the module).

    Its parameters are uninitialized (the loader fills them) and exist while the weight is
    in full precision: a method that holds the weight in another form replaces them, so the
    module holds one copy. A projection that shares another module's weight (the tied output
    projection and the embedding, :meth:`tied`) registers no parameter of its own.

    Attributes:
        in_features: Input width.
        out_features: Output width.
        weight: The full-precision weight while the module computes with it (an empty
            tensor after, ``None`` where the weight is shared).
        bias: The bias while it does, or ``None``.
        method: What computes the product.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None

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
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.method: LinearMethod = FullPrecision(self.weight, self.bias)

    @classmethod
    def tied(cls, weight: nn.Parameter) -> Linear:
        """A projection by ``weight``, another module's ``[out_features, in_features]``
        parameter (the embedding, for a tied output projection): it is not registered here,
        so the state dict holds it once, under its owner's name, and stays dense when this
        projection takes another form (a copy in that form)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = int(weight.shape[1]), int(weight.shape[0])
        linear.register_parameter("weight", None)
        linear.register_parameter("bias", None)
        linear.method = FullPrecision(weight, None)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method(x)

    def use(self, method: LinearMethod) -> None:
        """Compute with ``method`` from now on, in place of full precision; no way back.

        The full-precision parameters are dropped (an empty weight stays in their place), so
        the module holds one copy of its weights.

        Raises:
            RuntimeError: the projection computes with another form already (a form is
                chosen once).
        """
        self._full_precision()
        self.method = method
        if self.weight is not None:
            self.weight = empty_parameter(0, dtype=self.weight.dtype, device=self.weight.device)
            self.bias = None

    def convert(
        self,
        form: WeightForm,
        *,
        kernel: ProjectionKernel | None = None,
        into: torch.Tensor | None = None,
        panel_rows: int | None = None,
    ) -> None:
        """Take ``form`` (:func:`weight_method`) of the full-precision weight; ``"dense"``
        keeps it.

        Raises:
            RuntimeError: the weight is in another form already.
        """
        dense = self._full_precision()
        if form != "dense":
            method = weight_method(
                form, dense.weight, dense.bias, kernel=kernel, into=into, panel_rows=panel_rows
            )
            self.use(method)

    def _full_precision(self) -> FullPrecision:
        method = self.method
        if isinstance(method, FullPrecision):
            return method
        raise RuntimeError(
            f"the projection computes with {type(method).__name__} already: its weight form "
            "is chosen once"
        )


def can_pack(dtype: torch.dtype, device: torch.device, *, exact: bool = True) -> bool:
    """Whether :class:`OneDNNWeight` works here: bfloat16, or float32 unless ``exact``, on a CPU.

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
