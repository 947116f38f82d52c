"""Paged attention: the KV cache in fixed-size blocks, read and written through block tables.

The cache is one tensor ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``:
keys at index 0 of the second axis, values at 1, and a request's positions in the blocks its
block table lists, in order. A step writes the keys and values of the positions it computes
into their slots, then every query attends over its request's history.

Blocks are stored head-major (``[num_kv_heads, block_size, head_dim]`` inside a block), so
one ``index_select`` over ``(block, head)`` rows gathers a batch's history straight into the
``[request, head, position, dim]`` layout that batched matrix products take: no copy after
the gather, and keys and values come out of the same call. No Python loop runs over tokens:

* Decodes (chunks of one token) are batched. Their histories, padded to the longest, are
  gathered once per layer and padding keys are masked. Grouped-query heads cost nothing
  extra: the ``G`` query heads that share a key/value head are ``G`` query rows of that head.
  Padding is work too, so decodes of very different lengths are split into a few groups
  (:func:`split_decodes`) when the padding saved outweighs the cost of one more call.
  On the CPU the attention is two batched matrix products with a float32 softmax between
  them (transformers' eager arithmetic), because ``scaled_dot_product_attention``'s CPU
  kernel is slow for one query row per head (about 2.5x slower here, measured); on CUDA it is
  one ``scaled_dot_product_attention`` call.
* Every other chunk (prefill, or a chunk of a recomputed request) is one
  ``scaled_dot_product_attention`` call of its own. A chunk that starts at position 0 has no
  history: it attends over the keys and values it has just computed, with ``is_causal``, so
  it needs neither a gather nor a mask. A later chunk gathers its history and takes a causal
  mask offset by its start.

Everything that depends only on the step's layout (slots, gather indices, masks) is computed
once per step in :class:`AttentionMetadata` and shared by all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import torch
import torch.nn.functional as F

__all__ = [
    "AttentionKernel",
    "AttentionMetadata",
    "ChunkSpec",
    "DecodeGroup",
    "KVCache",
    "PrefillChunk",
    "default_group_overhead",
    "default_kernel",
    "paged_attention",
    "split_decodes",
    "to_device",
    "write_kv",
]

#: How attention is computed: batched matrix products with a float32 softmax between them,
#: or ``scaled_dot_product_attention``.
AttentionKernel = Literal["matmul", "sdpa"]

#: The matmul kernel attends this many scores at most per product (float32 elements): a
#: long chunk's queries go in tiles, each over the keys it can see, so the scores stay in
#: cache and the keys past a tile's diagonal are never scored.
_TILE_SCORES = 1 << 20


def default_kernel(device: torch.device) -> AttentionKernel:
    """SDPA on CUDA (its fused kernels win there), batched matrix products elsewhere."""
    return "sdpa" if device.type == "cuda" else "matmul"


def default_group_overhead(device: torch.device) -> int | None:
    """What one more decode group costs, in padded key positions, or ``None``: never split.

    On the CPU one group's extra calls (gather, two products, softmax: about 60 us a layer
    with one thread) cost as much as attending about 1024 padded request-positions, measured
    on SmolLM2-135M in bf16. On CUDA the extra calls cost host time while the padding they
    save costs the device almost nothing, so decodes stay in one group.
    """
    return 1024 if device.type == "cpu" else None


def split_decodes(lengths: Sequence[int], *, block_size: int, overhead: int | None) -> list[int]:
    """Where to cut a batch of decodes into groups, each padded to its own longest history.

    Greedy: from the start of what is left, make the cut that saves the most padded
    positions (against leaving the rest as one group), if that saves more than
    ``overhead``; repeat from the cut. Works in any order, and cuts best when the decodes
    come longest first.

    Args:
        lengths: Key positions of each decode (its chunk's end), in batch order.
        block_size: Histories are gathered in whole blocks.
        overhead: What one more group costs, in padded key positions; ``None`` never cuts.

    Returns:
        The start of each group after the first, ascending.
    """
    if overhead is None:
        return []
    widths = [-(-length // block_size) * block_size for length in lengths]
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
class KVCache:
    """The paged key and value caches of every layer, in one tensor.

    Attributes:
        data: ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``; keys at
            index 0 of the second axis, values at 1.
    """

    data: torch.Tensor

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: bool = True,
    ) -> KVCache:
        """Allocate a cache, zeroed unless ``zeroed`` is false.

        A block must be zeroed before it is first read, because padded reads see slots no
        request wrote: a masked key gets zero weight, but zero times a NaN left in memory
        would still be NaN. Zeroing a large cache up front costs start-up time (0.4 s for
        SmolLM2's default 1 GiB on the CPU) and touches every page, so a runner may allocate
        it unzeroed and :meth:`zero_blocks` each block the first time a step writes it.

        Returns:
            The new cache.
        """
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
        allocate = torch.zeros if zeroed else torch.empty
        return cls(data=allocate(shape, dtype=dtype, device=device))

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the keys and values of ``block_ids`` in every layer."""
        # One strided fill per block: 7x faster than index_fill_ over the block axis for
        # the one or two new blocks of a decode step (measured), and never a host sync.
        for block in block_ids:
            self.data[:, :, block].zero_()

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes, keys and values of every layer."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    def layer(self, index: int) -> torch.Tensor:
        """Layer ``index``'s ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` (a view)."""
        return self.data[index]

    @property
    def key(self) -> torch.Tensor:
        """``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` (a view)."""
        return self.data[:, 0]

    @property
    def value(self) -> torch.Tensor:
        """Same as :attr:`key`, for values."""
        return self.data[:, 1]

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[4])


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
class DecodeGroup:
    """Consecutive decodes attended in one call, their histories padded to the longest.

    Attributes:
        offset: Row of the group's first decode in the flat batch.
        num_decodes: Rows of the group.
        gather: Rows of the cache view ``[2 * num_blocks * num_kv_heads, block_size,
            head_dim]`` holding the histories, keys then values, decode by decode and head
            by head.
        mask: The additive key mask: float32 ``[num_decodes, 1, keys]`` for the
            ``"matmul"`` kernel, ``[num_decodes, 1, 1, keys]`` in the model's dtype for
            ``"sdpa"``.
    """

    offset: int
    num_decodes: int
    gather: torch.Tensor
    mask: torch.Tensor


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
            attends only over its own keys and values.
        mask: Additive ``[num_tokens, num_keys]`` causal mask offset by the chunk's start:
            float32 for the ``"matmul"`` kernel; in the model's dtype for ``"sdpa"``, and
            ``None`` there for a chunk that starts at 0 (``is_causal`` does it).
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
        write_index: ``[2 * num_tokens * num_kv_heads]`` rows of the layer's cache viewed as
            ``[-1, head_dim]`` that the step's keys, then its values, go to, token by token
            and head by head.
        num_decodes: The leading single-token chunks, attended in batched calls.
        decode_groups: The decodes, cut into groups of similar lengths.
        kernel: How the decodes attend.
        prefills: The other chunks.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    write_index: torch.Tensor
    num_decodes: int
    decode_groups: tuple[DecodeGroup, ...]
    kernel: AttentionKernel
    prefills: tuple[PrefillChunk, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

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
        kernel: AttentionKernel | None = None,
        group_overhead: int | Literal["auto"] | None = "auto",
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
            kernel: How decodes attend; ``None`` takes
                :func:`default_kernel` for ``device``.
            group_overhead: See :func:`split_decodes`; ``"auto"`` takes
                :func:`default_group_overhead` for ``device``.

        Returns:
            The step's metadata, on ``device``.

        Raises:
            ValueError: a chunk is empty, or its block table does not cover its positions
                or names a block outside the cache.
        """
        if kernel is None:
            kernel = default_kernel(device)
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
        layout = _Layout(block_size, num_blocks, num_kv_heads, device)
        slot_mapping = to_device(slots, device=device)

        num_decodes = 0
        while num_decodes < len(chunks) and chunks[num_decodes].num_tokens == 1:
            num_decodes += 1
        decode_groups: list[DecodeGroup] = []
        if num_decodes:
            lengths = [chunk.end for chunk in chunks[:num_decodes]]
            cuts = split_decodes(lengths, block_size=block_size, overhead=group_overhead)
            for first, last in zip([0, *cuts], [*cuts, num_decodes], strict=True):
                mask_dtype = torch.float32 if kernel == "matmul" else dtype
                group = _decode_group(chunks[first:last], first, layout, mask_dtype)
                if kernel == "sdpa":
                    group = attrs.evolve(group, mask=group.mask[:, :, None, :])
                decode_groups.append(group)
        prefills: list[PrefillChunk] = []
        offset = num_decodes
        for chunk in chunks[num_decodes:]:
            prefills.append(_prefill_chunk(chunk, offset, layout, dtype, kernel))
            offset += chunk.num_tokens
        return cls(
            positions=to_device(positions, device=device),
            slot_mapping=slot_mapping,
            write_index=layout.write_index(slot_mapping),
            num_decodes=num_decodes,
            decode_groups=tuple(decode_groups),
            kernel=kernel,
            prefills=tuple(prefills),
        )


@attrs.frozen
class _Layout:
    """Index arithmetic over one layer's cache ``[2, num_blocks, heads, block_size, dim]``."""

    block_size: int
    num_blocks: int
    num_kv_heads: int
    device: torch.device

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
        """Rows of the ``[-1, dim]`` view for each ``(kv, token, head)``, in that order."""
        size, heads = self.block_size, self.num_kv_heads
        block, within = slot_mapping // size, slot_mapping % size
        kv = torch.arange(2, device=self.device) * self.num_blocks
        head = torch.arange(heads, device=self.device)
        rows = (kv[:, None, None] + block[None, :, None]) * heads + head[None, None, :]
        return (rows * size + within[None, :, None]).flatten()


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
    tables = to_device(flat, device=device).view(len(decodes), width)
    ends = to_device([chunk.end for chunk in decodes], device=device)
    visible = torch.arange(width * size, device=device)[None, :] < ends[:, None]
    mask = _additive(visible, mask_dtype)[:, None, :]
    return DecodeGroup(offset, len(decodes), layout.gather(tables), mask)


def _prefill_chunk(
    chunk: ChunkSpec, offset: int, layout: _Layout, dtype: torch.dtype, kernel: AttentionKernel
) -> PrefillChunk:
    """A chunk's own call: no history from position 0, else its history; a causal mask."""
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


def to_device(
    values: Sequence[int] | Sequence[float],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """A host list as a device tensor, without waiting for the device.

    On CUDA a plain ``torch.tensor(values, device=...)`` copies from pageable memory, which
    synchronizes with the work already queued: the step being built would wait for the one
    in flight. Staging through pinned memory with a non-blocking copy keeps the queue full
    (the caching host allocator keeps the pinned buffer until the copy is done).
    """
    if device.type == "cuda":
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def write_kv(
    layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata
) -> None:
    """Store the step's keys and values ``[num_tokens, num_kv_heads, head_dim]`` in their slots.

    Args:
        layer_cache: One layer's ``[2, num_blocks, num_kv_heads, block_size, head_dim]``.
        key: The step's keys, rotary embeddings applied.
        value: The step's values.
        metadata: The step's layout.
    """
    width = key.shape[-1]
    source = torch.stack((key, value)).view(-1, width)
    layer_cache.view(-1, width).index_copy_(0, metadata.write_index, source)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
) -> torch.Tensor:
    """Attend every query over its request's history in one layer's cache.

    The step's own keys and values must already be written (:func:`write_kv`); they are
    passed as well because a chunk without history attends over them directly.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, rotary embeddings applied.
        key: ``[num_tokens, num_kv_heads, head_dim]``, the step's keys.
        value: Same shape as ``key``, the step's values.
        layer_cache: One layer's ``[2, num_blocks, num_kv_heads, block_size, head_dim]``.
        metadata: The step's layout.
        scale: Multiplies the scores (``head_dim ** -0.5`` for Llama).

    Returns:
        ``[num_tokens, num_heads, head_dim]``.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = layer_cache.shape[2], layer_cache.shape[3]
    groups = num_heads // num_kv_heads
    blocks = layer_cache.view(-1, block_size, head_dim)
    out = query.new_empty(num_tokens, num_heads, head_dim)
    for group in metadata.decode_groups:
        rows = slice(group.offset, group.offset + group.num_decodes)
        decodes = group.num_decodes
        history = blocks.index_select(0, group.gather)
        history = history.view(2, decodes * num_kv_heads, -1, head_dim)
        if metadata.kernel == "matmul":
            out[rows] = _decode_matmul(query[rows], history, group.mask, scale)
        else:
            shape = (decodes, num_kv_heads, -1, head_dim)
            attended = F.scaled_dot_product_attention(
                query[rows].view(decodes, num_kv_heads, groups, head_dim),
                history[0].view(shape),
                history[1].view(shape),
                attn_mask=group.mask,
                scale=scale,
            )
            out[rows] = attended.view(decodes, num_heads, head_dim)
    for chunk in metadata.prefills:
        rows = slice(chunk.offset, chunk.offset + chunk.num_tokens)
        if chunk.gather is None:
            keys, values = key[rows].transpose(0, 1), value[rows].transpose(0, 1)
        else:
            history = blocks.index_select(0, chunk.gather).view(2, num_kv_heads, -1, head_dim)
            keys, values = history[0, :, : chunk.num_keys], history[1, :, : chunk.num_keys]
        if metadata.kernel == "matmul":
            assert chunk.mask is not None
            out[rows] = _prefill_matmul(query[rows], keys, values, chunk.mask, scale)
            continue
        attended = F.scaled_dot_product_attention(
            query[rows].transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = attended[0].transpose(0, 1)
    return out


def _decode_matmul(
    query: torch.Tensor, history: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query row per head over padded histories: two batched products, float32 softmax.

    ``query`` is ``[R, heads, dim]``, ``history`` ``[2, R * kv_heads, keys, dim]`` and
    ``mask`` float32 ``[R, 1, keys]``. Scores leave the product in the model's dtype and are
    scaled, masked and normalized in float32, as transformers' eager attention does.
    """
    decodes, num_heads, head_dim = query.shape
    batch = history.shape[1]
    rows = query.reshape(batch, -1, head_dim)
    scores = torch.bmm(rows, history[0].transpose(1, 2)).to(torch.float32)
    scores = scores.view(decodes, num_heads, -1).mul_(scale).add_(mask)
    probs = torch.softmax(scores, dim=-1).to(query.dtype).view(batch, -1, scores.shape[-1])
    return torch.bmm(probs, history[1]).view(decodes, num_heads, head_dim)


def _prefill_matmul(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """A chunk's causal attention as batched products, its queries in tiles.

    ``query`` is ``[n, heads, dim]``, ``keys`` and ``values`` ``[kv_heads, keys, dim]`` (the
    chunk's queries are the last ``n`` positions) and ``mask`` float32 ``[n, keys]``. Each
    tile of queries is scored against the keys up to its last query only, which skips most
    of what the causal mask would discard, and at most :data:`_TILE_SCORES` scores at a time.
    Measured on SmolLM2's heads against the CPU flash kernel of
    ``scaled_dot_product_attention``: as fast at 256 queries, 1.5-2x faster from 512 on.
    """
    count, num_heads, head_dim = query.shape
    num_kv_heads, num_keys = keys.shape[0], keys.shape[1]
    groups = num_heads // num_kv_heads
    start = num_keys - count
    keys, values = keys.contiguous(), values.contiguous()
    rows = query.view(count, num_kv_heads, groups, head_dim).transpose(0, 1)
    tile = max(1, min(count, _TILE_SCORES // (num_heads * num_keys)))
    parts = []
    for first in range(0, count, tile):
        last = min(count, first + tile)
        seen = start + last
        tile_rows = rows[:, first:last].reshape(num_kv_heads, -1, head_dim)
        scores = torch.bmm(tile_rows, keys[:, :seen].transpose(1, 2)).to(torch.float32)
        scores = scores.view(num_kv_heads, last - first, groups, seen).mul_(scale)
        scores = scores.add_(mask[first:last, None, :seen])
        probs = torch.softmax(scores, dim=-1).to(query.dtype).view(num_kv_heads, -1, seen)
        parts.append(torch.bmm(probs, values[:, :seen]).view(num_kv_heads, -1, groups, head_dim))
    attended = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return attended.transpose(0, 1).reshape(count, num_heads, head_dim)
