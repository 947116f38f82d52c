"""Sliding-window attention: every kernel against dense attention under transformers' mask.

transformers (``masking_utils.sliding_window_overlay``) lets the query at position ``p`` see
the keys at ``kv_idx > p - sliding_window``, causally: ``(p - window, p]``, ``window``
positions counting its own. Each kernel a step can carry must give that, for decodes,
prefill chunks from position 0 and chunks with history, windows shorter and longer than
the sequences, grouped query heads.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from twostroke.engine.attention import ops
from twostroke.engine.attention.kernels import AttentionKernel, native_kernel
from twostroke.engine.attention.kv_cache import KVCache
from twostroke.engine.attention.metadata import AttentionMetadata, ChunkSpec
from twostroke.engine.attention.ops import paged_attention, write_kv

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")
KV_HEADS, GROUPS, WIDTH = 2, 3, 8
HEADS = KV_HEADS * GROUPS
KERNELS: list[AttentionKernel] = ["matmul", "sdpa", "bag", "native"]


def dense_window(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int
) -> torch.Tensor:
    """Queries at positions ``start...`` over keys ``[0, end)``, each seeing ``(p - window,
    p]``, grouped query heads, in float64: transformers' sliding-window mask, written out."""
    keys = keys.double().repeat_interleave(GROUPS, dim=1)  # [L, H, D]
    values = values.double().repeat_interleave(GROUPS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) / math.sqrt(WIDTH)
    at = torch.arange(start, start + query.shape[0])[:, None]
    key = torch.arange(keys.shape[0])[None, :]
    scores = scores.masked_fill((key > at) | (key <= at - window), -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def layout(
    chunks: list[ChunkSpec],
    kernel: AttentionKernel,
    *,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    group_overhead: int | None = None,
) -> AttentionMetadata:
    """A step's metadata for ``kernel``: the compiled one built for the cache, as a runner
    hands it, torch's by name."""
    handed = kernel
    if kernel == "native":
        handed = native_kernel(
            CPU,
            block_size=block_size,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=WIDTH,
            dtype=dtype,
        )
    return AttentionMetadata.build(
        chunks,
        block_size=block_size,
        num_blocks=num_blocks,
        num_kv_heads=KV_HEADS,
        dtype=dtype,
        device=CPU,
        kernel=handed,
        group_overhead=group_overhead,
        num_heads=HEADS,
        head_dim=WIDTH,
    )


def attend_step(
    kernel: AttentionKernel,
    spans: list[tuple[int, int]],
    window: int | None,
    *,
    dtype: torch.dtype,
    block_size: int,
    seed: int,
    group_overhead: int | None = None,
) -> None:
    """One step of chunks ``(start, count)`` (single tokens first are the decodes), their
    histories written by an earlier step, against :func:`dense_window`.

    For the compiled kernel every block wholly before a chunk's first window is NaN and not
    the request's own (its table names a poisoned block there): it must read none of them.
    """
    generator = torch.Generator().manual_seed(seed)
    widths = [-(-(start + count) // block_size) for start, count in spans]
    num_blocks = sum(widths) + 1  # block 0: poison, named where nothing may be read
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=KV_HEADS,
        head_dim=WIDTH,
        dtype=dtype,
        device=CPU,
    )
    chunks, histories = [], []
    for (start, count), width in zip(spans, widths, strict=True):
        end = start + count
        table = tuple(order.pop() for _ in range(width))
        keys = torch.randn(end, KV_HEADS, WIDTH, generator=generator).to(dtype)
        values = torch.randn(end, KV_HEADS, WIDTH, generator=generator).to(dtype)
        if start:  # the history an earlier step wrote
            earlier = layout(
                [ChunkSpec(0, start, table)],
                kernel,
                block_size=block_size,
                num_blocks=num_blocks,
                dtype=dtype,
            )
            write_kv(cache.layer(0), torch.stack((keys, values), 1)[:start], earlier)
        if kernel == "native" and window is not None:
            behind = max(0, start + 1 - window) // block_size  # before every query's window
            table = (0,) * behind + table[behind:]
        chunks.append(ChunkSpec(start, count, table))
        histories.append((keys, values))
    if kernel == "native" and window is not None:
        cache.data[:, :, 0] = math.nan
    step = layout(
        chunks,
        kernel,
        block_size=block_size,
        num_blocks=num_blocks,
        dtype=dtype,
        group_overhead=group_overhead,
    )
    query = torch.randn(step.num_tokens, HEADS, WIDTH, generator=generator).to(dtype)
    new = torch.cat(
        [
            torch.stack((keys[c.start :], values[c.start :]), 1)
            for c, (keys, values) in zip(chunks, histories, strict=True)
        ]
    )
    write_kv(cache.layer(0), new, step)
    out = paged_attention(query, new, cache.layer(0), step, scale=WIDTH**-0.5, window=window)
    out = out.view(-1, HEADS, WIDTH)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    offset = 0
    for chunk, (keys, values) in zip(chunks, histories, strict=True):
        rows = slice(offset, offset + chunk.num_tokens)
        seen = chunk.end if window is None else window
        expected = dense_window(query[rows], keys, values, chunk.start, seen)
        torch.testing.assert_close(
            out[rows].double(),
            expected,
            atol=tolerance,
            rtol=0,
            msg=lambda text, chunk=chunk: f"{kernel}, window {window}, {chunk}: {text}",
        )
        offset += chunk.num_tokens


# Three decodes (one a one-token prompt), a first chunk, a later chunk, and a single token
# after them that takes the per-chunk path: ends 10, 1, 31, 11, 11, 14.
MIXED = [(9, 1), (0, 1), (30, 1), (0, 11), (5, 6), (13, 1)]


@pytest.mark.parametrize("window", [1, 3, 6, 11, 40])
@pytest.mark.parametrize(
    ("kernel", "group_overhead", "tile_scores"),
    [
        ("matmul", None, None),
        ("matmul", 0, 100),  # a chunk's queries one or two at a time
        ("sdpa", 0, None),
        ("bag", None, None),
        ("bag", 0, None),
        ("native", None, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_matches_a_dense_window_mask(
    dtype: torch.dtype,
    kernel: AttentionKernel,
    group_overhead: int | None,
    tile_scores: int | None,
    window: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decodes and chunks with and without history in one step, windows shorter than every
    sequence (1: a query sees only itself), between, and longer than all."""
    if tile_scores is not None:
        monkeypatch.setattr(ops, "_TILE_SCORES", tile_scores)
    attend_step(
        kernel, MIXED, window, dtype=dtype, block_size=4, seed=0, group_overhead=group_overhead
    )


@settings(max_examples=30, deadline=None)
@given(
    kernel=st.sampled_from(KERNELS),
    spans=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=5),
    window=st.integers(1, 45),
    block_size=st.sampled_from([1, 3, 4, 16]),
    decodes_first=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_steps_match_a_dense_window_mask(
    kernel: AttentionKernel,
    spans: list[tuple[int, int]],
    window: int,
    block_size: int,
    decodes_first: bool,
    seed: int,
) -> None:
    """Any chunks from any positions, any window, any block size (the window's edge inside
    a block or on one), float32."""
    if decodes_first:  # as a runner orders them: the decodes batched, longest first
        spans = sorted(spans, key=lambda span: (span[1] != 1, -(span[0] + span[1])))
    attend_step(kernel, spans, window, dtype=torch.float32, block_size=block_size, seed=seed)


@pytest.mark.parametrize("window", [1, 5, 9])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "schedule",
    [[23], [8, 8, 7], [5, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 23],
    ids=["whole", "chunked", "chunked-then-decoded", "decoded"],
)
def test_one_request_prefilled_whole_chunked_or_decoded_sees_its_window(
    schedule: list[int], kernel: AttentionKernel, window: int
) -> None:
    """One request of 23 tokens through a cache, step after step as a runner does it: every
    token's output is the dense window's, however its positions were cut into steps."""
    block_size, dtype = 4, torch.float32
    generator = torch.Generator().manual_seed(window)
    total = sum(schedule)
    keys = torch.randn(total, KV_HEADS, WIDTH, generator=generator)
    values = torch.randn(total, KV_HEADS, WIDTH, generator=generator)
    query = torch.randn(total, HEADS, WIDTH, generator=generator)
    num_blocks = -(-total // block_size) + 1
    table = tuple(torch.randperm(num_blocks - 1, generator=generator).add(1).tolist())
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=KV_HEADS,
        head_dim=WIDTH,
        dtype=dtype,
        device=CPU,
    )
    outputs = []
    start = 0
    for count in schedule:
        end = start + count
        step = layout(
            [ChunkSpec(start, count, table)],
            kernel,
            block_size=block_size,
            num_blocks=num_blocks,
            dtype=dtype,
        )
        new = torch.stack((keys[start:end], values[start:end]), 1)
        write_kv(cache.layer(0), new, step)
        layer = cache.layer(0)
        outputs.append(
            paged_attention(query[start:end], new, layer, step, scale=WIDTH**-0.5, window=window)
        )
        start = end
    out = torch.cat(outputs).view(total, HEADS, WIDTH).double()
    expected = dense_window(query, keys, values, 0, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_a_window_without_effect_leaves_the_step_as_it_is() -> None:
    """Without a window, or with one no chunk reaches past, the step is attended exactly as
    before (the same metadata, the same bits)."""
    chunks = [ChunkSpec(5, 1, (1, 2)), ChunkSpec(0, 7, (3, 4))]
    step = layout(chunks, "matmul", block_size=4, num_blocks=5, dtype=torch.float32)
    assert step.windowed(7) is step
    assert step.windowed(6) is not step
    native = layout(chunks, "native", block_size=4, num_blocks=5, dtype=torch.float32)
    assert native.windowed(2) is native  # the compiled kernel takes the window itself


@pytest.mark.parametrize("kernel", ["matmul", "sdpa", "bag"])
def test_windowed_masks_are_made_once_per_step_and_window(kernel: AttentionKernel) -> None:
    """Every layer with the same window shares one set of masks; the decode sees its last
    ``window`` positions, a chunk's queries theirs, and SDPA's chunk from position 0 gets a
    mask where ``is_causal`` served."""
    chunks = [ChunkSpec(5, 1, (1, 2)), ChunkSpec(0, 4, (3,))]
    step = layout(chunks, kernel, block_size=4, num_blocks=5, dtype=torch.bfloat16)
    windowed = step.windowed(3)
    assert step.windowed(3) is windowed
    assert step.windowed(2) is not windowed
    (group,) = windowed.decode_groups
    assert group.mask is not None
    decode_mask = group.mask.reshape(-1)
    assert (~torch.isinf(decode_mask)).tolist() == [False] * 3 + [True] * 3 + [False] * 2
    (chunk,) = windowed.prefills
    assert chunk.mask is not None
    assert chunk.mask.dtype == (torch.float32 if kernel == "matmul" else torch.bfloat16)
    assert (~torch.isinf(chunk.mask)).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [False, True, True, True],
    ]
    own = step.decode_groups[0].mask  # the step's own masks are unchanged
    assert own is not None
    assert (~torch.isinf(own.reshape(-1))).tolist() == [True] * 6 + [False] * 2


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_below_one_is_refused(window: int) -> None:
    step = layout([ChunkSpec(0, 2, (1,))], "bag", block_size=4, num_blocks=2, dtype=torch.float32)
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=2,
        block_size=4,
        num_kv_heads=KV_HEADS,
        head_dim=WIDTH,
        dtype=torch.float32,
        device=CPU,
    )
    new = torch.zeros(2, 2, KV_HEADS, WIDTH)
    query = torch.zeros(2, HEADS, WIDTH)
    message = rf"a sliding window must be >= 1 \(a query sees its own position\), got {window}"
    with pytest.raises(ValueError, match=message):
        paged_attention(query, new, cache.layer(0), step, scale=1.0, window=window)


def test_metadata_made_by_hand_cannot_be_windowed() -> None:
    step = layout([ChunkSpec(0, 6, (1, 2))], "matmul", block_size=4, num_blocks=3,
                  dtype=torch.float32)  # fmt: skip
    bare = AttentionMetadata(
        positions=step.positions,
        slot_mapping=step.slot_mapping,
        num_decodes=0,
        decode_groups=(),
        kernel="matmul",
        prefills=step.prefills,
    )
    with pytest.raises(ValueError, match="windowed\\(\\) needs the chunks"):
        bare.windowed(2)
