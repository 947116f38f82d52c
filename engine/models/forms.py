"""Every form a projection's weight takes, each a callable that computes with its kernel.

A :class:`~twostroke.engine.models.linear.Linear` computes ``y = x W^T + b`` by one
:class:`LinearMethod`, an object that holds the weight in the form its kernel reads and
multiplies by it when called, as vLLM gives each layer one ``quant_method``. A projection
starts in full precision (:class:`FullPrecision`, ``F.linear`` on uninitialized parameters
the loader fills); once loaded, the form the run's plan names
(:class:`~twostroke.engine.models.choice.Projections`) replaces it, once, never back:

* :class:`OneDNNWeight`: packed into oneDNN's blocked layout (where :func:`can_pack` says
  it works);
* :class:`QuantizedWeight`: float16 or int8 for fbgemm
  (:mod:`~twostroke.engine.models.quantization` says where its kernels run);
* :class:`PanelWeight`: laid out in panels for the compiled bfloat16 kernel
  (:mod:`~twostroke.engine.kernels.projection`), and :class:`SplitByRows` beside oneDNN's
  packed copy where AMX tiles take large products;
* :class:`BlockWeight`: a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K
  blocks as stored, read in place from its memory map (the ``"blocks"`` form: the model
  builds it from the blocks the loader handed it, never from a full-precision weight), and
  :class:`BlockEmbedding`, the embedding's lookup from them.

The kernels' floor (:mod:`twostroke.engine.kernels`) knows tensors and C; each form here
holds what its kernel reads and calls it.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Any, Literal, Protocol

import attrs
import torch
import torch.nn.functional as F

from twostroke.engine.checkpoints.gguf import BlockTensor
from twostroke.engine.kernels.gguf_blocks import BlockKernel, part_table
from twostroke.engine.kernels.header import structures
from twostroke.engine.kernels.projection import ProjectionKernel

__all__ = [
    "QUANTIZATIONS",
    "BlockEmbedding",
    "BlockWeight",
    "FullPrecision",
    "LinearMethod",
    "OneDNNWeight",
    "PanelWeight",
    "Quantization",
    "QuantizedWeight",
    "SplitByRows",
    "WeightForm",
    "can_pack",
    "pack",
    "packed_linear",
    "weight_method",
]

#: How a projection holds its weight, each form with its kernel: ``"dense"`` (``F.linear``:
#: MKL in float32, oneDNN in bfloat16), ``"onednn"`` (packed once for oneDNN),
#: ``"fp16"`` and ``"int8"`` (reduced precision for fbgemm,
#: :class:`QuantizedWeight`), ``"panels"`` (laid out for the compiled bfloat16 projection,
#: :class:`PanelWeight`), ``"blocks"`` (a GGUF file's blocks as stored, :class:`BlockWeight`).
WeightForm = Literal["dense", "onednn", "fp16", "int8", "panels", "blocks"]


#: A weight precision for the projections: float16, or int8 with per-channel scales.
Quantization = Literal["fp16", "int8"]
QUANTIZATIONS: tuple[Quantization, ...] = ("fp16", "int8")


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
    AMX tiles: :data:`~twostroke.engine.models.choice.AMX_PANEL_ROWS`). The two round
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
            :meth:`PanelWeight.pack`).
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
        panels = PanelWeight.pack(kernel, weight, bias, into=into)
        if panel_rows is None:
            return panels
        return SplitByRows(panels, OneDNNWeight.pack(weight, bias), panel_rows)
    return QuantizedWeight(weight, bias, form)


class QuantizedWeight:
    """One projection's weight (and bias) prepacked for an fbgemm kernel.

    Computes ``x W^T + b`` in float32 (inputs in another dtype are cast to float32 and the
    result back), with ``W`` rounded to float16 or to int8 per output channel.

    Args:
        weight: ``[out_features, in_features]``, any floating dtype.
        bias: ``[out_features]`` or ``None``.
        kind: ``"fp16"`` or ``"int8"``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: Quantization) -> None:
        weight = weight.detach().to(torch.float32)
        bias = None if bias is None else bias.detach().to(torch.float32)
        self.kind: Quantization = kind
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        if kind == "fp16":
            self._packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
        else:
            self._packed = torch.ops.quantized.linear_prepack(_int8_per_channel(weight), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != torch.float32:
            x = x.to(torch.float32)
        if self.kind == "fp16":
            out: torch.Tensor = torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
        else:
            # reduce_range: 7-bit activations, so AVX2's 8-bit multiply-adds cannot saturate.
            out = torch.ops.quantized.linear_dynamic(x, self._packed, True)
        return out if dtype == torch.float32 else out.to(dtype)

    def __repr__(self) -> str:
        return f"<QuantizedWeight {self.kind} {self.out_features}x{self.in_features}>"


def _int8_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output channel: scale = the row's largest magnitude / 127."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_(min=1e-12).to(torch.float64)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():
        # torch 2.13 warns that quantized tensor creation is deprecated: this is the
        # deliberate use that kernel_available() checks at start.
        warnings.filterwarnings(
            "ignore", message=r"torch\.quantize_per_tensor", category=UserWarning
        )
        return torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)


@attrs.frozen
class PanelWeight:
    """A weight (and bias) laid out in the compiled bfloat16 kernel's panels (:meth:`pack`);
    call it with ``x``.

    Attributes:
        kernel: The kernel it was packed for.
        panels: bfloat16 ``[panels, in_features // 2, panel, 2]``, zero past
            ``out_features``.
        bias: float32 ``[panels * panel]`` or ``None``.
        out_features: Output width.
        in_features: Input width.
        addresses: Where ``panels`` and ``bias`` (or ``None``) are, for the kernel's calls.
    """

    kernel: ProjectionKernel
    panels: torch.Tensor = attrs.field(repr=False)
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    addresses: tuple[int, int | None] = attrs.field(init=False, repr=False)

    @classmethod
    def pack(
        cls,
        kernel: ProjectionKernel,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        into: torch.Tensor | None = None,
    ) -> PanelWeight:
        """Lay ``weight`` (and ``bias``) out for ``kernel``; the originals are not kept
        (:meth:`~twostroke.engine.kernels.projection.ProjectionKernel.lay_out`)."""
        panels, padded_bias = kernel.lay_out(weight, bias, into=into)
        return cls(kernel, panels, padded_bias, int(weight.shape[0]), int(weight.shape[1]))

    @addresses.default
    def _addresses(self) -> tuple[int, int | None]:
        return self.panels.data_ptr(), None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, read back from the panels: bfloat16 ``[*ids.shape,
        in_features]``, the values it was packed from exactly. A tied embedding looks up
        its tokens here, so the model holds the matrix once (the ids are the engine's,
        checked against the vocabulary before they reach a step)."""
        panel = self.kernel.panel
        flat = ids.reshape(-1)
        # [panels, pairs, panel, 2] indexed by (panel, column): [len(ids), pairs, 2].
        found = self.panels[torch.div(flat, panel, rounding_mode="floor"), :, flat % panel, :]
        return found.reshape(*ids.shape, self.in_features)


@attrs.frozen
class BlockWeight:
    """A projection computed from GGUF blocks as stored: a
    :class:`LinearMethod`.

    A fused projection (q/k/v, gate/up) holds one :class:`BlockTensor` per part, side by
    side in the output columns; the activations are quantized once a call.

    Attributes:
        kernel: The compiled products (their activations decided at load: its
            ``activations``).
        parts: The parts, in output order.
        bias: float32 ``[out_features]`` or ``None``.
    """

    kernel: BlockKernel
    parts: tuple[BlockTensor, ...]
    bias: torch.Tensor | None = None
    in_features: int = attrs.field(init=False)
    out_features: int = attrs.field(init=False)
    table: Any = attrs.field(init=False, repr=False, eq=False)
    _weight: Any = attrs.field(init=False, repr=False, eq=False)
    #: The parts as ``kernels.h``'s ``struct twostroke_block_weight`` (what the decoder
    #: stack passes to :attr:`BlockKernel.address`'s projection), and the bias's address.
    addresses: tuple[int, int | None] = attrs.field(init=False, repr=False, eq=False)

    @in_features.default
    def _in_features(self) -> int:
        widths = {part.in_features for part in self.parts}
        if len(widths) != 1:
            raise ValueError(f"the parts of a projection differ in width: {sorted(widths)}")
        return widths.pop()

    @out_features.default
    def _out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @table.default
    def _table(self) -> Any:
        """The parts as ``kernels.h``'s ``struct twostroke_block_part`` array (made once)."""
        return part_table(self.parts)

    @_weight.default
    def _weight_structure(self) -> Any:
        float_activations = int(self.kernel.activations == "float32")
        return structures()["twostroke_block_weight"](
            self.table, len(self.parts), float_activations
        )

    @addresses.default
    def _addresses(self) -> tuple[int, int | None]:
        bias = self.bias
        if bias is not None and (
            bias.dtype != torch.float32
            or tuple(bias.shape) != (self.out_features,)
            or not bias.is_contiguous()
        ):
            raise ValueError(
                f"a block projection's bias must be contiguous float32 [{self.out_features}], "
                f"got {bias.dtype} {tuple(bias.shape)}"
            )
        return ctypes.addressof(self._weight), None if bias is None else bias.data_ptr()

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each part's first output column (as :attr:`table` holds them)."""
        return tuple(int(entry.offset) for entry in self.table)

    @property
    def nbytes(self) -> int:
        """Bytes of blocks a product reads."""
        return sum(part.nbytes for part in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` for float32 ``x`` ``[..., in_features]``."""
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self.kernel.linear(flat, self)
        if self.bias is not None:
            out += self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


@attrs.frozen
class BlockEmbedding:
    """An embedding read from GGUF blocks: a lookup dequantizes only the rows it needs.

    Attributes:
        kernel: The compiled kernel.
        weight: ``[vocab_size, hidden]`` in blocks.
    """

    kernel: BlockKernel
    weight: BlockTensor

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.rows(self.weight, ids)


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
