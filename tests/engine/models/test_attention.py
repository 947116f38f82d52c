"""Paged attention against dense attention over the same histories."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine.models.test_llama import one_torch_thread  # noqa: F401 (autouse)
from twostroke.engine.models.attention import (
    AttentionMetadata,
    ChunkSpec,
    KVCache,
    paged_attention,
    write_kv,
)

CPU = torch.device("cpu")
BLOCK = 4
KV_HEADS, GROUPS, WIDTH = 2, 3, 8
HEADS = KV_HEADS * GROUPS


def dense_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
) -> torch.Tensor:
    """Causal GQA attention of queries at positions ``start...`` over keys ``[0, end)``, float64."""
    keys = keys.double().repeat_interleave(GROUPS, dim=1)  # [L, H, D]
    values = values.double().repeat_interleave(GROUPS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) / math.sqrt(WIDTH)
    positions = torch.arange(start, start + query.shape[0])
    scores = scores.masked_fill(
        torch.arange(keys.shape[0])[None, :] > positions[:, None], -math.inf
    )
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def metadata(chunks: list[ChunkSpec], num_blocks: int, dtype: torch.dtype) -> AttentionMetadata:
    return AttentionMetadata.build(
        chunks,
        block_size=BLOCK,
        num_blocks=num_blocks,
        num_queries_per_kv=GROUPS,
        dtype=dtype,
        device=CPU,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_matches_dense_attention(dtype: torch.dtype) -> None:
    """Decodes of different lengths plus prefill chunks with and without history, one step."""
    generator = torch.Generator().manual_seed(0)
    # (start, num_tokens): three decodes (one a one-token prompt), a first chunk, a later
    # chunk, and a single token after them that takes the per-chunk path.
    shapes = [(9, 1), (0, 1), (30, 1), (0, 11), (5, 6), (13, 1)]
    num_blocks = 64
    order = torch.randperm(num_blocks, generator=generator).tolist()
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=WIDTH,
        dtype=dtype,
        device=CPU,
    )
    chunks, histories = [], []
    for start, count in shapes:
        end = start + count
        table = tuple(order.pop() for _ in range(-(-end // BLOCK)))
        keys = torch.randn(end, KV_HEADS, WIDTH, generator=generator).to(dtype)
        values = torch.randn(end, KV_HEADS, WIDTH, generator=generator).to(dtype)
        if start:  # the history an earlier step wrote
            earlier = metadata([ChunkSpec(0, start, table)], num_blocks, dtype)
            write_kv(
                cache.key[0], cache.value[0], keys[:start], values[:start], earlier.slot_mapping
            )
        chunks.append(ChunkSpec(start, count, table))
        histories.append((keys, values))
    step = metadata(chunks, num_blocks, dtype)
    assert step.num_decodes == 3  # only the leading single-token chunks are batched
    query = torch.randn(step.num_tokens, HEADS, WIDTH, generator=generator).to(dtype)
    new_keys = torch.cat([keys[c.start :] for c, (keys, _) in zip(chunks, histories, strict=True)])
    new_values = torch.cat(
        [values[c.start :] for c, (_, values) in zip(chunks, histories, strict=True)]
    )
    write_kv(cache.key[0], cache.value[0], new_keys, new_values, step.slot_mapping)
    out = paged_attention(query, cache.key[0], cache.value[0], step, scale=WIDTH**-0.5)
    offset = 0
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for chunk, (keys, values) in zip(chunks, histories, strict=True):
        rows = slice(offset, offset + chunk.num_tokens)
        expected = dense_attention(query[rows], keys, values, chunk.start)
        torch.testing.assert_close(out[rows].double(), expected, atol=tolerance, rtol=0)
        assert step.positions[rows].tolist() == list(range(chunk.start, chunk.end))
        offset += chunk.num_tokens


def test_slot_mapping_follows_block_tables() -> None:
    step = metadata([ChunkSpec(3, 1, (7, 2)), ChunkSpec(2, 4, (5, 9))], 10, torch.float32)
    assert step.slot_mapping.tolist() == [7 * 4 + 3, 5 * 4 + 2, 5 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1]
    assert step.num_decodes == 1
    assert step.decode_block_ids is not None and step.decode_block_ids.tolist() == [7]
    assert step.decode_mask is not None
    assert torch.isinf(step.decode_mask).flatten().tolist() == [False] * 4


def test_padded_decodes_mask_every_key_past_their_length() -> None:
    step = metadata([ChunkSpec(1, 1, (4,)), ChunkSpec(6, 1, (1, 3))], 8, torch.float32)
    assert step.decode_block_ids is not None and step.decode_block_ids.tolist() == [4, 0, 1, 3]
    assert step.decode_mask is not None
    visible = ~torch.isinf(step.decode_mask[:, 0, 0, :])
    assert visible.sum(dim=1).tolist() == [2, 7]


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (
            ChunkSpec(0, 0, (0,)),
            r"a chunk must compute at least one position from start >= 0, "
            r"got start=0 and num_tokens=0",
        ),
        (
            ChunkSpec(3, 2, (0,)),
            r"block table of 1 blocks of 4 must cover positions \[0, 5\), "
            r"which need 2",
        ),
        (ChunkSpec(0, 5, (0, 8)), r"block ids must be in \[0, 8\), got \[8\]"),
    ],
)
def test_inconsistent_chunks_are_rejected(chunk: ChunkSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        metadata([chunk], 8, torch.float32)


def test_bytes_per_block_counts_keys_and_values_of_every_layer() -> None:
    size = KVCache.bytes_per_block(
        num_layers=3, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    assert size == 2 * 3 * 16 * 2 * 64 * 2
    cache = KVCache.allocate(
        num_layers=3,
        num_blocks=5,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device=CPU,
    )
    assert cache.key.numel() * 2 * 2 == size * 5
    assert (cache.num_blocks, cache.block_size) == (5, 16)
    assert not cache.key.any() and not cache.value.any()
