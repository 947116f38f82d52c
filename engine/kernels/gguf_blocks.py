"""Products by GGUF weights as the file stores them: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K and Q6_K blocks, in place.

A GGUF file holds most of a model's weights in llama.cpp's blocks of 32 (SmolLM2's
default file: every projection in Q4_1, the embedding and tied output head in Q8_0), or in
its "K" super-blocks of 256 (most downloaded files are Q4_K_M: Q4_K and Q6_K mixed). A
decode step streams every weight once, so its time is set by the bytes it reads: the blocks
are 0.56 (Q4_1) to 1.06 (Q8_0) bytes a weight, against 4 for the float32 the file used to
be dequantized to. ``gguf_blocks.c``, next to this module, multiplies by the blocks as they
lie in the file's memory map: the activations are quantized per block of 32 to 8 bits (a
scale, and the block's sum for the terms that do not depend on the weight), and each block's
(or K sub-block's) product is an integer dot product, as llama.cpp computes them: AVX2's
``VPMADDUBSW`` / ``VPMADDWD``; with AVX-512, the 32-block types two blocks to a 512-bit
vector (``VPDPBUSD`` in one instruction where the CPU has VNNI), the K types as with AVX2;
portable C on a CPU or personality without AVX2. The library says which path it was built
with (:attr:`BlockKernel.isa`, one of :data:`PATHS`); the CPU's personality
(:mod:`twostroke.gpu.isa`) decides, once, when it is built or loaded, and the suite runs
every path the machine can (its tests build one library per rung up to the machine's).

The K types take the same activations, quantized per 32 rather than per 256 as llama.cpp's
Q8_K does: a K sub-block is 32 weights, so its product is one integer dot product as a
32-block's is; one quantized row serves every part of a fused projection whatever their
types (a Q4_K_M file mixes Q4_K and Q6_K within one q/k/v); and a scale per 32 rounds the
activations no worse than one per 256, so the quality measured for the 32-blocks' rounding
holds for them. The price is a float multiply-add per 32 weights where Q8_K pays one per 256.

The quantized activations are the one departure from the file's own arithmetic: a product
equals the float64 product of the dequantized weights (``gguf.quants.dequantize``) by the
dequantized activations (:meth:`BlockKernel.quantize`) to float32 rounding of the per-block
sums (:func:`rounding_bound`); against the activations themselves it is off by their
rounding to 8 bits per block (about 0.4 % of a block's largest magnitude, at most). The
model-level effect is measured (docs/models.md).

So the products come in two forms (:data:`ACTIVATIONS`, a :class:`BlockKernel`'s
``activations``, chosen once at load and carried by each
:class:`~twostroke.engine.models.forms.BlockWeight`): ``"int8"``,
llama.cpp's arithmetic above (``quantization="gguf"``), and ``"float32"``
(``quantization="gguf_f32"``, and ``"auto"`` where it takes the blocks): each weight block is
dequantized in registers as :meth:`BlockKernel.rows` dequantizes it and multiplied by the
activations themselves in float32, so a product is the file's float32 dequantization times
the activations, to float32 rounding of the sums (:func:`rounding_bound`), for 1.2-1.7 times
the int8 form's time a product with AVX-512 and 1.5-1.8 times with AVX2 (docs/models.md),
the same bytes read.

It is built and cached as the other kernels are (:func:`~.build.compile_library`) and
checked at start against its own dequantized rows. Where it does not build, the model
loads the file dequantized, as before (one warning says why).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import attrs
import numpy as np
import torch

from twostroke.engine.kernels.build import (
    NativeBuildError,
    address,
    bind,
    call,
    compile_library,
)
from twostroke.engine.kernels.header import structures

__all__ = [
    "ACTIVATIONS",
    "BLOCK",
    "BLOCK_BYTES",
    "BLOCK_SOURCE",
    "DENSE_DTYPES",
    "DENSE_ELEMENTS",
    "DENSE_ROWS",
    "PATHS",
    "BlockKernel",
    "BlockOperand",
    "QuantizedRows",
    "StoredBlocks",
    "block_kernel",
    "block_weights",
    "build_blocks",
    "offset_magnitudes",
    "part_table",
    "random_blocks",
    "rounding_bound",
    "weight_structure",
]

#: The kernel's C source.
BLOCK_SOURCE = Path(__file__).with_name("gguf_blocks.c")

#: Weights an activation block holds (and a block of Q8_0, Q4_0, Q4_1, a sub-block of the
#: K types).
BLOCK = 32

#: Weights a K super-block holds.
SUPER = 256

# GGML's numbers of the types the library computes (``gguf.GGMLQuantizationType``); a GGUF
# file's names for them are the reader's business (:data:`~twostroke.engine.checkpoints.
# gguf.BLOCK_TYPES`).
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q5_K, _Q6_K = 2, 3, 6, 7, 8, 12, 13, 14

#: The types the library computes, by GGML's type number: the bytes a block of each takes
#: (the layout ``gguf_blocks.c`` reads).
BLOCK_BYTES: Mapping[int, int] = {
    _Q4_0: 18,
    _Q4_1: 20,
    _Q5_0: 22,
    _Q5_1: 24,
    _Q8_0: 34,
    _Q4_K: 144,
    _Q5_K: 176,
    _Q6_K: 210,
}

_SUPER_TYPES = frozenset({_Q4_K, _Q5_K, _Q6_K})

#: Rows of activations from which a product stops computing block by block: the parts'
#: blocks are dequantized into a float32 weight (the kernel's own rows, the team splitting
#: them) and torch multiplies (its float32 GEMM), the activations unrounded. Prefill chunks
#: take it. Measured on SmolLM2's Q4_1 layer (Intel Xeon, AVX-512 VNNI, 2 threads), the
#: blocks' time over the two steps': 0.86 by 32 rows, 1.21 by 64, 1.78 by 128, 2.27 by 512
#: (Q4_K: 0.73, 1.10, 1.63, 2.64; docs/models.md).
DENSE_ROWS = 64

#: The most weight elements the dense path dequantizes at once (32 MB of float32, in a buffer
#: each thread keeps): a larger weight is dequantized and multiplied a slice of its rows at a
#: time, so the buffer stays this size whatever the model's.
DENSE_ELEMENTS = 1 << 23

#: The element types the dense path multiplies in (:attr:`BlockKernel.dense_dtype`): float32,
#: or bfloat16 where the CPU multiplies it natively (oneDNN's AVX512-BF16 or AMX products:
#: 917 GFLOPS against float32's 186 for a [512, 2048] x [2048, 6144] product on 2 cores of an
#: AMD EPYC with AVX512-BF16).
DENSE_DTYPES = (torch.float32, torch.bfloat16)

#: How the products take their activations (:attr:`BlockKernel.activations`): ``"int8"``,
#: each row quantized per block of 32 to 8 bits and multiplied by integer dot products, as
#: llama.cpp computes (``quantization="gguf"``); ``"float32"``, the rows as they are, each
#: weight block dequantized in registers (``quantization="gguf_f32"``): the file's own model,
#: as its float32 dequantization computes it up to the order of the additions.
ACTIVATIONS = ("int8", "float32")

#: The block products' paths, by the number their library reports: portable C, AVX2,
#: AVX-512 (the 32-blocks two at a time in 512 bits) and AVX-512 with VNNI (``VPDPBUSD``).
#: The compile flags choose, which the CPU's personality sets (:mod:`twostroke.gpu.isa`).
PATHS = ("portable", "avx2", "avx512", "avx512_vnni")

_SYMBOLS = (
    "twostroke_blocks_path",
    "twostroke_quantize_rows",
    "twostroke_block_linear",
    "twostroke_block_linear_float",
    "twostroke_block_rows",
    "twostroke_block_rows_bf16",
    "twostroke_block_projection",
)

_log = logging.getLogger(__name__)


def block_weights(block_type: int) -> int:
    """Weights a block of ``block_type`` holds: 32, or 256 for a K type."""
    return SUPER if block_type in _SUPER_TYPES else BLOCK


def rounding_bound(block_type: int, in_features: int, activations: str = "int8") -> float:
    """How far a product may be from the float64 product of the same dequantized operands,
    as a multiple of :func:`offset_magnitudes`' bound on the summed terms.

    ``"int8"`` activations: a product sums, per activation block of 32, an exact integer dot
    product (under 2^24) times the float32 product of two scales (one rounding), added into a
    float32 lane (one more; a fused multiply-add in the AVX2 path, a multiply and an add in
    portable C: two), and per block (or K super-block) its offset term (one rounding for the
    product, one for the addition); then the lanes' horizontal sum (three additions) and the
    offsets' (one). gguf's own float32 dequantization rounds each weight up to three times
    more. So at most (3 blocks + 2 offset terms + 7) roundings of 2^-24, each relative to the
    terms' summed magnitudes (the first-order bound of recursive summation), doubled for the
    second-order terms that bound leaves out. The products measured stay under 1 % of it
    (random blocks, both paths); a single sub-block scale off by one exceeds it (the tests).

    ``"float32"`` activations: each weight is dequantized in float32 (up to three roundings,
    as the reference's own: a K sub-block's two scale products and a multiply-add), then
    multiplied and added into one of the path's lanes (a rounding a weight; a lane's chain
    holds ``in_features`` over the lanes: 16 with AVX-512, 8 with AVX2, 4 in portable C, the
    bound takes 4), and the lanes summed (at most fifteen additions): at most (6 +
    in_features / 4 + 15) roundings, doubled as above.
    """
    if activations == "float32":
        return 2.0 * (6 + in_features // 4 + 15) * 2.0**-24
    blocks = in_features // BLOCK
    offsets = in_features // block_weights(block_type)
    return 2.0 * (3 * blocks + 2 * offsets + 7) * 2.0**-24


def offset_magnitudes(data: np.ndarray[Any, Any], block_type: int) -> np.ndarray[Any, Any]:
    """Each weight's offset term in magnitude, float64 ``[out_features, in_features]``: Q4_0's
    ``8 |d|``, Q5_0's ``16 |d|``, Q4_1's and Q5_1's ``|m|``, Q4_K's and Q5_K's
    ``|dmin m_j|``, 0 for Q8_0 and Q6_K.

    The kernel sums a weight's scaled term and its offset term apart, so its rounding is
    bounded by ``|x| (|w| + 2 offset)`` summed over a row (``|d q| <= |w| + offset``), not by
    ``|x w|``, where the two nearly cancel.
    """
    rows = data.shape[0]
    size, width = BLOCK_BYTES[block_type], block_weights(block_type)
    blocks = data.reshape(-1, size)
    offset: np.ndarray[Any, Any]
    if block_type == _Q4_0:
        offset = 8 * np.abs(_halves(blocks, 0)).repeat(BLOCK, axis=1)
    elif block_type == _Q5_0:
        offset = 16 * np.abs(_halves(blocks, 0)).repeat(BLOCK, axis=1)
    elif block_type in (_Q4_1, _Q5_1):
        offset = np.abs(_halves(blocks, 2)).repeat(BLOCK, axis=1)
    elif block_type in (_Q4_K, _Q5_K):
        packed = blocks[:, 4:16].astype(np.int64)
        low, high = packed[:, 4:8] & 63, (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)
        mins = np.concatenate([low, high], axis=1)  # [blocks, 8]
        offset = (np.abs(_halves(blocks, 2)) * mins).repeat(BLOCK, axis=1)
    else:
        offset = np.zeros((blocks.shape[0], width))
    return offset.reshape(rows, -1)


def _halves(blocks: np.ndarray[Any, Any], at: int) -> np.ndarray[Any, Any]:
    """The float16 at byte ``at`` of each block, float64 ``[blocks, 1]``."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float64)


class StoredBlocks(Protocol):
    """One weight matrix in GGUF blocks as a product reads it (a file's tensor as stored:
    :class:`~twostroke.engine.checkpoints.gguf.BlockTensor`)."""

    @property
    def name(self) -> str: ...

    @property
    def block_type(self) -> int:
        """GGML's type number (a key of :data:`BLOCK_BYTES`)."""
        ...

    @property
    def columns(self) -> torch.Tensor | None:
        """Where each stored row's product goes (``int32 [out_features]``), or ``None``."""
        ...

    @property
    def order(self) -> torch.Tensor:
        """The stored rows in output order (``int64``, the inverse of ``columns``)."""
        ...

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @property
    def address(self) -> int:
        """Where the blocks are."""
        ...


class BlockOperand(Protocol):
    """A projection by one or more :class:`StoredBlocks` side by side in the output columns,
    as :meth:`BlockKernel.linear` reads it
    (:class:`~twostroke.engine.models.forms.BlockWeight`)."""

    @property
    def parts(self) -> tuple[StoredBlocks, ...]: ...

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...

    @property
    def table(self) -> Any:
        """The parts as :func:`part_table` lays them out."""
        ...

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each part's first output column."""
        ...


def part_table(parts: Sequence[StoredBlocks]) -> Any:
    """``parts`` as ``kernels.h``'s ``struct twostroke_block_part`` array, side by side in
    the output columns in order."""
    part_type = structures()["twostroke_block_part"]
    table = (part_type * len(parts))()
    offset = 0
    for entry, part in zip(table, parts, strict=True):
        columns = part.columns
        entry.type = part.block_type
        entry.out_features = part.out_features
        entry.blocks = part.address
        entry.columns = None if columns is None else columns.data_ptr()
        entry.offset = offset
        offset += part.out_features
    return table


def weight_structure(table: Any, count: int, activations: str) -> Any:
    """``kernels.h``'s ``struct twostroke_block_weight`` of a :func:`part_table` of
    ``count`` parts, for products taking ``activations`` (one of :data:`ACTIVATIONS`): what
    the decoder stack passes to :attr:`BlockKernel.address`'s projection."""
    return structures()["twostroke_block_weight"](table, count, int(activations == "float32"))


@attrs.frozen
class QuantizedRows:
    """Rows of activations quantized per block (:meth:`BlockKernel.quantize`).

    Attributes:
        q: int8 ``[rows, in_features]``.
        scales: float32 ``[rows, in_features / 32]``: each block's scale.
        sums: float32 ``[rows, in_features / 32]``: each block's scale times its sum.
    """

    q: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])

    def dequantized(self) -> torch.Tensor:
        """The values the products multiply by: float32 ``[rows, in_features]``."""
        rows, width = self.q.shape
        blocks = self.q.float().view(rows, width // BLOCK, BLOCK) * self.scales.unsqueeze(-1)
        return blocks.view(rows, width)


@attrs.frozen
class BlockKernel:
    """The compiled block products (see the module), in one of :data:`ACTIVATIONS`.

    Calls release the GIL (``ctypes`` drops it around foreign calls).

    Attributes:
        isa: The path the library computes with (one of :data:`PATHS`).
        path: The shared library.
        activations: How the products take their activations (one of :data:`ACTIVATIONS`),
            decided once at load (:meth:`taking`) and passed down with every
            :class:`~twostroke.engine.models.forms.BlockWeight` made of this kernel.
    """

    isa: str
    path: Path
    _quantize: Callable[..., None] = attrs.field(repr=False)
    _linear: Callable[..., int] = attrs.field(repr=False)
    _linear_float: Callable[..., int] = attrs.field(repr=False)
    _rows: Callable[..., int] = attrs.field(repr=False)
    _rows_bf16: Callable[..., int] = attrs.field(repr=False)
    _projection: Callable[..., int] = attrs.field(repr=False)
    activations: str = attrs.field(default="int8", validator=attrs.validators.in_(ACTIVATIONS))
    #: Rows from which a product is the dense path's (:data:`DENSE_ROWS`), or ``None``: block
    #: by block at every row count (:meth:`block_by_block`).
    dense_rows: int | None = DENSE_ROWS
    #: What the dense path multiplies in (one of :data:`DENSE_DTYPES`; :meth:`densely`).
    dense_dtype: torch.dtype = attrs.field(
        default=torch.float32, validator=attrs.validators.in_(DENSE_DTYPES)
    )

    #: The activations' dtype (the decoder stack's element type for these projections).
    element: ClassVar[torch.dtype] = torch.float32

    @property
    def most_rows(self) -> int | None:
        """The most rows a product takes block by block, which the decoder stack may hand
        it (``None``: any): from :attr:`dense_rows` on a product is torch's GEMM, which the
        stack does not call."""
        return None if self.dense_rows is None else self.dense_rows - 1

    def taking(self, activations: str) -> BlockKernel:
        """This kernel, its products taking ``activations`` (one of :data:`ACTIVATIONS`)."""
        return attrs.evolve(self, activations=activations)

    def densely(self, dtype: torch.dtype) -> BlockKernel:
        """This kernel, its dense path multiplying in ``dtype`` (one of :data:`DENSE_DTYPES`):
        in bfloat16 the rows and the dequantized weights are rounded to it (the rows finer
        than the blocks' own 8-bit activations), the products summed in float32 and each sum
        rounded to bfloat16, as torch's bfloat16 GEMM computes (the default dtype's
        arithmetic)."""
        return attrs.evolve(self, dense_dtype=dtype)

    def block_by_block(self) -> BlockKernel:
        """This kernel, multiplying block by block at every row count: no dense path, whose
        float32 GEMM sums a row another way than the blocks (and unrounded, where the
        activations are ``"int8"``), so a prompt's positions prefilled in a long chunk would
        compute other numbers than the same positions in a short one (a recomputed
        preempted request, a verified draft). The batch-invariant arrangement
        (``deterministic=True``); long prefills take 1.2-2.6x the dense path's time
        (:data:`DENSE_ROWS`)."""
        return attrs.evolve(self, dense_rows=None)

    @property
    def address(self) -> int:
        """Where the decoder stack's projection by blocks is (``twostroke_block_projection``:
        its ``weight`` is a :func:`weight_structure`)."""
        return address(self._projection)

    def quantize(self, x: torch.Tensor) -> QuantizedRows:
        """Quantize float32 ``x`` ``[rows, in_features]`` (a row stride allowed) per block.

        Raises:
            ValueError: another dtype or device, or a width not a multiple of 32.
        """
        if (
            x.dtype != torch.float32
            or x.dim() != 2
            or x.shape[1] % BLOCK
            or x.device.type != "cpu"
            or (x.shape[0] > 1 and x.stride(1) != 1)
        ):
            raise ValueError(
                "block products take float32 rows [rows, a multiple of 32] on the CPU; got "
                f"{x.dtype} {tuple(x.shape)} on {x.device}"
            )
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, width = int(x.shape[0]), int(x.shape[1])
        q = torch.empty((rows, width), dtype=torch.int8)
        scales = torch.empty((rows, width // BLOCK), dtype=torch.float32)
        sums = torch.empty_like(scales)
        call(
            self._quantize,
            x.data_ptr(),
            x.stride(0),
            rows,
            width,
            q.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
        )
        return QuantizedRows(q, scales, sums)

    def linear(self, x: torch.Tensor, weight: BlockOperand) -> torch.Tensor:
        """``x W^T`` for float32 ``x`` ``[rows, in_features]`` (a row stride allowed): one
        foreign call, which quantizes the rows once (``"int8"`` activations) and multiplies
        them by every part.

        Raises:
            ValueError: another dtype, device or width.
        """
        if (
            x.dtype != torch.float32
            or x.dim() != 2
            or x.shape[1] != weight.in_features
            or x.device.type != "cpu"
        ):
            raise ValueError(
                f"block products take float32 rows [rows, {weight.in_features}] on the CPU; "
                f"got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, out_features = int(x.shape[0]), weight.out_features
        dense_rows = self.dense_rows
        if dense_rows is not None and rows >= dense_rows:
            return self.dense(x, weight)
        out = torch.empty((rows, out_features), dtype=torch.float32)
        failed = call(
            self._linear_float if self.activations == "float32" else self._linear,
            x.data_ptr(),
            x.stride(0),
            rows,
            weight.in_features,
            weight.table,
            len(weight.parts),
            out.data_ptr(),
            out_features,
        )
        if failed == 2:
            raise MemoryError(f"the block products could not allocate scratch for {rows} rows")
        if failed:  # a BlockTensor holds only types the library computes
            raise NativeBuildError(f"the block library refused a type of {weight.parts}")
        return out

    def dense(self, x: torch.Tensor, weight: BlockOperand) -> torch.Tensor:
        """``x W^T`` by the dense path: the parts dequantized in :attr:`dense_dtype` (as
        :meth:`rows` does, rounded once where that is bfloat16, into a buffer this thread
        keeps), at most :data:`DENSE_ELEMENTS` weights at a time, and multiplied by torch's
        GEMM in that dtype. What :meth:`linear` does from :data:`DENSE_ROWS` rows on; x
        float32 ``[rows, in_features]`` with unit stride along a row. A float32 result
        whatever the dtype."""
        width, out_features = weight.in_features, weight.out_features
        rows = int(x.shape[0])
        dtype = self.dense_dtype
        sixteen = dtype != torch.float32
        inputs = x.to(dtype) if sixteen else x
        step = max(DENSE_ELEMENTS // width, 1)
        out = torch.empty((rows, out_features), dtype=torch.float32)
        buffer = _buffer(min(step, out_features) * width, dtype)
        dequantize = self._rows_bf16 if sixteen else self._rows
        for part, offset in zip(weight.parts, weight.offsets, strict=True):
            for start in range(0, part.out_features, step):
                count = min(step, part.out_features - start)
                dense = buffer[: count * width].view(count, width)
                failed = call(
                    dequantize,
                    part.block_type,
                    part.address,
                    width,
                    part.order[start:].data_ptr(),
                    count,
                    dense.data_ptr(),
                )
                if failed == 2:
                    raise MemoryError(f"the dense path could not allocate a row of {width}")
                if count == out_features and not sixteen:
                    torch.mm(inputs, dense.t(), out=out)  # the whole product: no copy
                else:
                    columns = out[:, offset + start : offset + start + count]
                    columns.copy_(torch.mm(inputs, dense.t()))
        return out

    def rows(self, weight: StoredBlocks, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``weight`` dequantized: float32 ``[len(ids), in_features]`` (in
        the stored row order).

        Raises:
            IndexError: an id outside the weight's rows.
        """
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        count = int(flat.shape[0])
        if count and (int(flat.min()) < 0 or int(flat.max()) >= weight.out_features):
            raise IndexError(f"{weight.name}: row ids must be in [0, {weight.out_features})")
        out = torch.empty((count, weight.in_features), dtype=torch.float32)
        call(
            self._rows,
            weight.block_type,
            weight.address,
            weight.in_features,
            flat.data_ptr(),
            count,
            out.data_ptr(),
        )
        return out.view(*ids.shape, weight.in_features)


_buffers = threading.local()


def _buffer(elements: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This thread's buffer of ``dtype`` of at least ``elements`` (kept for its later calls:
    a fresh one a call would fault its pages in each time)."""
    name = f"dense_{str(dtype).removeprefix('torch.')}"
    held: torch.Tensor | None = getattr(_buffers, name, None)
    if held is None or held.numel() < elements:
        held = torch.empty(elements, dtype=dtype)
        setattr(_buffers, name, held)
    return held[:elements]


def block_kernel() -> BlockKernel | None:
    """The compiled block products, or ``None`` where they do not build or check here
    (logged once as a warning, with the reason). Built (or loaded from the cache) the first
    time a process asks; later calls return the same one."""
    return _kernel()


@functools.cache
def _kernel() -> BlockKernel | None:
    try:
        return build_blocks()
    except NativeBuildError as error:
        _log.warning(
            "twostroke: the GGUF block products are unavailable (%s); GGUF files load dequantized",
            error,
        )
    return None


def build_blocks(
    *, environ: Mapping[str, str] | None = None, source: Path = BLOCK_SOURCE
) -> BlockKernel:
    """Compile (or load from the cache), load and check the kernel.

    Args:
        environ: Where ``$CC``, the cache folder and ``TWOSTROKE_CPU_ISA`` are read
            (``os.environ`` if ``None``): the personality decides AVX2 or portable C.
        source: The C source (another version's, with ``kernels.h`` and
            ``native_element.h`` beside it, to time a change against it side by side).

    Raises:
        NativeBuildError: no compiler, a failed compile or load, or products that disagree
            with its own dequantized rows; the message says which.
        ValueError: ``TWOSTROKE_CPU_ISA`` names no rung, or one above this CPU's.
    """
    env = os.environ if environ is None else environ
    library, path = compile_library(source, [], "the GGUF block products", env, symbols=_SYMBOLS)
    which, quantize, linear, linear_float, rows, rows_bf16, projection = (
        bind(library, path, name) for name in _SYMBOLS
    )
    kernel = BlockKernel(
        PATHS[which()],
        path,
        quantize=quantize,
        linear=linear,
        linear_float=linear_float,
        rows=rows,
        rows_bf16=rows_bf16,
        projection=projection,
    )
    _check(kernel)
    _check(kernel.taking("float32"))
    return kernel


def random_blocks(
    generator: np.random.Generator, block_type: int, out_features: int, in_features: int
) -> np.ndarray[Any, Any]:
    """Random blocks of ``block_type``, ``uint8 [out_features, row bytes]``: scales and
    minimums finite float16, everything else random bytes (every pattern of the other bytes
    is a valid block), for checks and tests. The float16 scales are drawn so that the
    weights are of about the same size whatever the type (a K type's integer sub-block
    scales multiply its d)."""
    size = BLOCK_BYTES[block_type]
    count = out_features * (in_features // block_weights(block_type))
    data = generator.integers(0, 256, (count, size), dtype=np.uint8)
    halves, at, spread = 1, 0, 0.02
    if block_type in (
        _Q4_1,
        _Q5_1,
        _Q4_K,
        _Q5_K,
    ):
        halves = 2
    if block_type in (_Q4_K, _Q5_K):
        spread = 0.02 / 32
    elif block_type == _Q6_K:
        at, spread = size - 2, 0.02 / 128
    scales = generator.normal(0, spread, (count, halves)).astype(np.float16)
    data[:, at : at + 2 * halves] = scales.view(np.uint8).reshape(count, 2 * halves)
    return data.reshape(out_features, -1)


@attrs.frozen
class _Operand:
    """One part's :class:`StoredBlocks` and :class:`BlockOperand` in one, for the check."""

    block_type: int
    data: np.ndarray[Any, Any]
    columns: torch.Tensor
    name: str = "check"

    @property
    def order(self) -> torch.Tensor:
        return torch.argsort(self.columns.to(torch.int64))

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def in_features(self) -> int:
        size = BLOCK_BYTES[self.block_type]
        return int(self.data.shape[1]) // size * block_weights(self.block_type)

    @property
    def address(self) -> int:
        return int(self.data.__array_interface__["data"][0])

    @property
    def parts(self) -> tuple[_Operand, ...]:
        return (self,)

    @property
    def offsets(self) -> tuple[int, ...]:
        return (0,)

    @property
    def table(self) -> Any:
        return part_table(self.parts)


def _check(kernel: BlockKernel) -> None:
    """Products of each type, several row counts and a permutation, against float64
    products of the kernel's own dequantized rows and activations (the last large enough
    for a thread team where the caller has more than one thread: 9 x 68 x 448 multiply-adds;
    9 x 68 x 512 for the K types), within :func:`rounding_bound`. The model loader calls it
    on one thread (a team would outlive the load on the caller's thread); the tests split
    the products across threads."""
    generator = np.random.default_rng(0)
    for block_type in BLOCK_BYTES:
        shapes = ((1, 7, 64), (6, 33, 96), (9, 68, 448))
        if block_type in _SUPER_TYPES:
            shapes = ((1, 7, 256), (6, 33, 256), (9, 68, 512))
        for rows, out_features, in_features in shapes:
            data = random_blocks(generator, block_type, out_features, in_features)
            columns = torch.from_numpy(generator.permutation(out_features).astype(np.int32))
            weight = _Operand(block_type, data, columns)
            x = torch.from_numpy(generator.normal(0, 1, (rows, in_features)).astype(np.float32))
            out = kernel.linear(x, weight)
            ids = torch.arange(out_features)
            if rows == 1:  # the dense path's bfloat16 rows: the float32 rows, rounded
                sixteen = torch.empty((out_features, in_features), dtype=torch.bfloat16)
                call(
                    kernel._rows_bf16,
                    block_type,
                    weight.address,
                    in_features,
                    ids.data_ptr(),
                    out_features,
                    sixteen.data_ptr(),
                )
                if not torch.equal(sixteen, kernel.rows(weight, ids).to(torch.bfloat16)):
                    raise NativeBuildError(
                        f"its bfloat16 rows of GGML type {block_type} are not its float32 "
                        "rows rounded as torch rounds them"
                    )
            dense = kernel.rows(weight, ids).double()
            activations = x.double()
            if kernel.activations == "int8":
                activations = kernel.quantize(x).dequantized().double()
            expected = (activations @ dense.T)[:, torch.argsort(columns)]
            terms = dense.abs() + 2 * torch.from_numpy(offset_magnitudes(data, block_type))
            bound = (activations.abs() @ terms.T)[:, torch.argsort(columns)]
            worst = float(((out.double() - expected).abs() / bound.clamp_min(1e-30)).max())
            allowed = rounding_bound(block_type, in_features, kernel.activations)
            if not worst <= allowed:
                raise NativeBuildError(
                    f"its check of GGML type {block_type} ({kernel.activations} activations) "
                    f"differs from float64 by {worst:.3g} of the terms' magnitude (at most "
                    f"{allowed:.3g} allowed)"
                )
