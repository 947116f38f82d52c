"""Paged attention against dense attention over the same histories."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from twostroke.engine.attention import ops
from twostroke.engine.attention.kernels import AttentionKernel, default_kernel, native_kernel
from twostroke.engine.attention.kv_cache import KVCache, LayerCache
from twostroke.engine.attention.metadata import (
    AttentionMetadata,
    ChunkSpec,
    default_group_overhead,
    split_decodes,
)
from twostroke.engine.attention.ops import paged_attention, write_kv
from twostroke.engine.kernels.paged_attention import PagedDecodeKernel

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

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


def handed(
    kernel: AttentionKernel | None, block_size: int, dtype: torch.dtype
) -> AttentionKernel | PagedDecodeKernel | None:
    """What a step's layout is given for ``kernel``: the compiled one as itself, built for
    the cache (as a runner builds it once), torch's by name."""
    if kernel != "native":
        return kernel
    return native_kernel(
        CPU,
        block_size=block_size,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=WIDTH,
        dtype=dtype,
    )


def metadata(
    chunks: list[ChunkSpec],
    num_blocks: int,
    dtype: torch.dtype,
    kernel: AttentionKernel | None = None,
    group_overhead: int | None = None,
) -> AttentionMetadata:
    return AttentionMetadata.build(
        chunks,
        block_size=BLOCK,
        num_blocks=num_blocks,
        num_kv_heads=KV_HEADS,
        dtype=dtype,
        device=CPU,
        kernel=handed(kernel, BLOCK, dtype),
        group_overhead=group_overhead,
        num_heads=HEADS,
        head_dim=WIDTH,
    )


@pytest.mark.parametrize(
    ("kernel", "group_overhead", "tile_scores"),
    [
        ("matmul", None, None),
        ("matmul", 0, 100),
        ("sdpa", 0, None),
        ("bag", None, None),
        ("bag", 0, None),
        ("native", None, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_matches_dense_attention(
    dtype: torch.dtype,
    kernel: AttentionKernel,
    group_overhead: int | None,
    tile_scores: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decodes of different lengths plus prefill chunks with and without history, one step.

    With ``tile_scores`` the matmul kernel takes a chunk's queries one or two at a time.
    """
    if tile_scores is not None:
        monkeypatch.setattr(ops, "_TILE_SCORES", tile_scores)
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
            earlier = metadata([ChunkSpec(0, start, table)], num_blocks, dtype, kernel)
            write_kv(cache.layer(0), torch.stack((keys, values), 1)[:start], earlier)
        chunks.append(ChunkSpec(start, count, table))
        histories.append((keys, values))
    step = metadata(chunks, num_blocks, dtype, kernel, group_overhead)
    assert step.kernel == kernel
    assert step.num_decodes == 3
    # Lengths 10, 1, 31 in blocks of 4: one group, or cut wherever padding is saved.
    expected_groups = [(0, 3)] if group_overhead is None else [(0, 2), (2, 1)]
    assert [
        (g.offset, g.num_decodes) for g in step.decode_groups
    ] == expected_groups  # only the leading single-token chunks are batched
    if kernel == "native":  # every chunk in one call, histories read in place
        assert step.paged_chunks is not None
        assert step.paged_chunks.counts.tolist() == [count for _, count in shapes]
        assert all(chunk.gather is None and chunk.mask is None for chunk in step.prefills)
    else:
        assert step.paged_chunks is None
    query = torch.randn(step.num_tokens, HEADS, WIDTH, generator=generator).to(dtype)
    new_keys = torch.cat([keys[c.start :] for c, (keys, _) in zip(chunks, histories, strict=True)])
    new_values = torch.cat(
        [values[c.start :] for c, (_, values) in zip(chunks, histories, strict=True)]
    )
    new = torch.stack((new_keys, new_values), 1)
    write_kv(cache.layer(0), new, step)
    out = paged_attention(query, new, cache.layer(0), step, scale=WIDTH**-0.5)
    out = out.view(-1, HEADS, WIDTH)
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
    (group,) = step.decode_groups
    assert torch.isinf(group.mask).flatten().tolist() == [False] * 4


def test_the_write_index_is_computed_once_when_first_asked_for() -> None:
    step = metadata([ChunkSpec(3, 1, (7, 2)), ChunkSpec(2, 4, (5, 9))], 10, torch.float32)
    index = step.write_index
    assert index is step.write_index
    assert index.shape[0] == 5
    bare = attrs.evolve(step, layout=None)  # metadata made by hand, without the cache layout
    with pytest.raises(ValueError, match="write_index needs the cache layout"):
        _ = bare.write_index


@pytest.mark.parametrize("kernel", ["matmul", "bag", "native"])
def test_keys_and_values_land_in_their_block_head_and_offset(kernel: AttentionKernel) -> None:
    """The cache is head-major inside a block: ``[layer, kv, block, head, offset, dim]``;
    for the bag and native kernels each block's keys are transposed, ``[..., head, dim,
    offset]``."""
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=10,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=WIDTH,
        dtype=torch.float32,
        device=CPU,
    )
    chunks = [ChunkSpec(3, 1, (7, 2)), ChunkSpec(2, 4, (5, 9))]
    step = metadata(chunks, 10, torch.float32, kernel)
    keys = torch.randn(5, KV_HEADS, WIDTH)
    values = torch.randn(5, KV_HEADS, WIDTH)
    write_kv(cache.layer(0), torch.stack((keys, values), 1), step)
    for token, slot in enumerate(step.slot_mapping.tolist()):
        block, offset = divmod(slot, BLOCK)
        for head in range(KV_HEADS):
            tile = cache.key[0, block, head]
            transposed = kernel in ("bag", "native")
            stored = tile.view(WIDTH, BLOCK)[:, offset] if transposed else tile[offset]
            assert torch.equal(stored, keys[token, head])
            assert torch.equal(cache.value[0, block, head, offset], values[token, head])
    assert int((cache.data != 0).sum()) == 2 * keys.numel()  # nothing else was written


@pytest.mark.parametrize("kernel", ["matmul", "sdpa"])
def test_padded_decodes_gather_their_history_and_mask_every_key_past_it(
    kernel: AttentionKernel,
) -> None:
    num_blocks = 8
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=WIDTH,
        dtype=torch.float32,
        device=CPU,
    )
    cache.data.copy_(torch.randn(cache.data.shape))
    step = metadata([ChunkSpec(1, 1, (4,)), ChunkSpec(6, 1, (1, 3))], num_blocks, torch.float32,
                    kernel)  # fmt: skip
    (group,) = step.decode_groups
    assert (group.offset, group.num_decodes) == (0, 2)
    blocks = cache.layer(0).blocks
    gathered = blocks.index_select(0, group.gather).view(2, 2, KV_HEADS, -1, WIDTH)
    for request, table in enumerate([(4,), (1, 3)]):
        for kv, stored in enumerate((cache.key[0], cache.value[0])):
            # [blocks, heads, offset, dim] -> [heads, positions, dim]
            history = stored[list(table)].transpose(0, 1).reshape(KV_HEADS, -1, WIDTH)
            length = history.shape[1]
            assert torch.equal(gathered[kv, request, :, :length], history)
    mask = group.mask.reshape(2, -1)
    assert group.mask.dim() == (3 if kernel == "matmul" else 4)
    assert (~torch.isinf(mask)).sum(dim=1).tolist() == [2, 7]


@pytest.mark.parametrize("kernel", ["matmul", "sdpa"])
def test_a_chunk_from_position_0_attends_without_gather(kernel: AttentionKernel) -> None:
    step = metadata([ChunkSpec(0, 3, (1, 2)), ChunkSpec(3, 2, (4, 6))], 8, torch.bfloat16, kernel)
    first, later = step.prefills
    assert (first.gather, first.offset, first.num_keys) == (None, 0, 3)
    mask_dtype = torch.float32 if kernel == "matmul" else torch.bfloat16
    if kernel == "sdpa":
        assert first.mask is None  # is_causal
    else:
        assert first.mask is not None
        assert first.mask.dtype == mask_dtype
        assert (~torch.isinf(first.mask)).tolist() == [[True, False, False], [True, True, False],
                                                       [True] * 3]  # fmt: skip
    assert later.gather is not None
    assert later.mask is not None
    assert (later.offset, later.num_keys, later.mask.dtype) == (3, 5, mask_dtype)
    # Query at position 3 sees keys 0..3, at position 4 keys 0..4.
    assert (~torch.isinf(later.mask)).tolist() == [[True] * 4 + [False], [True] * 5]


@pytest.mark.parametrize(
    ("lengths", "overhead", "cuts"),
    [
        ([], 0, []),
        ([40, 40, 40], 0, []),  # nothing to save
        ([40, 40, 8, 8], None, []),  # never cut
        ([40, 40, 8, 8], 63, [2]),
        ([40, 40, 8, 8], 64, []),
        ([40, 24, 8], 0, [1, 2]),
        ([8, 40, 40], 0, [1]),  # any order; cuts at the jump
        ([37, 33, 5, 1], 0, [2, 3]),  # widths in whole blocks: 40, 36, 8, 4
        ([37, 33, 5, 1], 4, [2]),  # the second cut saves only 4
    ],
)
def test_split_decodes_cuts_where_padding_saved_exceeds_the_overhead(
    lengths: list[int], overhead: int | None, cuts: list[int]
) -> None:
    assert split_decodes(lengths, block_size=BLOCK, overhead=overhead) == cuts


@pytest.mark.parametrize(
    ("lengths", "overhead", "max_positions", "cuts"),
    [
        ([], None, 10, []),
        ([40, 40, 40], None, 80, [2]),  # two of 40 fit in 80, not three
        ([40, 40, 40], None, 120, []),
        ([40, 8, 8, 8], None, 40, [1]),  # each group padded to its own widest
        ([100, 40], None, 40, [1]),  # a history over the bound alone: a group of its own
        ([8, 40, 8], None, 60, [1, 2]),  # any order: the widest so far pads the group
        ([40, 40, 8, 8], 63, 40, [1, 2]),  # cut for padding at 2, for the bound at 1
        ([40, 40, 8, 8], 63, None, [2]),
    ],
)
def test_split_decodes_keeps_every_group_under_max_positions(
    lengths: list[int], overhead: int | None, max_positions: int | None, cuts: list[int]
) -> None:
    got = split_decodes(lengths, block_size=BLOCK, overhead=overhead, max_positions=max_positions)
    assert got == cuts
    widths = [-(-length // BLOCK) * BLOCK for length in lengths]
    for first, last in zip([0, *got], [*got, len(lengths)], strict=True):
        if max_positions is not None and last - first > 1:
            assert max(widths[first:last]) * (last - first) <= max_positions


def test_default_kernel_is_sdpa_only_on_cuda() -> None:
    assert default_kernel(torch.device("cpu")) == "bag"
    assert default_kernel(torch.device("cuda", 0)) == "sdpa"
    assert default_group_overhead(torch.device("cpu")) == 1024
    assert default_group_overhead(torch.device("cuda", 0)) is None


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
    assert cache.data.numel() * 2 == size * 5
    assert cache.key.shape == cache.value.shape == (3, 5, 2, 16, 64)
    assert (cache.num_blocks, cache.block_size) == (5, 16)
    assert not cache.data.any()


def test_zero_blocks_zeroes_keys_and_values_of_those_blocks_in_every_layer() -> None:
    cache = KVCache.allocate(
        num_layers=2,
        num_blocks=4,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=WIDTH,
        dtype=torch.float32,
        device=CPU,
        zeroed=False,
    )
    cache.data.fill_(float("nan"))
    cache.zero_blocks([2, 0])
    cache.zero_blocks([])
    zero = (cache.data == 0).all(dim=(3, 4, 5))  # [layer, kv, block]
    assert zero.tolist() == [[[True, False, True, False]] * 2] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_never_takes_a_mask_with_grouped_query_heads(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mask with ``enable_gqa`` leaves CUDA only SDPA's math kernel: query groups are folded.

    The mixed step above (decodes, a first chunk and a chunk with history) under a spy on
    every SDPA call: none with a mask has more query heads than key heads, and the outputs
    still match dense attention.
    """
    calls: list[tuple[int, int, bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options: object
    ) -> object:
        masked = options.get("attn_mask") is not None
        calls.append((query.shape[-3], key.shape[-3], masked, bool(options.get("enable_gqa"))))
        return sdpa(query, key, value, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(ops.F, "scaled_dot_product_attention", spy)
    test_mixed_step_matches_dense_attention(dtype, "sdpa", 0, None, monkeypatch)
    assert len(calls) == 2 + 3  # two decode groups, three other chunks
    assert [call for call in calls if call[2] and (call[0] != call[1] or call[3])] == []
    assert (HEADS, KV_HEADS, False, True) in calls  # the first chunk: is_causal, GQA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_output_in_any_memory_layout_is_taken(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's fused SDPA kernels return ``[batch, heads, queries, dim]`` laid out as
    ``[batch, queries, heads, dim]`` in memory; the CPU's math kernel returns it contiguous.
    Every SDPA result here comes back in CUDA's layout, and the step still matches dense
    attention (a ``view`` of the decodes' output failed on an H200 for every request)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def transposed_layout(*args: torch.Tensor, **options: object) -> torch.Tensor:
        out = sdpa(*args, **options)  # type: ignore[arg-type]
        return out.transpose(-2, -3).contiguous().transpose(-2, -3)  # the same values

    monkeypatch.setattr(ops.F, "scaled_dot_product_attention", transposed_layout)
    test_mixed_step_matches_dense_attention(dtype, "sdpa", 0, None, monkeypatch)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    num_decodes=st.integers(1, 6),
    block_size=st.sampled_from([1, 3, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_in_place_decodes_match_gathered_products(
    data: st.DataObject, num_decodes: int, block_size: int, dtype: torch.dtype
) -> None:
    """The in-place kernels (bag and native) against the gathering one on random decode
    batches: histories of any length (last blocks partly filled, their unwritten slots NaN
    for the native kernel), blocks shared by several decodes (a prefix cache's), groups
    cut or not, queries of any strides."""
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=num_decodes, max_size=num_decodes))
    shared = data.draw(st.integers(0, min(lengths) // block_size))  # full blocks all share
    widest = -(-max(lengths) // block_size)
    num_blocks = 1 + shared + num_decodes * widest
    order = data.draw(st.permutations(range(1, num_blocks)))
    prefix, rest = tuple(order[:shared]), list(order[shared:])
    tables = []
    for length in lengths:
        own = -(-length // block_size) - shared
        tables.append(prefix + tuple(rest.pop() for _ in range(own)))
    chunks = [ChunkSpec(n - 1, 1, t) for n, t in zip(lengths, tables, strict=True)]
    chunks.sort(key=lambda chunk: -chunk.end)
    overhead = data.draw(st.sampled_from([None, 0]))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    history = torch.randn(2, num_blocks, KV_HEADS, block_size, WIDTH, generator=generator)
    # Slots past a decode's end were never written. The padding kernels need them finite (a
    # zeroed cache); the native kernel never reads them, so it gets them as NaN.
    poisoned = history.clone()
    for chunk in chunks:
        last, used = chunk.block_table[(chunk.end - 1) // block_size], (chunk.end - 1) % block_size
        if last not in prefix:
            poisoned[:, last, :, used + 1 :] = math.nan
    query = torch.randn(num_decodes, HEADS, WIDTH, generator=generator).to(dtype)
    layout = data.draw(st.sampled_from(["contiguous", "inside q/k/v", "transposed"]))
    if layout == "inside q/k/v":  # the model's: a view of the projection, offset and strided
        wide = torch.zeros(num_decodes, 1 + HEADS + 2 * KV_HEADS, WIDTH, dtype=dtype)
        query = wide[:, 1 : 1 + HEADS].copy_(query)
    elif layout == "transposed":  # rows the bag kernel cannot view: it copies them
        query = query.transpose(0, 1).contiguous().transpose(0, 1)
    new = torch.zeros(num_decodes, 2, KV_HEADS, WIDTH, dtype=dtype)
    outputs = []
    for kernel in ("matmul", "bag", "native"):
        step = AttentionMetadata.build(
            chunks,
            block_size=block_size,
            num_blocks=num_blocks,
            num_kv_heads=KV_HEADS,
            dtype=dtype,
            device=CPU,
            kernel=handed(kernel, block_size, dtype),
            group_overhead=overhead,
            num_heads=HEADS,
            head_dim=WIDTH,
        )
        layer = (poisoned if kernel == "native" else history).clone()
        if kernel != "matmul":  # the same keys, stored transposed within each block
            layer[0] = layer[0].transpose(-1, -2).reshape(layer[0].shape)
        out = paged_attention(query, new, LayerCache.of(layer.to(dtype)), step, scale=WIDTH**-0.5)
        outputs.append(out.float())
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outputs[1], outputs[0], atol=tolerance, rtol=0)
    torch.testing.assert_close(outputs[2], outputs[0], atol=tolerance, rtol=0)
