"""Paged attention: the KV cache in fixed-size blocks, read and written through block tables.

The cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and
the same for values; a request's positions live in the blocks its block table lists, in
order. A step writes the keys and values of the positions it computes into their slots, then
every query attends over its request's whole history, read back through the block table.

The work is shaped for ``torch.nn.functional.scaled_dot_product_attention``, with no Python
loop over tokens:

* Decodes (chunks of one token) are batched into one padded SDPA call. Their history is
  gathered block by block (one ``index_select`` per layer for all of them) and padding keys
  are masked. Grouped-query heads cost nothing extra: the ``G`` query heads that share a
  key/value head are laid out as ``G`` query *rows* of that head, so keys and values are never
  repeated.
* Every other chunk (prefill, or a chunk of a recomputed request) is one SDPA call of its own,
  with the same folding of query heads into rows and a causal mask offset by the chunk's start.

Everything that depends only on the step's layout (slots, gather indices, masks) is computed
once per step in :class:`AttentionMetadata` and shared by all layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

__all__ = [
    "AttentionMetadata",
    "ChunkSpec",
    "KVCache",
    "PrefillChunk",
    "paged_attention",
    "to_device",
    "write_kv",
]


@attrs.frozen
class KVCache:
    """The paged key and value caches of every layer.

    Attributes:
        key: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
        value: Same shape as ``key``.
    """

    key: torch.Tensor
    value: torch.Tensor

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
    ) -> KVCache:
        """Allocate a zeroed cache.

        Zeroed rather than empty because padded decode reads see slots no request wrote: a
        masked key gets zero weight, but zero times a NaN left in memory would still be NaN.

        Returns:
            The new cache.
        """
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(
            key=torch.zeros(shape, dtype=dtype, device=device),
            value=torch.zeros(shape, dtype=dtype, device=device),
        )

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes, keys and values of every layer."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.key.shape[2])


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
class PrefillChunk:
    """Attention inputs of one multi-token chunk.

    Attributes:
        offset: Row of the chunk's first token in the flat batch.
        num_tokens: Rows of the chunk.
        block_ids: Blocks covering positions ``[0, end)``.
        mask: Additive mask ``[G * num_tokens, num_keys]``: row ``g * num_tokens + i`` is
            query head ``g`` of the group at the chunk's token ``i``.
    """

    offset: int
    num_tokens: int
    block_ids: torch.Tensor
    mask: torch.Tensor


@attrs.frozen
class AttentionMetadata:
    """Where every token of a step sits, and how attention reads its history.

    Build it with :meth:`build`; the model passes it to every layer.

    Attributes:
        positions: ``[num_tokens]`` position of each token (rotary embeddings).
        slot_mapping: ``[num_tokens]`` flat cache slot (``block * block_size + offset``) each
            token's key and value are written to.
        num_decodes: The leading single-token chunks, attended in one batched call.
        decode_block_ids: ``[num_decodes * decode_blocks]`` blocks to gather, each decode's
            table padded to the longest.
        decode_mask: ``[num_decodes, 1, 1, decode_blocks * block_size]`` additive key mask.
        prefills: The other chunks.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_ids: torch.Tensor | None
    decode_mask: torch.Tensor | None
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
        num_queries_per_kv: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> AttentionMetadata:
        """Lay out one step: tokens of ``chunks`` in order, each chunk's tokens contiguous.

        The single-token chunks at the front are batched as decodes, so put them first.

        Args:
            chunks: The requests' shares of the step, in batch order.
            block_size: Positions per cache block.
            num_blocks: Blocks in the cache (block ids are checked against it).
            num_queries_per_kv: Query heads per key/value head.
            dtype: The model's dtype (masks are added to its attention scores).
            device: Where the model runs.

        Returns:
            The step's metadata, on ``device``.

        Raises:
            ValueError: a chunk is empty, or its block table does not cover its positions
                or names a block outside the cache.
        """
        positions: list[int] = []
        slots: list[int] = []
        for chunk in chunks:
            _check_chunk(chunk, block_size, num_blocks)
            table = chunk.block_table
            for position in range(chunk.start, chunk.end):
                positions.append(position)
                slots.append(table[position // block_size] * block_size + position % block_size)
        num_decodes = 0
        while num_decodes < len(chunks) and chunks[num_decodes].num_tokens == 1:
            num_decodes += 1

        decode_block_ids = decode_mask = None
        if num_decodes:
            decodes = chunks[:num_decodes]
            width = max(-(-chunk.end // block_size) for chunk in decodes)
            flat: list[int] = []
            for chunk in decodes:
                row = chunk.block_table[:width]
                flat.extend(row)
                flat.extend([0] * (width - len(row)))  # any block: masked out below
            decode_block_ids = to_device(flat, device=device)
            lengths = to_device([chunk.end for chunk in decodes], device=device)
            keys = torch.arange(width * block_size, device=device)
            visible = keys[None, :] < lengths[:, None]
            decode_mask = _additive(visible, dtype)[:, None, None, :]

        prefills: list[PrefillChunk] = []
        offset = sum(chunk.num_tokens for chunk in chunks[:num_decodes])
        for chunk in chunks[num_decodes:]:
            num_keys_blocks = -(-chunk.end // block_size)
            keys = torch.arange(num_keys_blocks * block_size, device=device)
            queries = torch.arange(chunk.start, chunk.end, device=device)
            visible = keys[None, :] <= queries[:, None]
            prefills.append(
                PrefillChunk(
                    offset=offset,
                    num_tokens=chunk.num_tokens,
                    block_ids=to_device(list(chunk.block_table[:num_keys_blocks]), device=device),
                    mask=_additive(visible.repeat(num_queries_per_kv, 1), dtype),
                )
            )
            offset += chunk.num_tokens
        return cls(
            positions=to_device(positions, device=device),
            slot_mapping=to_device(slots, device=device),
            num_decodes=num_decodes,
            decode_block_ids=decode_block_ids,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
        )


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
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's keys and values ``[num_tokens, num_kv_heads, head_dim]`` in their slots."""
    heads, width = key.shape[1], key.shape[2]
    key_cache.view(-1, heads, width).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, heads, width).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
) -> torch.Tensor:
    """Attend every query over its request's history in one layer's cache.

    The step's own keys and values must already be written (:func:`write_kv`).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, rotary embeddings applied.
        key_cache: One layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        value_cache: Same shape as ``key_cache``.
        metadata: The step's layout.
        scale: Multiplies the scores (``head_dim ** -0.5`` for Llama).

    Returns:
        ``[num_tokens, num_heads, head_dim]``.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    groups = num_heads // num_kv_heads
    out = query.new_empty(num_tokens, num_heads, head_dim)
    decodes = metadata.num_decodes
    if decodes:
        assert metadata.decode_block_ids is not None and metadata.decode_mask is not None
        num_keys = metadata.decode_mask.shape[-1]
        keys = key_cache.index_select(0, metadata.decode_block_ids)
        values = value_cache.index_select(0, metadata.decode_block_ids)
        attended = F.scaled_dot_product_attention(
            query[:decodes].view(decodes, num_kv_heads, groups, head_dim),
            keys.view(decodes, num_keys, num_kv_heads, head_dim).transpose(1, 2),
            values.view(decodes, num_keys, num_kv_heads, head_dim).transpose(1, 2),
            attn_mask=metadata.decode_mask,
            scale=scale,
        )
        out[:decodes] = attended.reshape(decodes, num_heads, head_dim)
    for chunk in metadata.prefills:
        n = chunk.num_tokens
        num_keys = chunk.block_ids.shape[0] * block_size
        rows = query[chunk.offset : chunk.offset + n].view(n, num_kv_heads, groups, head_dim)
        keys = key_cache.index_select(0, chunk.block_ids).view(1, num_keys, num_kv_heads, head_dim)
        values = value_cache.index_select(0, chunk.block_ids)
        attended = F.scaled_dot_product_attention(
            rows.permute(1, 2, 0, 3).reshape(1, num_kv_heads, groups * n, head_dim),
            keys.transpose(1, 2),
            values.view(1, num_keys, num_kv_heads, head_dim).transpose(1, 2),
            attn_mask=chunk.mask,
            scale=scale,
        )
        out[chunk.offset : chunk.offset + n] = (
            attended.reshape(num_kv_heads, groups, n, head_dim)
            .permute(2, 0, 1, 3)
            .reshape(n, -1, head_dim)
        )
    return out
