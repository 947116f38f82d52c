"""Paged attention: the KV cache in fixed-size blocks, read and written through block tables.

The cache is one tensor ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``:
keys at index 0 of the second axis, values at 1, and a request's positions in the blocks its
block table lists, in order. A step writes the keys and values of the positions it computes
into their slots, then every query attends over its request's history.

Blocks are stored head-major (``[num_kv_heads, block_size, head_dim]`` inside a block), so
one ``index_select`` over ``(block, head)`` rows gathers a batch's history straight into the
``[request, head, position, dim]`` layout that batched matrix products take: no copy after
the gather, and keys and values come out of the same call. No Python loop runs over tokens.

On the CPU decodes read the cache in place instead. The ``"native"`` kernel (the default
where a C compiler is found, :mod:`~twostroke.engine.kernels.paged_attention`) does it in one
compiled call per layer, and in a step with prefill chunks it attends those in place too, in
the same call. The ``"bag"`` kernel (the fallback, on the same cache layout) does it with
torch's operators: each block's keys are stored transposed (``[head_dim, block_size]``), so
a block's scores for one query head are a weighted sum of its ``head_dim`` key rows, the query's
elements the weights, and the output is a weighted sum of value rows, the probabilities the
weights. ``embedding_bag`` computes such sums straight from the cache through the block
tables (one call for the scores, one for the outputs), so no history is copied: the whole
batch-32 decode step of SmolLM2 ran 1.33x faster than with the gather (docs/performance.md).
Prefill chunks with history still gather theirs (their keys back to ``[position, dim]``):
one copy serves all of a chunk's queries.

* Decodes (chunks of one token) are batched. With the ``"matmul"`` and ``"sdpa"`` kernels
  their histories, padded to the longest, are gathered once per layer and padding keys are
  masked (the ``"bag"`` kernel pads its scores the same way, and reads in place).
  Grouped-query heads cost nothing extra: the ``G`` query heads that share a key/value
  head are ``G`` query rows of that head.
  Padding is work too, so decodes of very different lengths are split into a few groups
  (:func:`~twostroke.engine.attention.metadata.split_decodes`) when the padding saved
  outweighs the cost of one more call, and so that no group gathers more than the runner's
  ``decode_gather_bytes`` (the padded copy is transient memory no KV budget counts).
  On the CPU the attention is two batched matrix products with a float32 softmax between
  them (transformers' eager arithmetic), because ``scaled_dot_product_attention``'s CPU
  kernel is slow for one query row per head (about 2.5x slower here, measured); on CUDA it is
  one ``scaled_dot_product_attention`` call.
* Every other chunk (prefill, or a chunk of a recomputed request) is one
  ``scaled_dot_product_attention`` call of its own. A chunk that starts at position 0 has no
  history: it attends over the keys and values it has just computed, with ``is_causal``, so
  it needs neither a gather nor a mask. A later chunk gathers its history and takes a causal
  mask offset by its start; under SDPA its query groups are folded into query rows as the
  decodes' are, because a mask with ``enable_gqa`` rules out both fused kernels on CUDA.

Everything that depends only on the step's layout (slots, gather indices, masks) is computed
once per step in :class:`~twostroke.engine.attention.metadata.AttentionMetadata`
and shared by all layers.

A layer with a sliding window (Mistral's, Gemma 3's local layers) passes ``window``: each
query then sees its last ``window`` positions, its own included. Every kernel honours it:
the compiled one reads only the blocks a window reaches, torch's take the step's windowed
masks (:meth:`~twostroke.engine.attention.metadata.AttentionMetadata.windowed`), and the
matmul kernel also skips the keys before each tile of queries' windows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twostroke.engine.attention.kv_cache import LayerCache
from twostroke.engine.attention.metadata import (
    AttentionMetadata,
    DecodeBags,
    PagedChunks,
    PagedDecodes,
)

__all__ = ["paged_attention", "write_kv"]

#: The matmul kernel attends this many scores at most per product (float32 elements): a
#: long chunk's queries go in tiles, each over the keys it can see, so the scores stay in
#: cache and the keys past a tile's diagonal are never scored.
_TILE_SCORES = 1 << 20


def write_kv(layer: LayerCache, key_value: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Store the step's keys and values ``[num_tokens, 2, num_kv_heads, head_dim]`` in their slots.

    One ``index_put_`` writes both (keys at index 0 of the second axis, values at 1), so the
    model passes the keys and values as they come out of its q/k/v projection, unsplit.

    Args:
        layer: One layer's cache.
        key_value: The step's keys, rotary embeddings applied, and values.
        metadata: The step's layout.
    """
    target = layer.flat if metadata.keys_transposed else layer.rows
    if key_value.dtype != target.dtype:  # a cache in another dtype (kv_cache_dtype)
        key_value = key_value.to(target.dtype)
    target.index_put_((metadata.write_index,), key_value)


def paged_attention(
    query: torch.Tensor,
    key_value: torch.Tensor,
    layer: LayerCache,
    metadata: AttentionMetadata,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attend every query over its request's history in one layer's cache.

    The step's own keys and values must already be written (:func:`write_kv`); they are
    passed as well because a chunk without history attends over them directly.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, rotary embeddings applied (any strides).
        key_value: ``[num_tokens, 2, num_kv_heads, head_dim]``, the step's keys and values.
        layer: One layer's cache.
        metadata: The step's layout.
        scale: Multiplies the scores (``head_dim ** -0.5`` for Llama).
        window: The layer's sliding window: the query at position ``p`` sees the keys at
            ``(p - window, p]``, ``window`` positions counting its own (transformers'
            ``sliding_window`` for Mistral and Gemma 3). ``None``: every earlier position.
        softcap: The scaled scores become ``softcap * tanh(scores / softcap)`` before the
            mask (Gemma 2's ``attn_logit_softcapping``); only the ``"matmul"`` kernel
            computes the scores where this can be done, so the plan picks it for such a
            model. ``None``: the scores as they are.

    Returns:
        ``[num_tokens, num_heads * head_dim]``, the output projection's input.

    Raises:
        ValueError: ``window`` is below 1, or ``softcap`` is given to another kernel than
            ``"matmul"``.
    """
    if softcap is not None and metadata.kernel != "matmul":
        raise ValueError(
            f"soft-capped scores need the 'matmul' attention kernel (the others do not "
            f"compute the scores in torch's operators), got {metadata.kernel!r}"
        )
    if window is not None:
        metadata = metadata.windowed(window)  # the same metadata where nothing changes
    num_tokens, num_heads, head_dim = query.shape
    groups = metadata.decode_groups
    if not metadata.prefills and len(groups) == 1 and groups[0].paged is not None:
        # The CPU's usual step.
        return _decode_native(query, layer, groups[0].paged, scale, window)
    if metadata.paged_chunks is not None:
        return _chunks_native(query, layer, metadata.paged_chunks, scale, window)
    if not metadata.prefills and all(group.bags is not None for group in groups):
        # The CPU's usual decode step: the groups' results, in order, are the whole output
        # (one group's without a copy), in fewer calls than filling a new tensor.
        parts = [
            _decode_bags(query, layer, g.bags, g.mask, scale)
            for g in groups
            if g.bags is not None and g.mask is not None
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(num_tokens, -1)
    num_kv_heads, block_size = layer.data.shape[2], layer.data.shape[3]
    out = query.new_empty(num_tokens, num_heads, head_dim)
    for group in groups:
        rows = slice(group.offset, group.offset + group.num_decodes)
        decodes = group.num_decodes
        if group.paged is not None:
            out[rows] = _decode_native(query[rows], layer, group.paged, scale, window).view(
                decodes, num_heads, head_dim
            )
            continue
        assert group.mask is not None
        if group.bags is not None:
            attended = _decode_bags(query, layer, group.bags, group.mask, scale)
            out[rows] = attended.view(decodes, num_heads, head_dim)
            continue
        assert group.gather is not None
        history = _gathered(layer, group.gather, query.dtype)
        history = history.view(2, decodes * num_kv_heads, -1, head_dim)
        if metadata.kernel == "matmul":
            out[rows] = _decode_matmul(query[rows], history, group.mask, scale, softcap)
        else:
            shape = (decodes, num_kv_heads, -1, head_dim)
            attended = F.scaled_dot_product_attention(
                query[rows].reshape(decodes, num_kv_heads, num_heads // num_kv_heads, head_dim),
                history[0].view(shape),
                history[1].view(shape),
                attn_mask=group.mask,
                scale=scale,
            )
            # reshape, not view: CUDA's fused kernels lay their output out as
            # [decodes, group, kv_heads, dim], so the heads do not merge without a copy.
            out[rows] = attended.reshape(decodes, num_heads, head_dim)
    for chunk in metadata.prefills:
        rows = slice(chunk.offset, chunk.offset + chunk.num_tokens)
        if chunk.gather is None:
            own = key_value[rows].transpose(0, 2)  # [kv_heads, 2, n, dim]
            keys, values = own[:, 0], own[:, 1]
        else:
            history = _gathered(layer, chunk.gather, query.dtype)
            history = history.view(2, num_kv_heads, -1, head_dim)
            keys, values = history[0, :, : chunk.num_keys], history[1, :, : chunk.num_keys]
            if metadata.keys_transposed:  # each block's keys are [head_dim, block_size]
                tiles = history[0].view(num_kv_heads, -1, head_dim, block_size)
                keys = tiles.transpose(2, 3).reshape(num_kv_heads, -1, head_dim)
                keys = keys[:, : chunk.num_keys]
        if metadata.kernel == "matmul":
            assert chunk.mask is not None
            out[rows] = _prefill_matmul(
                query[rows], keys, values, chunk.mask, scale, window, softcap
            )
        elif chunk.mask is None:
            # No history: is_causal and no mask, which the fused kernels take with GQA.
            attended = F.scaled_dot_product_attention(
                query[rows].transpose(0, 1)[None],
                keys[None],
                values[None],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[rows] = attended[0].transpose(0, 1)
        else:
            out[rows] = _prefill_sdpa_folded(query[rows], keys, values, chunk.mask, scale)
    return out.view(num_tokens, -1)


def _gathered(layer: LayerCache, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's ``(block, head)`` rows ``index`` in ``dtype``: a cache held in another
    dtype than the activations (``kv_cache_dtype``) is widened as it is gathered."""
    history = layer.blocks.index_select(0, index)
    return history if history.dtype == dtype else history.to(dtype)


def _prefill_sdpa_folded(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """A chunk with history through SDPA, its query groups folded into the query rows.

    A mask together with ``enable_gqa`` rules out both fused SDPA kernels on CUDA (flash
    takes no mask, memory-efficient no GQA), leaving the slow math one. As the decodes do,
    the ``G`` query heads that share a key/value head become ``G`` query rows of that head
    (row ``q * G + g``), so the call has as many query heads as key heads, and each mask row
    is repeated for the ``G`` rows of its query. The fold costs a copy of the chunk's
    queries and of its mask (``[n * G, keys]``) per layer: small next to the attention.

    ``query`` is ``[n, heads, dim]``, ``keys`` and ``values`` ``[kv_heads, keys, dim]``,
    ``mask`` ``[n, keys]``; returns ``[n, heads, dim]``.
    """
    count, num_heads, head_dim = query.shape
    num_kv_heads, num_keys = keys.shape[0], keys.shape[1]
    groups = num_heads // num_kv_heads
    rows = query.view(count, num_kv_heads, groups, head_dim).transpose(0, 1)
    rows = rows.reshape(num_kv_heads, count * groups, head_dim)
    if groups > 1:
        mask = mask[:, None, :].expand(count, groups, num_keys).reshape(count * groups, num_keys)
    attended = F.scaled_dot_product_attention(
        rows[None], keys[None], values[None], attn_mask=mask, scale=scale
    )
    attended = attended[0].view(num_kv_heads, count, groups, head_dim).transpose(0, 1)
    return attended.reshape(count, num_heads, head_dim)


def _decode_native(
    query: torch.Tensor,
    layer: LayerCache,
    paged: PagedDecodes,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """The decodes through the compiled kernel: one call, keys and values read in place
    (only the blocks each decode's ``window`` reaches).

    ``query`` is ``[R, heads, dim]`` (any strides; the q/k/v output's view is read as it
    is), its rows the decodes in order; returns ``[R, heads * dim]``.
    """
    keys, values = layer.key_rows, layer.value_rows
    return paged.kernel(query, keys, values, paged.tables, paged.lengths, scale, window)


def _chunks_native(
    query: torch.Tensor,
    layer: LayerCache,
    chunks: PagedChunks,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Every chunk of a step with prefills through the compiled kernel, decodes as chunks of
    one token: one call, keys and values read in place, no gather and no mask.

    ``query`` is ``[T, heads, dim]`` (any strides); returns ``[T, heads * dim]``.
    """
    num_tokens, num_heads, head_dim = query.shape
    out = query.new_empty(num_tokens, num_heads * head_dim)
    chunks.kernel.prefill(
        query,
        layer.key_rows,
        layer.value_rows,
        chunks.tables,
        chunks.starts,
        chunks.counts,
        chunks.offsets,
        scale,
        out,
        window,
    )
    return out


def _decode_bags(
    query: torch.Tensor,
    layer: LayerCache,
    bags: DecodeBags,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query row per head, keys and values read in place: two ``embedding_bag`` calls.

    A block's scores for one query head are the sum over ``d`` of ``query[d]`` times row
    ``d`` of the block's transposed keys (``[head_dim, block_size]``): a weighted bag of
    rows, which ``embedding_bag`` computes straight from the cache, through the block
    table, with no copy of the keys. The output is likewise a bag of value rows weighted by
    the probabilities. Scores are scaled, masked and normalized in float32 as in
    :func:`_decode_matmul`; the sums run in another order than the products', so float32
    results agree to rounding (about 1e-7), not bit for bit.

    Each line is as few torch calls as it takes (``torch.embedding_bag`` rather than
    ``F.embedding_bag``'s Python checks, ``mask + scale * scores`` as one ``add``, no cast
    in float32): every call hands the GIL back and forth (see docs/performance.md). Rows
    are picked with ``index_select``, not advanced indexing or ``take``, which were 10x and
    2.4x slower here (SmolLM2's batch 32, measured).

    ``query`` is the whole step's ``[T, heads, dim]`` (the bags name their queries' rows),
    ``mask`` float32 ``[R, 1, W * block_size]``; returns ``[R * heads, dim]``.
    """
    decodes, width = mask.shape[0], mask.shape[-1]
    weights = _query_weights(query, bags)
    scores = torch.embedding_bag(
        layer.key_rows, bags.key_index, bags.key_offsets, False, 0, False, weights
    )[0].view(decodes, -1, width)
    if scores.dtype != torch.float32:
        scores = scores.float()
    # mask + scale * scores: one rounding of the product, as scores * scale + mask has
    # (the mask is 0 or -inf), so this is the same arithmetic in one call instead of two.
    probs = torch.softmax(torch.add(mask, scores, alpha=scale), dim=-1)
    if probs.dtype != query.dtype:
        probs = probs.to(query.dtype)
    attended: torch.Tensor = torch.embedding_bag(
        layer.value_rows,
        bags.value_index,
        bags.value_offsets,
        False,
        0,
        False,
        probs.view(-1).index_select(0, bags.prob_index),
    )[0]
    return attended


def _query_weights(query: torch.Tensor, bags: DecodeBags) -> torch.Tensor:
    """The bags' query rows, flat: the key bags' per-sample weights.

    The model's queries are a view of its q/k/v projection's output, each token's heads
    consecutive rows of ``dim`` followed by its keys and values: viewed as rows over that
    storage (no copy), the query of ``(token, head)`` is row ``token * per_token + head``.
    """
    tokens, heads, dim = query.shape
    stride = query.stride()
    if stride[2] != 1 or stride[1] != dim or stride[0] % dim:
        query = query.contiguous()
        stride = query.stride()
    per_token = stride[0] // dim
    rows = query.as_strided(((tokens - 1) * per_token + heads, dim), (dim, 1))
    index = torch.add(bags.query_heads, bags.query_tokens, alpha=per_token)
    weights: torch.Tensor = rows.index_select(0, index).view(-1)
    return weights


def _soft_capped(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)`` in place, as transformers' Gemma 2 eager attention caps
    its scaled scores before the mask; the scores as they are without a ``cap``."""
    if cap is None:
        return scores
    return scores.div_(cap).tanh_().mul_(cap)


def _decode_matmul(
    query: torch.Tensor,
    history: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
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
    scores = _soft_capped(scores.view(decodes, num_heads, -1).mul_(scale), softcap).add_(mask)
    probs = torch.softmax(scores, dim=-1).to(query.dtype).view(batch, -1, scores.shape[-1])
    return torch.bmm(probs, history[1]).view(decodes, num_heads, head_dim)


def _prefill_matmul(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """A chunk's causal attention as batched products, its queries in tiles (the scores
    soft-capped before the mask with a ``softcap``, :func:`_soft_capped`).

    ``query`` is ``[n, heads, dim]``, ``keys`` and ``values`` ``[kv_heads, keys, dim]`` (the
    chunk's queries are the last ``n`` positions) and ``mask`` float32 ``[n, keys]`` (with
    ``window``, the windowed mask). Each tile of queries is scored against the keys up to its
    last query only, which skips most of what the causal mask would discard, from its first
    query's window on (the keys before it are masked for every query of the tile), and at
    most :data:`_TILE_SCORES` scores at a time.
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
        low = 0 if window is None else max(0, start + first + 1 - window)
        tile_rows = rows[:, first:last].reshape(num_kv_heads, -1, head_dim)
        scores = torch.bmm(tile_rows, keys[:, low:seen].transpose(1, 2)).to(torch.float32)
        scores = scores.view(num_kv_heads, last - first, groups, seen - low).mul_(scale)
        scores = _soft_capped(scores, softcap).add_(mask[first:last, None, low:seen])
        probs = torch.softmax(scores, dim=-1).to(query.dtype).view(num_kv_heads, -1, seen - low)
        attended = torch.bmm(probs, values[:, low:seen])
        parts.append(attended.view(num_kv_heads, -1, groups, head_dim))
    attended = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return attended.transpose(0, 1).reshape(count, num_heads, head_dim)
