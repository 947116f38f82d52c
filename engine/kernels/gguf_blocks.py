"""Products by GGUF weights as the file stores them: Q8_0, Q4_0 and Q4_1 blocks, in place.

A GGUF file holds most of a model's weights in llama.cpp's blocks of 32 (SmolLM2's
default file: every projection in Q4_1, the embedding and tied output head in Q8_0). A
decode step streams every weight once, so its time is set by the bytes it reads: the blocks
are 0.56 (Q4_1) to 1.06 (Q8_0) bytes a weight, against 4 for the float32 the file used to
be dequantized to. ``gguf_blocks.c``, next to this module, multiplies by the blocks as they
lie in the file's memory map: the activations are quantized per block of 32 to 8 bits (a
scale, and the block's sum for the terms that do not depend on the weight), and each block's
product is an integer dot product (AVX2's ``VPMADDUBSW`` / ``VPMADDWD``, or portable C on a
CPU or personality without AVX2), as llama.cpp computes them. The library says which path it
was built with (:attr:`BlockKernel.avx2`); the CPU's personality
(:mod:`twostroke.gpu.isa`) decides, once, when it is built or loaded. No AVX-512 or VNNI
path: this development machine (AVX2) cannot run one, and the suite cannot test it.

The quantized activations are the one departure from the file's own arithmetic: a product
equals the float64 product of the dequantized weights (``gguf.quants.dequantize``) by the
dequantized activations (:meth:`BlockKernel.quantize`) to float32 rounding of the per-block
sums; against the activations themselves it is off by their rounding to 8 bits per block
(about 0.4 % of a block's largest magnitude, at most). The model-level effect is measured
(docs/models.md).

It is built and cached as the other kernels are (:func:`~.build.compile_library`) and
checked at start against its own dequantized rows. Where it does not build, the model
loads the file dequantized, as before (one warning says why).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from twostroke.engine.kernels.build import NativeBuildError, bind, call, compile_library
from twostroke.engine.kernels.header import structures

__all__ = [
    "BLOCK",
    "BLOCK_BYTES",
    "BLOCK_SOURCE",
    "BLOCK_TYPES",
    "BlockEmbedding",
    "BlockKernel",
    "BlockTensor",
    "BlockWeight",
    "QuantizedRows",
    "block_kernel",
    "build_blocks",
    "random_blocks",
]

#: The kernel's C source.
BLOCK_SOURCE = Path(__file__).with_name("gguf_blocks.c")

#: Weights a block holds, for every type here.
BLOCK = 32

#: The block types computed as stored: name to GGML's type number
#: (``gguf.GGMLQuantizationType``).
BLOCK_TYPES: Mapping[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}

#: Bytes a block of each type takes, by GGML's type number.
BLOCK_BYTES: Mapping[int, int] = {2: 18, 3: 20, 8: 34}

_SYMBOLS = (
    "twostroke_blocks_avx2",
    "twostroke_quantize_rows",
    "twostroke_block_linear",
    "twostroke_block_rows",
)

#: Largest difference the start-up check accepts between a product and the float64 product
#: of the same dequantized operands, relative to the sum of the products' magnitudes:
#: float32 rounding of the per-block sums.
_TOLERANCE = 1e-5

_log = logging.getLogger(__name__)


def _type_name(block_type: int) -> str:
    return next((name for name, number in BLOCK_TYPES.items() if number == block_type), "?")


@attrs.frozen
class BlockTensor:
    """One weight matrix in GGUF blocks, as the file stores it (not copied).

    Attributes:
        name: The file's name for it (``blk.0.attn_q.weight``).
        block_type: GGML's type number (one of :data:`BLOCK_TYPES`).
        data: ``uint8 [out_features, row bytes]``: each weight row's blocks, in order (a
            view of the file's memory map; read only).
        columns: Where each stored row's product goes among the output columns
            (``int32 [out_features]``, a permutation), or ``None`` for the stored order:
            GGUF's rotary order of the q/k rows is undone this way, the blocks untouched.
    """

    name: str
    block_type: int
    data: np.ndarray[Any, Any] = attrs.field(repr=False)
    columns: torch.Tensor | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        size = BLOCK_BYTES.get(self.block_type)
        if size is None:
            raise ValueError(
                f"{self.name}: block type {self.block_type} is not one of {dict(BLOCK_TYPES)}"
            )
        if self.data.dtype != np.uint8 or self.data.ndim != 2 or self.data.shape[1] % size:
            raise ValueError(
                f"{self.name}: blocks must be uint8 [rows, a multiple of {size} bytes], got "
                f"{self.data.dtype} {self.data.shape}"
            )
        if not self.data.flags.c_contiguous:
            raise ValueError(f"{self.name}: blocks must be contiguous")
        columns = self.columns
        if columns is not None and (
            columns.dtype != torch.int32 or tuple(columns.shape) != (self.out_features,)
        ):
            raise ValueError(
                f"{self.name}: columns must be int32 [{self.out_features}], got "
                f"{columns.dtype} {tuple(columns.shape)}"
            )

    @property
    def type_name(self) -> str:
        """``"Q4_1"``, ...."""
        return _type_name(self.block_type)

    @property
    def out_features(self) -> int:
        """Stored weight rows."""
        return int(self.data.shape[0])

    @property
    def in_features(self) -> int:
        """Weights a row."""
        return int(self.data.shape[1]) // BLOCK_BYTES[self.block_type] * BLOCK

    @property
    def address(self) -> int:
        """Where the blocks are."""
        return int(self.data.__array_interface__["data"][0])

    @property
    def nbytes(self) -> int:
        """Bytes the blocks take."""
        return int(self.data.nbytes)


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
    """The compiled block products (see the module).

    Calls release the GIL (``ctypes`` drops it around foreign calls).

    Attributes:
        avx2: Whether the library computes with AVX2 (else portable C).
        path: The shared library.
    """

    avx2: bool
    path: Path
    _quantize: Callable[..., None] = attrs.field(repr=False)
    _linear: Callable[..., int] = attrs.field(repr=False)
    _rows: Callable[..., int] = attrs.field(repr=False)

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

    def linear(self, x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
        """``x W^T`` for float32 ``x`` ``[rows, in_features]`` (a row stride allowed): one
        foreign call, which quantizes the rows once and multiplies them by every part.

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
        out = torch.empty((rows, out_features), dtype=torch.float32)
        failed = call(
            self._linear,
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
        if failed:  # BlockTensor holds only types the library computes
            raise NativeBuildError(f"the block library refused a type of {weight.parts}")
        return out

    def rows(self, weight: BlockTensor, ids: torch.Tensor) -> torch.Tensor:
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


@attrs.frozen
class BlockWeight:
    """A projection computed from GGUF blocks as stored: a
    :class:`~twostroke.engine.models.linear.LinearMethod`.

    A fused projection (q/k/v, gate/up) holds one :class:`BlockTensor` per part, side by
    side in the output columns; the activations are quantized once a call.

    Attributes:
        kernel: The compiled products.
        parts: The parts, in output order.
        bias: float32 ``[out_features]`` or ``None``.
    """

    kernel: BlockKernel
    parts: tuple[BlockTensor, ...]
    bias: torch.Tensor | None = None
    in_features: int = attrs.field(init=False)
    out_features: int = attrs.field(init=False)
    table: Any = attrs.field(init=False, repr=False, eq=False)

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
        part_type = structures()["twostroke_block_part"]
        table = (part_type * len(self.parts))()
        offset = 0
        for entry, part in zip(table, self.parts, strict=True):
            columns = part.columns
            entry.type = part.block_type
            entry.out_features = part.out_features
            entry.blocks = part.address
            entry.columns = None if columns is None else columns.data_ptr()
            entry.offset = offset
            offset += part.out_features
        return table

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


def build_blocks(*, environ: Mapping[str, str] | None = None) -> BlockKernel:
    """Compile (or load from the cache), load and check the kernel.

    Args:
        environ: Where ``$CC``, the cache folder and ``TWOSTROKE_CPU_ISA`` are read
            (``os.environ`` if ``None``): the personality decides AVX2 or portable C.

    Raises:
        NativeBuildError: no compiler, a failed compile or load, or products that disagree
            with its own dequantized rows; the message says which.
        ValueError: ``TWOSTROKE_CPU_ISA`` names no rung, or one above this CPU's.
    """
    env = os.environ if environ is None else environ
    library, path = compile_library(
        BLOCK_SOURCE, [], "the GGUF block products", env, symbols=_SYMBOLS
    )
    avx2, quantize, linear, rows = (bind(library, path, name) for name in _SYMBOLS)
    kernel = BlockKernel(bool(avx2()), path, quantize=quantize, linear=linear, rows=rows)
    _check(kernel)
    return kernel


def random_blocks(
    generator: np.random.Generator, block_type: int, out_features: int, in_features: int
) -> np.ndarray[Any, Any]:
    """Random blocks of ``block_type``, ``uint8 [out_features, row bytes]``: scales and
    minimums finite float16, everything else random bytes (for checks and tests)."""
    size = BLOCK_BYTES[block_type]
    count = out_features * (in_features // BLOCK)
    data = generator.integers(0, 256, (count, size), dtype=np.uint8)
    halves = 2 if block_type == BLOCK_TYPES["Q4_1"] else 1
    scales = generator.normal(0, 0.02, (count, halves)).astype(np.float16)
    data[:, : 2 * halves] = scales.view(np.uint8).reshape(count, 2 * halves)
    return data.reshape(out_features, -1)


def _check(kernel: BlockKernel) -> None:
    """Products of each type, several row counts and a permutation, against float64
    products of the kernel's own dequantized rows and activations (the last large enough
    for the thread team: 9 x 68 x 448 multiply-adds)."""
    generator = np.random.default_rng(0)
    for block_type in BLOCK_TYPES.values():
        for rows, out_features, in_features in ((1, 7, 64), (6, 33, 96), (9, 68, 448)):
            data = random_blocks(generator, block_type, out_features, in_features)
            columns = torch.from_numpy(generator.permutation(out_features).astype(np.int32))
            weight = BlockTensor("check", block_type, data, columns)
            x = torch.from_numpy(generator.normal(0, 1, (rows, in_features)).astype(np.float32))
            quantized = kernel.quantize(x)
            out = BlockWeight(kernel, (weight,))(x)
            dense = kernel.rows(weight, torch.arange(out_features)).double()
            products = quantized.dequantized().double().unsqueeze(1) * dense.unsqueeze(0)
            expected = products.sum(-1)[:, torch.argsort(columns)]
            bound = products.abs().sum(-1)[:, torch.argsort(columns)]
            worst = float(((out.double() - expected).abs() / bound.clamp_min(1e-30)).max())
            if not worst <= _TOLERANCE:
                raise NativeBuildError(
                    f"its {_type_name(block_type)} check differs from float64 by {worst:.3g} "
                    f"of the products' magnitude (at most {_TOLERANCE:g} allowed)"
                )
