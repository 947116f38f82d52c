"""The CPU's attention over the paged cache in C, compiled on this machine when first needed.

torch has no operator that attends over a paged cache in place, so the CPU's decodes either
gather their histories (a copy per layer) or sum them with ``embedding_bag`` (the ``"bag"``
kernel: two calls and a softmax between them, each tile summed once per query head), and
prefill chunks gather theirs for SDPA. ``paged_decode.c``, next to this module, does a
layer's decodes in one call, and a step's chunks (prefills, with the decodes among them) in
one call too: each reads its key and value tiles once, through the block table, a block's
tiles for every head at once, for all the query heads (and, in a chunk, the tile of query
tokens) that share them, and prefetches the next block while it sums this one
(docs/performance.md has the figures). Both take a sliding window (:func:`window_start`):
a token then reads only the blocks its window reaches.

It is compiled by :func:`~twostroke.engine.kernels.build.compile_library` with the model's
shape as constants (block size, head width, query heads per key/value head) and kept in the
artifact cache. A fresh library attends one small random batch, decodes and chunks, and must
agree with a plain torch computation of the same attention; it is used only then. Where
there is no compiler, the build fails, or the check disagrees, one warning is logged and
the runner keeps the ``"bag"`` kernel, which reads the same cache layout.
``TWOSTROKE_NATIVE=0`` turns it off without a word.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import torch

from twostroke.engine.kernels.build import (
    CACHE_ELEMENTS,
    ELEMENTS,
    NativeBuildError,
    address,
    bind,
    call,
    compile_library,
    element_defines,
    vector_bits,
)

__all__ = [
    "SOURCE",
    "SYMBOLS",
    "PagedDecodeKernel",
    "build_kernel",
    "paged_decode_kernel",
    "reference_paged_decode",
    "reference_paged_prefill",
    "window_start",
]

#: The kernel's C source.
SOURCE = Path(__file__).with_name("paged_decode.c")

#: The functions this module takes from the library (:func:`.build.compile_library`
#: checks each is there).
SYMBOLS = ("twostroke_paged_decode", "twostroke_paged_prefill")

#: Largest difference from the reference the start-up check accepts, per element type
#: (float32 differs by summation order and the polynomial exp; bfloat16 also by rounding
#: its output).
_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

_log = logging.getLogger(__name__)


def window_start(length: int, window: int | None) -> int:
    """The first position a token attends to, where it attends to ``length`` positions
    (its own is ``length - 1``) through a sliding window of ``window`` (``None``: none).

    transformers' convention (``sliding_window_overlay`` in ``masking_utils``: ``kv_idx >
    q_idx - sliding_window``, as Mistral and Gemma 3 use it): the query at position ``p``
    sees ``(p - window, p]``, ``window`` positions counting its own, so ``window - 1``
    before it.
    """
    return 0 if window is None else max(0, length - window)


def _window_argument(window: int | None) -> int:
    """``window`` as the C kernels take it: 0 for none.

    Raises:
        ValueError: ``window`` is below 1 (a query always sees its own position).
    """
    if window is None:
        return 0
    if window < 1:
        raise ValueError(
            f"a sliding window must be >= 1 (a query sees its own position), got {window}"
        )
    return window


@attrs.frozen
class PagedDecodeKernel:
    """One compiled kernel: decode attention for one cache shape and element type.

    Call it once per layer with the step's decodes (their rows are consecutive in the
    batch). The GIL is released for the whole call (``ctypes`` drops it around foreign
    calls), so the bookkeeping stroke runs meanwhile.

    Attributes:
        block_size: Positions per cache block.
        head_dim: Width of a head.
        group: Query heads per key/value head.
        dtype: Element type of the queries and the output.
        path: The shared library.
        vector_bits: The widest vectors its code uses (512, 256 or 128: which of its
            paths the instruction set it was built for took; :func:`.build.vector_bits`).
        cache_dtype: Element type of the cache it reads (the engine's ``kv_cache_dtype``):
            widened to float32 as it is read, where it is not ``dtype``.
    """

    block_size: int
    head_dim: int
    group: int
    dtype: torch.dtype
    path: Path
    vector_bits: int
    _function: Callable[..., int] = attrs.field(repr=False)
    _prefill: Callable[..., int] = attrs.field(repr=False)
    cache_dtype: torch.dtype = attrs.field(kw_only=True)

    @cache_dtype.default
    def _same_as_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def addresses(self) -> tuple[int, int]:
        """Where the decode and the prefill entry points are (for ``decoder_stack.c``)."""
        return address(self._function), address(self._prefill)

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Attend each decode's query heads over its history (its window's share of it).

        Args:
            query: ``[R, heads, head_dim]`` with unit stride along ``head_dim`` and rows of
                ``head_dim`` (the q/k/v projection's output viewed as queries qualifies).
            keys: One layer's key tiles, ``[num_blocks, kv_heads, head_dim, block_size]``
                in memory, contiguous (any view starting at the first tile).
            values: One layer's value tiles, ``[num_blocks, kv_heads, block_size,
                head_dim]``, contiguous.
            tables: int32 ``[R, W]``, row ``r`` the blocks of decode ``r`` in order,
                contiguous rows. Block ids are not checked here: each must name a block
                of the cache (``AttentionMetadata.build`` checks them).
            lengths: int32 ``[R]``: the positions decode ``r`` attends to, each at least 1
                and at most ``W * block_size``.
            scale: Multiplies the scores.
            window: Each decode attends to its last ``window`` positions only
                (:func:`window_start`); blocks wholly before them are not read, so their
                table entries may name any block of the cache. ``None``: all of them.

        Returns:
            ``[R, heads * head_dim]`` in ``dtype``.

        Raises:
            ValueError: a tensor of another dtype, or a cache of another shape, than the
                kernel was built for (it would read the wrong bytes); a window below 1.
            RuntimeError: the kernel could not allocate its scratch memory.
        """
        dtype, cached = self.dtype, self.cache_dtype
        if (
            query.dtype != dtype
            or keys.dtype != cached
            or values.dtype != cached
            or tables.dtype != torch.int32
            or lengths.dtype != torch.int32
            or keys.shape[-1] != self.block_size
            or values.shape[-1] != self.head_dim
            or query.shape[-1] != self.head_dim
        ):
            raise ValueError(
                f"the kernel takes {dtype} queries, a {cached} cache with blocks of "
                f"{self.block_size} and heads of {self.head_dim}, and int32 tables and "
                f"lengths; got query "
                f"{query.dtype} {tuple(query.shape)}, keys {keys.dtype} {tuple(keys.shape)}, "
                f"values {values.dtype} {tuple(values.shape)}, tables {tables.dtype}, "
                f"lengths {lengths.dtype}"
            )
        window_argument = _window_argument(window)
        decodes, heads, _ = query.shape
        if query.stride(2) != 1 or query.stride(1) != self.head_dim:
            query = query.contiguous()
        out = query.new_empty(decodes, heads * self.head_dim)
        failed = call(
            self._function,
            query.data_ptr(),
            query.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lengths.data_ptr(),
            decodes,
            heads // self.group,
            scale,
            window_argument,
            out.data_ptr(),
        )
        if failed:
            raise RuntimeError("the paged decode kernel could not allocate its scratch memory")
        return out

    def prefill(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        offsets: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
    ) -> None:
        """Attend chunks of consecutive query tokens (prefills) over their histories.

        Token ``i`` of chunk ``c`` sits at position ``starts[c] + i`` and attends to every
        position up to its own (within ``window``); the chunks' keys and values must be
        written already. Its query is row ``offsets[c] + i`` of ``query`` and its output
        goes to that row of ``out``. Each tile of query tokens reads its key tiles once for
        all its heads.

        Args:
            query: ``[T, heads, head_dim]`` with unit stride along ``head_dim`` and rows of
                ``head_dim``.
            keys, values: As for :meth:`__call__`.
            tables: int32 ``[C, W]``, row ``c`` the blocks of chunk ``c`` in order, covering
                its last position; contiguous rows. Block ids are not checked here.
            starts: int32 ``[C]``, each chunk's first position.
            counts: int32 ``[C]``, each chunk's tokens, at least 1.
            offsets: int32 ``[C]``, each chunk's first row in ``query`` and ``out``.
            scale: Multiplies the scores.
            out: ``[T, heads * head_dim]`` in ``dtype``, unit stride along a row: the rows
                of the chunks' tokens are written, no others.
            window: Each token attends to its last ``window`` positions only
                (:func:`window_start`); ``None``: all of them.

        Raises:
            ValueError: a tensor of another dtype or shape than the kernel was built for;
                a window below 1.
            RuntimeError: the kernel could not allocate its scratch memory.
        """
        dtype, cached = self.dtype, self.cache_dtype
        int32 = torch.int32
        if (
            query.dtype != dtype
            or keys.dtype != cached
            or values.dtype != cached
            or out.dtype != dtype
            or tables.dtype != int32
            or starts.dtype != int32
            or counts.dtype != int32
            or offsets.dtype != int32
            or keys.shape[-1] != self.block_size
            or values.shape[-1] != self.head_dim
            or query.shape[-1] != self.head_dim
            or out.stride(-1) != 1
            or out.shape[-1] != query.shape[1] * self.head_dim
        ):
            raise ValueError(
                f"the kernel takes {dtype} queries and output, a {cached} cache with blocks "
                f"of {self.block_size} and heads of {self.head_dim}, and int32 tables, starts, "
                f"counts and offsets; got query {query.dtype} {tuple(query.shape)}, keys "
                f"{keys.dtype} {tuple(keys.shape)}, values {values.dtype} "
                f"{tuple(values.shape)}, out {out.dtype} {tuple(out.shape)}, tables "
                f"{tables.dtype}, starts {starts.dtype}, counts {counts.dtype}, offsets "
                f"{offsets.dtype}"
            )
        window_argument = _window_argument(window)
        if query.stride(2) != 1 or query.stride(1) != self.head_dim:
            query = query.contiguous()
        failed = call(
            self._prefill,
            query.data_ptr(),
            query.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            starts.data_ptr(),
            counts.data_ptr(),
            offsets.data_ptr(),
            starts.shape[0],
            query.shape[1] // self.group,
            scale,
            window_argument,
            out.data_ptr(),
            out.stride(0),
        )
        if failed:
            raise RuntimeError("the paged prefill kernel could not allocate its scratch memory")


def paged_decode_kernel(
    *,
    block_size: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
) -> PagedDecodeKernel | None:
    """The native kernel for this cache shape and element types, or ``None`` where none runs.

    Built (or loaded from the cache) and checked the first time a shape is asked for in a
    process; later calls return the same kernel. ``None`` for element types other than
    float32 and bfloat16 (queries) and float32, float16 and bfloat16 (the cache, ``None``:
    ``dtype``), and where the build or its check fails (logged once as a warning, with the
    reason).
    """
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    if dtype not in ELEMENTS or cache_dtype not in CACHE_ELEMENTS:
        return None
    if num_heads % num_kv_heads:
        return None
    return _kernel(block_size, head_dim, num_heads // num_kv_heads, dtype, cache_dtype)


@functools.cache
def _kernel(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype, cache_dtype: torch.dtype
) -> PagedDecodeKernel | None:
    try:
        kernel = build_kernel(
            block_size=block_size,
            head_dim=head_dim,
            group=group,
            dtype=dtype,
            cache_dtype=cache_dtype,
        )
    except NativeBuildError as error:
        _log.warning(
            "twostroke: the native paged decode kernel is unavailable (%s); decodes attend "
            "with the 'bag' kernel instead",
            error,
        )
        return None
    return kernel


def build_kernel(
    *,
    block_size: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    environ: Mapping[str, str] | None = None,
) -> PagedDecodeKernel:
    """Compile (or load from the cache), load and check the kernel for one shape.

    Args:
        block_size: Positions per cache block.
        head_dim: Width of a head.
        group: Query heads per key/value head.
        dtype: The queries' and the output's: float32 or bfloat16.
        cache_dtype: The cache's: float32, float16 or bfloat16 (``None``: ``dtype``).
        environ: Where ``$CC`` and the cache folder are read (``os.environ`` if ``None``).

    Raises:
        NativeBuildError: no compiler, a failed compile or load, or results that disagree
            with :func:`reference_paged_decode`; the message says which.
        ValueError: a size below 1, or an element type the kernel is not built for.
    """
    for name, value in (("block_size", block_size), ("head_dim", head_dim), ("group", group)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    env = os.environ if environ is None else environ
    defines = [f"-DBLOCK_SIZE={block_size}", f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}"]
    defines += element_defines(dtype, cache_dtype)
    library, path = compile_library(
        SOURCE, defines, "the paged decode kernel", env, symbols=SYMBOLS, dtype=dtype
    )
    function = bind(library, path, "twostroke_paged_decode")
    prefill = bind(library, path, "twostroke_paged_prefill")
    kernel = PagedDecodeKernel(
        block_size,
        head_dim,
        group,
        dtype,
        path,
        vector_bits(library),
        function=function,
        prefill=prefill,
        cache_dtype=cache_dtype,
    )
    _check(kernel)
    return kernel


def reference_paged_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """What :class:`PagedDecodeKernel` computes, in plain torch, in float32 (for checks).

    Same arguments, with ``keys`` ``[num_blocks, kv_heads, head_dim, block_size]`` and
    ``values`` ``[num_blocks, kv_heads, block_size, head_dim]`` as tensors of that shape.
    Only the window's blocks are read, as the kernel reads them.
    """
    decodes, heads, head_dim = query.shape
    kv_heads, block_size = keys.shape[1], keys.shape[3]
    group = heads // kv_heads
    out = torch.empty(decodes, heads, head_dim)
    for row in range(decodes):
        length = int(lengths[row])
        first = window_start(length, window) // block_size
        blocks = tables[row, first : -(-length // block_size)].long()
        seen = slice(window_start(length, window) - first * block_size, length - first * block_size)
        k = keys[blocks].float().permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)[:, seen]
        v = values[blocks].float().transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, seen]
        q = query[row].float().view(kv_heads, group, head_dim)
        probs = torch.softmax(scale * q @ k.transpose(1, 2), dim=-1)
        out[row] = (probs @ v).view(heads, head_dim)
    return out.view(decodes, -1)


def reference_paged_prefill(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """What :meth:`PagedDecodeKernel.prefill` writes, in float32 (for checks): each token
    of each chunk as a decode of its own length; ``[T, heads * head_dim]``, rows that no
    chunk covers zero."""
    rows, chunk_tables, lengths = [], [], []
    for c in range(starts.shape[0]):
        for i in range(int(counts[c])):
            rows.append(int(offsets[c]) + i)
            chunk_tables.append(tables[c])
            lengths.append(int(starts[c]) + i + 1)
    out = torch.zeros(query.shape[0], query.shape[1] * query.shape[2])
    out[rows] = reference_paged_decode(
        query[rows],
        keys,
        values,
        torch.stack(chunk_tables),
        torch.tensor(lengths, dtype=torch.int32),
        scale,
        window,
    )
    return out


def _check(kernel: PagedDecodeKernel) -> None:
    """Run ``kernel`` on a small random batch against :func:`reference_paged_decode`, and
    its prefill on chunks of the same histories against :func:`reference_paged_prefill`.

    The batch has a shared block, a partly filled last block, a one-position history and
    garbage (NaN) in the slots no decode reads; the chunks start inside a block and span
    several tiles of query tokens, the last one partly filled. The chunks are attended a
    second time through a sliding window that starts inside a block.
    """
    size, dim, group, dtype = kernel.block_size, kernel.head_dim, kernel.group, kernel.dtype
    generator = torch.Generator().manual_seed(0)
    kv_heads, num_blocks = 2, 7
    cached = kernel.cache_dtype
    keys = torch.randn(num_blocks, kv_heads, dim, size, generator=generator).to(cached)
    values = torch.randn(num_blocks, kv_heads, size, dim, generator=generator).to(cached)
    tables = torch.tensor([[5, 2, 0], [5, 3, 6], [1, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([2 * size + 1, 3 * size, 1], dtype=torch.int32)
    for last in (0, 1):  # the last blocks of rows 0 and 2, one position written
        keys[last, :, :, 1:] = float("nan")
        values[last, :, 1:] = float("nan")
    query = torch.randn(3, kv_heads * group, dim, generator=generator).to(dtype)
    scale = dim**-0.5
    try:
        got = kernel(query, keys, values, tables, lengths, scale).float()
    except RuntimeError as error:
        raise NativeBuildError(f"the kernel's check failed: {error}") from error
    expected = reference_paged_decode(query, keys, values, tables, lengths, scale)
    difference = float((got - expected).abs().max()) if got.isfinite().all() else float("inf")
    starts = torch.tensor([size - 1, 0, 0], dtype=torch.int32)
    counts = torch.tensor([2 * size + 1, 2 * size + 1, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 2 * size + 1, 4 * size + 2], dtype=torch.int32)
    tokens = torch.randn(4 * size + 3, kv_heads * group, dim, generator=generator).to(dtype)
    chunk_tables = tables[[1, 0, 2]].contiguous()
    attended = torch.zeros(4 * size + 3, kv_heads * group * dim, dtype=dtype)
    try:
        kernel.prefill(tokens, keys, values, chunk_tables, starts, counts, offsets, scale, attended)
    except RuntimeError as error:
        raise NativeBuildError(f"the kernel's check failed: {error}") from error
    expected = reference_paged_prefill(
        tokens, keys, values, chunk_tables, starts, counts, offsets, scale
    )
    window = size + 1
    windowed = torch.zeros_like(attended)
    try:
        kernel.prefill(
            tokens, keys, values, chunk_tables, starts, counts, offsets, scale, windowed, window
        )
    except RuntimeError as error:
        raise NativeBuildError(f"the kernel's check failed: {error}") from error
    expected_windowed = reference_paged_prefill(
        tokens, keys, values, chunk_tables, starts, counts, offsets, scale, window
    )
    if attended.isfinite().all() and windowed.isfinite().all():
        difference = max(
            difference,
            float((attended.float() - expected).abs().max()),
            float((windowed.float() - expected_windowed).abs().max()),
        )
    else:
        difference = float("inf")
    if not difference <= _TOLERANCE[dtype]:
        raise NativeBuildError(
            f"its check differs from torch by {difference:.3g} (at most "
            f"{_TOLERANCE[dtype]:g} allowed for {dtype})"
        )
