"""The layout of one step's attention, computed once per step and shared by every layer.

A step's chunks (decodes of one token, prefill chunks, chunks of recomputed requests) become
write slots for the new keys and values, gather indices into the paged cache, and masks.
Decodes are batched, padded to the longest history, and split into groups when the padding
saved outweighs one more call, or when one group's padded histories would exceed a bound
(:func:`split_decodes`); every other chunk gets a call of its own. This module holds only
that index arithmetic, for the kernel it is given (chosen once, when the model loaded:
:mod:`~twostroke.engine.models.choice`); the kernels are in
:mod:`twostroke.engine.attention.ops` and :mod:`twostroke.engine.kernels.paged_attention`.

Layers with a sliding window (:meth:`AttentionMetadata.windowed`) share the step's layout:
only their masks differ, made once per step and window when the first such layer asks. Where
a model's windowed layers keep their KV apart from its global layers'
(:mod:`~twostroke.engine.runners.window_kv`), they get a layout of their own, over their
own block tables (:meth:`AttentionMetadata.with_windowed_layout`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import attrs
import torch

from twostroke.engine.attention.kernels import AttentionKernel, default_kernel, transposes_keys
from twostroke.engine.kernels.paged_attention import PagedDecodeKernel
from twostroke.gpu.staging import to_device

__all__ = [
    "AttentionMetadata",
    "ChunkSpec",
    "DecodeBags",
    "DecodeGroup",
    "PagedDecodes",
    "PrefillChunk",
    "default_group_overhead",
    "split_decodes",
]


def default_group_overhead(device: torch.device) -> int | None:
    """What one more decode group costs, in padded key positions, or ``None``: never split.

    On the CPU one group's extra calls (gather, two products, softmax: about 60 us a layer
    with one thread) cost as much as attending about 1024 padded request-positions, measured
    on SmolLM2-135M in bf16. On CUDA the extra calls cost host time while the padding they
    save costs the device almost nothing, so decodes stay in one group.
    """
    return 1024 if device.type == "cpu" else None


def split_decodes(
    lengths: Sequence[int],
    *,
    block_size: int,
    overhead: int | None,
    max_positions: int | None = None,
) -> list[int]:
    """Where to cut a batch of decodes into groups, each padded to its own longest history.

    Greedy: from the start of what is left, make the cut that saves the most padded
    positions (against leaving the rest as one group), if that saves more than
    ``overhead``; repeat from the cut. Works in any order, and cuts best when the decodes
    come longest first. Then every group that gathers more than ``max_positions`` padded
    positions is cut again, as late as it fits, so no group's gather exceeds it (a decode
    whose own history is longer gets a group of its own).

    Args:
        lengths: Key positions of each decode (its chunk's end), in batch order.
        block_size: Histories are gathered in whole blocks.
        overhead: What one more group costs, in padded key positions; ``None`` never cuts
            to save padding.
        max_positions: The most padded key positions (decodes times the group's widest
            history, in whole blocks) one group may gather; ``None``: no bound.

    Returns:
        The start of each group after the first, ascending.
    """
    widths = [-(-length // block_size) * block_size for length in lengths]
    cuts = [] if overhead is None else _padding_cuts(widths, overhead)
    if max_positions is None:
        return cuts
    bounded: list[int] = []
    for first, last in zip([0, *cuts], [*cuts, len(widths)], strict=True):
        widest = 0
        start = first
        for index in range(first, last):
            widest = max(widest, widths[index])
            if index > start and widest * (index + 1 - start) > max_positions:
                bounded.append(index)
                start, widest = index, widths[index]
        if last < len(widths):
            bounded.append(last)
    return bounded


def _padding_cuts(widths: list[int], overhead: int) -> list[int]:
    """The cuts of :func:`split_decodes` that save more padding than ``overhead`` each."""
    count = len(widths)
    widest_from = [0] * (count + 1)  # widest_from[i]: widest of widths[i:]
    for index in range(count - 1, -1, -1):
        widest_from[index] = max(widths[index], widest_from[index + 1])
    cuts: list[int] = []
    start = 0
    while True:
        whole = widest_from[start] * (count - start)
        best, best_saving, head = 0, overhead, 0
        for cut in range(start + 1, count):
            head = max(head, widths[cut - 1])
            saving = whole - head * (cut - start) - widest_from[cut] * (count - cut)
            if saving > best_saving:
                best, best_saving = cut, saving
        if not best:
            return cuts
        cuts.append(best)
        start = best


@attrs.frozen
class ChunkSpec:
    """One request's share of a forward pass: positions ``[start, start + num_tokens)``.

    Attributes:
        start: First position computed.
        num_tokens: Positions computed (at least one).
        block_table: Blocks holding positions ``0, 1, ...`` of the request, in order.
    """

    start: int
    num_tokens: int
    block_table: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@attrs.frozen
class DecodeBags:
    """Where the ``"bag"`` kernel reads a decode group's keys and values, in place.

    Keys: one bag per (decode, query head, block of its padded table), a weighted sum of the
    ``head_dim`` rows of the block's transposed keys (``[head_dim, block_size]`` per block
    and head) with the query as weights, which is that block's ``block_size`` scores. Bags
    past a decode's own blocks are empty (their scores are masked). Values: one bag per
    (decode, query head), a weighted sum of its history's value rows with the probabilities
    as weights.

    Attributes:
        key_index: Rows of the layer's keys viewed as ``[-1, block_size]``.
        key_offsets: Start of each key bag in ``key_index``, ``[num_decodes * heads * W]``.
        query_tokens: Token (row of the step's batch) of the query weighting each non-empty
            key bag.
        query_heads: Head of that query.
        value_index: Rows of the layer's values viewed as ``[-1, head_dim]``.
        value_offsets: Start of each value bag, ``[num_decodes * heads]``.
        prob_index: Element of the probabilities ``[num_decodes * heads * W * block_size]``
            weighting each entry of ``value_index``.
    """

    key_index: torch.Tensor
    key_offsets: torch.Tensor
    query_tokens: torch.Tensor
    query_heads: torch.Tensor
    value_index: torch.Tensor
    value_offsets: torch.Tensor
    prob_index: torch.Tensor


@attrs.frozen
class PagedDecodes:
    """Where the ``"native"`` kernel reads the decodes' histories, in place.

    Attributes:
        tables: int32 ``[R, W]``: each decode's blocks in order, padded with block 0.
        lengths: int32 ``[R]``: the positions each decode attends to (its chunk's end).
        kernel: The compiled kernel for the cache's shape and dtype.
    """

    tables: torch.Tensor
    lengths: torch.Tensor
    kernel: PagedDecodeKernel


@attrs.frozen
class PagedChunks:
    """Where the ``"native"`` kernel reads every chunk of a step that has prefills, in place.

    Decodes are chunks of one token here, so the step's attention is one call per layer.

    Attributes:
        tables: int32 ``[C, W]``: each chunk's blocks in order, padded with block 0.
        starts: int32 ``[C]``: each chunk's first position.
        counts: int32 ``[C]``: each chunk's tokens.
        offsets: int32 ``[C]``: each chunk's first row in the flat batch.
        kernel: The compiled kernel for the cache's shape and dtype.
    """

    tables: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    kernel: PagedDecodeKernel


@attrs.frozen
class DecodeGroup:
    """Consecutive decodes attended in one call, their histories padded to the longest.

    Attributes:
        offset: Row of the group's first decode in the flat batch.
        num_decodes: Rows of the group.
        gather: Rows of the cache view ``[2 * num_blocks * num_kv_heads, block_size,
            head_dim]`` holding the histories, keys then values, decode by decode and head
            by head; ``None`` for the ``"bag"`` and ``"native"`` kernels, which read in
            place.
        mask: The additive key mask: float32 ``[num_decodes, 1, keys]`` for the
            ``"matmul"`` and ``"bag"`` kernels, ``[num_decodes, 1, 1, keys]`` in the
            model's dtype for ``"sdpa"``; ``None`` for ``"native"``, which reads only each
            decode's own positions.
        bags: The ``"bag"`` kernel's indices, else ``None``.
        paged: The ``"native"`` kernel's tables and lengths, else ``None``.
    """

    offset: int
    num_decodes: int
    gather: torch.Tensor | None
    mask: torch.Tensor | None
    bags: DecodeBags | None = None
    paged: PagedDecodes | None = None

    @property
    def end(self) -> int:
        """Row after the group's last decode."""
        return self.offset + self.num_decodes


@attrs.frozen
class PrefillChunk:
    """Attention inputs of one multi-token chunk.

    Attributes:
        offset: Row of the chunk's first token in the flat batch.
        num_tokens: Rows of the chunk.
        num_keys: Positions attended (the chunk's end).
        gather: Rows of the cache view ``[2 * num_blocks * num_kv_heads, block_size,
            head_dim]`` holding keys then values of positions ``[0, num_keys)`` (rounded up
            to whole blocks), head by head; ``None`` for a chunk that starts at 0, which
            attends only over its own keys and values, and for the ``"native"`` kernel,
            which reads in place (:class:`PagedChunks`).
        mask: Additive ``[num_tokens, num_keys]`` causal mask offset by the chunk's start:
            float32 for the ``"matmul"`` kernel; in the model's dtype for ``"sdpa"``, and
            ``None`` there for a chunk that starts at 0 (``is_causal`` does it); ``None``
            for ``"native"``.
    """

    offset: int
    num_tokens: int
    num_keys: int
    gather: torch.Tensor | None
    mask: torch.Tensor | None


@attrs.frozen
class AttentionMetadata:
    """Where every token of a step sits, and how attention reads its history.

    Build it with :meth:`build`; the model passes it to every layer.

    Attributes:
        positions: ``[num_tokens]`` position of each token (rotary embeddings).
        slot_mapping: ``[num_tokens]`` flat cache slot (``block * block_size + offset``)
            of each token.
        write_index: Where the step's keys and values ``[num_tokens, 2, num_kv_heads,
            head_dim]`` go in one layer's cache: ``[num_tokens, 2, num_kv_heads]`` rows of
            it viewed as ``[-1, head_dim]``, or with :attr:`keys_transposed` ``[num_tokens,
            2, num_kv_heads, head_dim]`` elements of it flat (each block's keys are
            transposed, so a key's elements are not a row). One ``index_put_`` writes both.
        num_decodes: The leading single-token chunks, attended in batched calls.
        decode_groups: The decodes, cut into groups of similar lengths.
        kernel: How the decodes attend.
        prefills: The other chunks.
        paged_chunks: With the ``"native"`` kernel and prefills in the step, every chunk
            (decodes too) for its one call per layer; else ``None``.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_groups: tuple[DecodeGroup, ...]
    kernel: AttentionKernel
    prefills: tuple[PrefillChunk, ...]
    paged_chunks: PagedChunks | None = None
    _layout: _Layout | None = attrs.field(default=None, repr=False, eq=False)
    # What windowed() needs to remake the masks: the chunks and the model's dtype.
    _chunks: tuple[ChunkSpec, ...] = attrs.field(default=(), repr=False, eq=False)
    _dtype: torch.dtype | None = attrs.field(default=None, repr=False, eq=False)
    # windowed()'s results, so that a step's layers with one window share one set of masks
    # (a memo, like write_index: the metadata's values never change).
    _windows: dict[int, AttentionMetadata] = attrs.field(
        factory=dict, init=False, repr=False, eq=False
    )
    # The windowed layers' own layout, where their KV is kept apart (with_windowed_layout).
    _apart: AttentionMetadata | None = attrs.field(default=None, repr=False, eq=False)

    @functools.cached_property
    def write_index(self) -> torch.Tensor:
        # Computed on first use: the compiled glue writes the cache from the slots instead,
        # and this took 0.2 ms of a 10 ms step at one decode.
        if self._layout is None:
            raise ValueError("write_index needs the cache layout AttentionMetadata.build gives")
        return self._layout.write_index(self.slot_mapping)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def windowed(self, window: int) -> AttentionMetadata:
        """This step's layout for a layer that attends through a sliding window.

        The query at position ``p`` sees keys at ``(p - window, p]``: ``window`` positions
        counting its own, as transformers' ``sliding_window_overlay`` (``kv_idx > q_idx -
        sliding_window``) has it for Mistral and Gemma 3. Only the masks change: the decode
        groups' and the chunks' gain the window's lower edge, and an SDPA chunk from
        position 0 that ``is_causal`` served gets a mask. Made once per window and shared
        by every layer of the step that asks; the metadata itself where the window changes
        nothing (every chunk ends within it) and for the ``"native"`` kernel, which takes the
        window itself.

        Where the windowed layers keep their KV apart (:meth:`with_windowed_layout`), the
        answer is their own layout's, windowed; asked of a windowed metadata again, the
        answer is itself.

        Args:
            window: Positions each query sees, its own included.

        Returns:
            The step's metadata with windowed masks.

        Raises:
            ValueError: ``window`` is below 1, or this metadata was not made by
                :meth:`build` (it lacks the chunks to remake the masks from).
        """
        if window < 1:
            raise ValueError(
                f"a sliding window must be >= 1 (a query sees its own position), got {window}"
            )
        if self._apart is not None:
            return self._apart.windowed(window)
        if self.kernel == "native":
            return self
        found = self._windows.get(window)
        if found is not None:
            return found
        if self._layout is None or self._dtype is None or not self._chunks:
            raise ValueError("windowed() needs the chunks AttentionMetadata.build keeps")
        if max(chunk.end for chunk in self._chunks) <= window:
            found = self  # every query already sees all it may
        else:
            found = self._windowed(window, self._layout, self._dtype)
            found._windows[window] = found  # (windowed again: the same)
        self._windows[window] = found
        return found

    @property
    def windowed_apart(self) -> bool:
        """Whether the windowed layers have a layout of their own (:meth:`with_windowed_layout`)."""
        return self._apart is not None

    def with_windowed_layout(self, apart: AttentionMetadata) -> AttentionMetadata:
        """This step's metadata, whose windowed layers attend and write through ``apart``.

        ``apart`` is the same step's chunks, in the same order, laid out over the windowed
        layers' own cache and block tables (:mod:`~twostroke.engine.runners.window_kv`):
        :meth:`windowed` answers from it, so a windowed layer's writes and reads go to its
        own cache, and a global layer's to the global one.

        Raises:
            ValueError: ``apart`` lays out other positions than this metadata, or has a
                windowed layout of its own.
        """
        if apart._apart is not None:
            raise ValueError("the windowed layers' layout cannot have one of its own")
        if apart.num_tokens != self.num_tokens or apart.num_decodes != self.num_decodes:
            raise ValueError(
                f"the windowed layers' layout must lay out the step's {self.num_tokens} "
                f"tokens ({self.num_decodes} decodes), got {apart.num_tokens} "
                f"({apart.num_decodes} decodes)"
            )
        return attrs.evolve(self, apart=apart)

    def _windowed(self, window: int, layout: _Layout, dtype: torch.dtype) -> AttentionMetadata:
        """:meth:`windowed`'s masks, made for ``window``."""
        device = layout.device
        groups = []
        for group in self.decode_groups:
            assert group.mask is not None  # every torch kernel masks its decodes' padding
            ends = [chunk.end for chunk in self._chunks[group.offset : group.end]]
            width = group.mask.shape[-1]
            visible = _window_visible(ends, [[end - 1] for end in ends], width, window, device)
            mask = _additive(visible, group.mask.dtype)
            groups.append(attrs.evolve(group, mask=mask.view(group.mask.shape)))
        prefills = []
        for chunk, prefill in zip(self._chunks[self.num_decodes :], self.prefills, strict=True):
            queries = [list(range(chunk.start, chunk.end))]
            visible = _window_visible([chunk.end], queries, chunk.end, window, device)[0]
            mask_dtype = dtype if prefill.mask is None else prefill.mask.dtype
            mask = _additive(visible, mask_dtype)
            prefills.append(attrs.evolve(prefill, mask=mask))
        return attrs.evolve(self, decode_groups=tuple(groups), prefills=tuple(prefills))

    @property
    def keys_transposed(self) -> bool:
        """Whether the cache holds each block's keys as ``[head_dim, block_size]``.

        The ``"bag"`` and ``"native"`` kernels' layout: a block's scores are a weighted sum
        of its ``head_dim`` key rows. Values stay ``[block_size, head_dim]``. One cache is
        written and read with one layout for its whole life (the runner picks the kernel).
        """
        return transposes_keys(self.kernel)

    @classmethod
    def build(
        cls,
        chunks: Sequence[ChunkSpec],
        *,
        block_size: int,
        num_blocks: int,
        num_kv_heads: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: AttentionKernel | PagedDecodeKernel | None = None,
        group_overhead: int | Literal["auto"] | None = "auto",
        max_decode_positions: int | None = None,
        num_heads: int | None = None,
        head_dim: int | None = None,
    ) -> AttentionMetadata:
        """Lay out one step: tokens of ``chunks`` in order, each chunk's tokens contiguous.

        The single-token chunks at the front are batched as decodes, so put them first,
        longest first (they are cut into groups of similar lengths in the order given).

        Args:
            chunks: The requests' shares of the step, in batch order.
            block_size: Positions per cache block.
            num_blocks: Blocks in the cache (block ids are checked against it).
            num_kv_heads: Key/value heads of the model.
            dtype: The model's dtype (SDPA masks are added to its attention scores).
            device: Where the model runs.
            kernel: How decodes attend: one of torch's kernels by name (``"bag"``,
                ``"matmul"``, ``"sdpa"``), or the compiled ``"native"`` one itself, built
                for this cache once (:meth:`CausalLM.attention_for
                <twostroke.engine.models.decoder.CausalLM.attention_for>`); ``None``
                takes :func:`default_kernel` for ``device``.
            group_overhead: See :func:`split_decodes`; ``"auto"`` takes
                :func:`default_group_overhead` for ``device``.
            max_decode_positions: The most padded key positions one decode group gathers
                (``max_positions`` of :func:`split_decodes`): bounds the memory of the
                padded histories a layer gathers at once. ``None``: no bound.
            num_heads: Query heads of the model; the ``"bag"`` and ``"native"`` kernels
                need it.
            head_dim: Width of a head; the ``"bag"`` and ``"native"`` kernels need it.

        Returns:
            The step's metadata, on ``device``.

        Raises:
            ValueError: a chunk is empty, or its block table does not cover its positions
                or names a block outside the cache; the ``"bag"`` or ``"native"`` kernel
                without ``num_heads`` and ``head_dim``; ``"native"`` by name, or a compiled
                kernel built for another cache shape or dtype.
        """
        native = None
        if isinstance(kernel, PagedDecodeKernel):
            native, kernel = kernel, "native"
        elif kernel == "native":
            raise ValueError(
                "the 'native' kernel is passed as itself (a PagedDecodeKernel built for the "
                "cache), not by name"
            )
        elif kernel is None:
            kernel = default_kernel(device)
        if transposes_keys(kernel) and (num_heads is None or head_dim is None):
            raise ValueError(
                f"the {kernel!r} kernel needs num_heads and head_dim, got "
                f"num_heads={num_heads} and head_dim={head_dim}"
            )
        if native is not None and (
            native.block_size != block_size
            or native.head_dim != head_dim
            or native.group * num_kv_heads != num_heads
            or native.dtype != dtype
        ):
            raise ValueError(
                f"the compiled kernel was built for blocks of {native.block_size}, heads of "
                f"{native.head_dim}, {native.group} query heads per key/value head and "
                f"{native.dtype}; the cache has blocks of {block_size}, heads of {head_dim}, "
                f"{num_heads} query heads over {num_kv_heads} and {dtype}"
            )
        if group_overhead == "auto":
            group_overhead = default_group_overhead(device)
        positions: list[int] = []
        slots: list[int] = []
        for chunk in chunks:
            _check_chunk(chunk, block_size, num_blocks)
            table = chunk.block_table
            first, last = chunk.start // block_size, (chunk.end - 1) // block_size
            for index in range(first, last + 1):
                base = table[index] * block_size
                low = max(chunk.start, index * block_size) - index * block_size
                high = min(chunk.end, (index + 1) * block_size) - index * block_size
                slots.extend(range(base + low, base + high))
            positions.extend(range(chunk.start, chunk.end))
        layout = _Layout(
            block_size,
            num_blocks,
            num_kv_heads,
            device,
            keys_transposed=transposes_keys(kernel),
            num_heads=num_heads or num_kv_heads,
            head_dim=head_dim or 0,
        )
        slot_mapping = to_device(slots, device=device)

        num_decodes = 0
        while num_decodes < len(chunks) and chunks[num_decodes].num_tokens == 1:
            num_decodes += 1
        decode_groups: list[DecodeGroup] = []
        if native is not None and num_decodes:
            # No padding is read, so nothing is saved by cutting: one group, one call.
            decode_groups.append(_paged_decodes(chunks[:num_decodes], block_size, native))
        elif num_decodes:
            lengths = [chunk.end for chunk in chunks[:num_decodes]]
            cuts = split_decodes(
                lengths,
                block_size=block_size,
                overhead=group_overhead,
                max_positions=max_decode_positions,
            )
            for first, last in zip([0, *cuts], [*cuts, num_decodes], strict=True):
                mask_dtype = dtype if kernel == "sdpa" else torch.float32
                group = _decode_group(chunks[first:last], first, layout, mask_dtype)
                if kernel == "sdpa" and group.mask is not None:
                    group = attrs.evolve(group, mask=group.mask[:, :, None, :])
                decode_groups.append(group)
        prefills: list[PrefillChunk] = []
        offset = num_decodes
        for chunk in chunks[num_decodes:]:
            prefills.append(_prefill_chunk(chunk, offset, layout, dtype, kernel))
            offset += chunk.num_tokens
        paged_chunks = None
        if native is not None and prefills:
            paged_chunks = _paged_chunks(chunks, block_size, native)
        return cls(
            positions=to_device(positions, device=device),
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            decode_groups=tuple(decode_groups),
            kernel=kernel,
            prefills=tuple(prefills),
            paged_chunks=paged_chunks,
            layout=layout,
            chunks=tuple(chunks),
            dtype=dtype,
        )


@attrs.frozen
class _Layout:
    """Index arithmetic over one layer's cache ``[2, num_blocks, heads, block_size, dim]``."""

    block_size: int
    num_blocks: int
    num_kv_heads: int
    device: torch.device
    keys_transposed: bool = False
    num_heads: int = 0
    head_dim: int = 0

    def gather(self, tables: torch.Tensor) -> torch.Tensor:
        """Rows of the ``[-1, block_size, dim]`` view for ``tables`` ``[R, W]``.

        Ordered ``[kv, request, head, block]``: the gathered tensor views as ``[2, R *
        heads, W * block_size, dim]``.
        """
        heads = self.num_kv_heads
        kv = torch.arange(2, device=self.device) * self.num_blocks
        head = torch.arange(heads, device=self.device)
        rows = (kv[:, None, None, None] + tables[None, :, None, :]) * heads
        return (rows + head[None, None, :, None]).flatten()

    def write_index(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Where each ``(token, kv, head)`` goes: rows of the ``[-1, dim]`` view, ``[T, 2,
        KV]``; with transposed keys, elements of the flat layer, ``[T, 2, KV, dim]``.

        The key tile of block ``b`` and head ``h`` then holds dimension ``d`` of position
        ``p`` at ``((b * heads + h) * dim + d) * block_size + p``; the values are rows as
        usual, after all the keys.
        """
        size, heads, device = self.block_size, self.num_kv_heads, self.device
        block, within = slot_mapping // size, slot_mapping % size
        kv = torch.arange(2, device=device)[None, :, None] * (self.num_blocks * heads)
        tiles = kv + (block[:, None, None] * heads + torch.arange(heads, device=device))
        if not self.keys_transposed:
            return tiles * size + within[:, None, None]  # [T, 2, KV]
        dim = self.head_dim
        dims = torch.arange(dim, device=device)
        rows = tiles[..., None] * dim + dims  # [T, 2, KV, D]: a tile's first element
        keys = rows[:, 0] * size + within[:, None, None]  # element (d, p) at d * size + p
        values = (rows[:, 1] - dims) * size + within[:, None, None] * dim + dims
        return torch.stack((keys, values), dim=1)

    def bags(
        self, tables: Sequence[Sequence[int]], counts: Sequence[int], offset: int
    ) -> DecodeBags:
        """The ``"bag"`` kernel's indices for decodes with padded ``tables`` (``R`` rows of
        ``W`` blocks), ``counts`` the number of each decode's own blocks, the first decode
        at row ``offset`` of the batch.

        Built on the host with no data-dependent shapes (nothing a device would have to
        report back) and staged to the device without waiting for it, as
        :func:`~twostroke.gpu.staging.to_device` does.
        """
        size, dim, heads = self.block_size, self.head_dim, self.num_heads
        decodes, width = len(tables), len(tables[0])
        table = torch.tensor(tables)  # [R, W]
        per_head = torch.tensor(counts).repeat_interleave(heads, output_size=decodes * heads)
        total = heads * sum(counts)
        # Bag (r, h, j) for every decode r, query head h and block j < counts[r], in that
        # order, as its position (r * H + h) * W + j in the padded [R, H, W] grid.
        first = torch.cumsum(per_head, 0) - per_head
        row = torch.arange(decodes * heads).repeat_interleave(per_head, output_size=total)
        within_row = torch.arange(total) - first.repeat_interleave(per_head, output_size=total)
        bag = row * width + within_row
        kv_head = torch.arange(heads) // (heads // self.num_kv_heads)
        tiles = (table[:, None, :] * self.num_kv_heads + kv_head[None, :, None]).flatten()
        tiles = tiles.index_select(0, bag)
        key_lengths = torch.zeros(decodes * heads * width, dtype=torch.long).index_fill_(
            0, bag, dim
        )
        positions = torch.arange(size)
        value_lengths = per_head * size
        bags = DecodeBags(
            key_index=(tiles[:, None] * dim + torch.arange(dim)).flatten(),
            key_offsets=torch.cumsum(key_lengths, 0) - key_lengths,
            query_tokens=offset + row // heads,
            query_heads=row % heads,
            value_index=(tiles[:, None] * size + positions).flatten(),
            value_offsets=torch.cumsum(value_lengths, 0) - value_lengths,
            prob_index=(bag[:, None] * size + positions).flatten(),
        )
        if self.device.type == "cpu":
            return bags
        return DecodeBags(*(_stage(tensor, self.device) for tensor in attrs.astuple(bags)))


def _paged_decodes(
    decodes: Sequence[ChunkSpec], block_size: int, kernel: PagedDecodeKernel
) -> DecodeGroup:
    """All decodes in one group for the ``"native"`` kernel: their tables and lengths."""
    width = max(-(-chunk.end // block_size) for chunk in decodes)
    flat: list[int] = []
    for chunk in decodes:
        used = -(-chunk.end // block_size)
        flat.extend(chunk.block_table[:used])
        flat.extend([0] * (width - used))
    tables = torch.tensor(flat, dtype=torch.int32).view(len(decodes), width)
    lengths = torch.tensor([chunk.end for chunk in decodes], dtype=torch.int32)
    return DecodeGroup(0, len(decodes), None, None, paged=PagedDecodes(tables, lengths, kernel))


def _paged_chunks(
    chunks: Sequence[ChunkSpec], block_size: int, kernel: PagedDecodeKernel
) -> PagedChunks:
    """Every chunk of the step for the ``"native"`` kernel's one call per layer."""
    width = max(-(-chunk.end // block_size) for chunk in chunks)
    flat: list[int] = []
    offsets: list[int] = []
    offset = 0
    for chunk in chunks:
        used = -(-chunk.end // block_size)
        flat.extend(chunk.block_table[:used])
        flat.extend([0] * (width - used))
        offsets.append(offset)
        offset += chunk.num_tokens
    int32 = torch.int32
    return PagedChunks(
        tables=torch.tensor(flat, dtype=int32).view(len(chunks), width),
        starts=torch.tensor([chunk.start for chunk in chunks], dtype=int32),
        counts=torch.tensor([chunk.num_tokens for chunk in chunks], dtype=int32),
        offsets=torch.tensor(offsets, dtype=int32),
        kernel=kernel,
    )


def _decode_group(
    decodes: Sequence[ChunkSpec], offset: int, layout: _Layout, mask_dtype: torch.dtype
) -> DecodeGroup:
    """Decodes attended together: histories padded to the longest, padding masked."""
    size, device = layout.block_size, layout.device
    width = max(-(-chunk.end // size) for chunk in decodes)
    flat: list[int] = []
    for chunk in decodes:
        row = chunk.block_table[:width]
        flat.extend(row)
        flat.extend([0] * (width - len(row)))  # any block: masked out below
    ends = to_device([chunk.end for chunk in decodes], device=device)
    visible = torch.arange(width * size, device=device)[None, :] < ends[:, None]
    mask = _additive(visible, mask_dtype)[:, None, :]
    if layout.keys_transposed:
        rows = [flat[index * width : (index + 1) * width] for index in range(len(decodes))]
        bags = layout.bags(rows, [-(-chunk.end // size) for chunk in decodes], offset)
        return DecodeGroup(offset, len(decodes), None, mask, bags)
    tables = to_device(flat, device=device).view(len(decodes), width)
    return DecodeGroup(offset, len(decodes), layout.gather(tables), mask)


def _prefill_chunk(
    chunk: ChunkSpec, offset: int, layout: _Layout, dtype: torch.dtype, kernel: AttentionKernel
) -> PrefillChunk:
    """A chunk's own call: no history from position 0, else its history; a causal mask.

    Neither for the ``"native"`` kernel, which reads the chunk's history in place.
    """
    if kernel == "native":
        return PrefillChunk(offset, chunk.num_tokens, chunk.end, None, None)
    device = layout.device
    gather = causal = None
    if chunk.start:
        width = -(-chunk.end // layout.block_size)
        table = to_device(list(chunk.block_table[:width]), device=device).view(1, width)
        gather = layout.gather(table)
    if chunk.start or kernel == "matmul":
        keys = torch.arange(chunk.end, device=device)
        queries = torch.arange(chunk.start, chunk.end, device=device)
        mask_dtype = torch.float32 if kernel == "matmul" else dtype
        causal = _additive(keys[None, :] <= queries[:, None], mask_dtype)
    return PrefillChunk(offset, chunk.num_tokens, chunk.end, gather, causal)


def _check_chunk(chunk: ChunkSpec, block_size: int, num_blocks: int) -> None:
    if chunk.num_tokens < 1 or chunk.start < 0:
        raise ValueError(
            f"a chunk must compute at least one position from start >= 0, got start="
            f"{chunk.start} and num_tokens={chunk.num_tokens}"
        )
    needed = -(-chunk.end // block_size)
    if len(chunk.block_table) < needed:
        raise ValueError(
            f"block table of {len(chunk.block_table)} blocks of {block_size} must cover "
            f"positions [0, {chunk.end}), which need {needed}"
        )
    used = chunk.block_table[:needed]
    if min(used) < 0 or max(used) >= num_blocks:
        bad = [block for block in used if not 0 <= block < num_blocks]
        raise ValueError(f"block ids must be in [0, {num_blocks}), got {bad}")


def _stage(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device (pinned, non-blocking)."""
    return tensor.pin_memory().to(device, non_blocking=True)


def _window_visible(
    ends: Sequence[int],
    queries: Sequence[Sequence[int]],
    width: int,
    window: int,
    device: torch.device,
) -> torch.Tensor:
    """Which of ``width`` key positions each query sees through ``window``, ``[rows,
    queries, width]`` on ``device``: row ``r``'s queries at positions ``queries[r]`` (as
    many in every row), its keys ``[0, ends[r])``; a query at ``p`` sees ``(p - window,
    p]``."""
    keys = torch.arange(width, device=device)[None, None, :]
    at = to_device([p for row in queries for p in row], device=device).view(len(queries), -1, 1)
    last = to_device(ends, device=device)[:, None, None]
    return (keys <= at) & (keys > at - window) & (keys < last)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))
