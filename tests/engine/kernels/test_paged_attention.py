"""The compiled paged attention kernel (decodes and prefill chunks) and the build of every
compiled kernel: built, cached, checked, and refused with a reason."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.models.test_llama import _config
from twostroke.engine.artifacts.cache import CACHE_DIR_ENV, NO_CACHE_ENV
from twostroke.engine.attention.kernels import native_kernel
from twostroke.engine.attention.metadata import AttentionMetadata, ChunkSpec
from twostroke.engine.kernels import build, paged_attention
from twostroke.engine.kernels.build import NATIVE_ENV, NativeBuildError
from twostroke.engine.kernels.paged_attention import (
    build_kernel,
    paged_decode_kernel,
    reference_paged_decode,
    reference_paged_prefill,
)
from twostroke.engine.models.choice import select_kernels
from twostroke.gpu.isa import ISA_ENV, RUNGS, cpu_personality, rung_named
from twostroke.gpu.threads import torch_threads

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """Forget the kernels this process built, before and after (they are cached per shape)."""
    paged_attention._kernel.cache_clear()
    yield
    paged_attention._kernel.cache_clear()


def environment(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(overrides)
    return env


def batch(
    kernel: paged_attention.PagedDecodeKernel, lengths: list[int], kv_heads: int = 2
) -> tuple[torch.Tensor, ...]:
    """Random queries and cache, each decode with its own blocks, shuffled."""
    size, dim = kernel.block_size, kernel.head_dim
    generator = torch.Generator().manual_seed(len(lengths))
    widths = [-(-length // size) for length in lengths]
    num_blocks = sum(widths) + 1
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(lengths), max(widths), dtype=torch.int32)
    for row, width in enumerate(widths):
        tables[row, :width] = torch.tensor([order.pop() for _ in range(width)])
    cached = kernel.cache_dtype
    keys = torch.randn(num_blocks, kv_heads, dim, size, generator=generator).to(cached)
    values = torch.randn(num_blocks, kv_heads, size, dim, generator=generator).to(cached)
    query = torch.randn(len(lengths), kv_heads * kernel.group, dim, generator=generator)
    lengths_tensor = torch.tensor(lengths, dtype=torch.int32)
    return query.to(kernel.dtype), keys, values, tables, lengths_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "head_dim", "group"), [(16, 64, 3), (5, 8, 1), (1, 4, 4)])
def test_the_kernel_matches_torch(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    kernel = build_kernel(block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    lengths = [1, block_size, block_size + 1, 3 * block_size + 2, 40]
    query, keys, values, tables, lengths_tensor = batch(kernel, lengths)
    got = kernel(query, keys, values, tables, lengths_tensor, 0.3)
    assert got.dtype == dtype
    assert got.shape == (len(lengths), query.shape[1] * head_dim)
    expected = reference_paged_decode(query, keys, values, tables, lengths_tensor, 0.3)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("decodes", [1, 2, 3])
def test_fewer_decodes_than_threads_split_their_heads_to_the_same_bits(decodes: int) -> None:
    """With more threads than decodes each decode's heads go to different threads."""
    kernel = build_kernel(block_size=4, head_dim=8, group=2, dtype=torch.float32)
    query, keys, values, tables, lengths = batch(kernel, [37, 5, 12][:decodes], kv_heads=3)
    with torch_threads(1):
        alone = kernel(query, keys, values, tables, lengths, 0.3)
    with torch_threads(3):  # more threads than decodes, and not dividing the heads evenly
        split = kernel(query, keys, values, tables, lengths, 0.3)
    assert torch.equal(split, alone)
    expected = reference_paged_decode(query, keys, values, tables, lengths, 0.3)
    torch.testing.assert_close(split, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rung", [rung.name for rung in RUNGS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_built_for_each_instruction_set_matches_torch(
    rung: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vector code has a path per register width, and the personality picks one: each
    rung this CPU runs is built and tried here (`make test` runs the module again under the
    lower rungs, so the rest of its tests take those paths too)."""
    if rung_named(rung).rank > cpu_personality().rung.rank:
        pytest.skip(f"this run's CPU personality is below {rung}")
    monkeypatch.setenv(ISA_ENV, rung)
    # SmolLM2's shape (16-lane vectors, one output head at a time without AVX-512) and
    # one with no vector width dividing the block (scalar lanes).
    for block_size, head_dim, group in [(16, 64, 3), (5, 8, 1)]:
        kernel = build_kernel(block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
        assert kernel.vector_bits == rung_named(rung).vector_bits
        lengths = [1, block_size + 1, 3 * block_size + 2, 40]
        query, keys, values, tables, lengths_tensor = batch(kernel, lengths)
        got = kernel(query, keys, values, tables, lengths_tensor, 0.3)
        expected = reference_paged_decode(query, keys, values, tables, lengths_tensor, 0.3)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("rung", [rung.name for rung in RUNGS])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16),
    ],
)
def test_a_cache_in_another_dtype_is_read_in_place_on_each_instruction_set(
    rung: str, dtype: torch.dtype, cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kv_cache_dtype: the cache's elements are widened as they are read (F16C's one
    instruction a vector from avx2 up, the compiler's _Float16 on the portable rung), and
    the result is the reference's over the same stored values: the cache's rounding is the
    only difference from a cache in the queries' dtype."""
    if rung_named(rung).rank > cpu_personality().rung.rank:
        pytest.skip(f"this run's CPU personality is below {rung}")
    monkeypatch.setenv(ISA_ENV, rung)
    for block_size, head_dim, group in [(16, 64, 3), (5, 8, 1)]:
        kernel = build_kernel(
            block_size=block_size,
            head_dim=head_dim,
            group=group,
            dtype=dtype,
            cache_dtype=cache_dtype,
        )
        assert (kernel.dtype, kernel.cache_dtype) == (dtype, cache_dtype)
        lengths = [1, block_size + 1, 3 * block_size + 2, 40]
        query, keys, values, tables, lengths_tensor = batch(kernel, lengths)
        assert keys.dtype == cache_dtype
        got = kernel(query, keys, values, tables, lengths_tensor, 0.3)
        assert got.dtype == dtype
        expected = reference_paged_decode(query, keys, values, tables, lengths_tensor, 0.3)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=0)
        with pytest.raises(ValueError, match=f"a {cache_dtype} cache"):
            kernel(query, keys.to(dtype), values.to(dtype), tables, lengths_tensor, 0.3)


def test_an_element_type_the_cache_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match=r"float32, float16 or bfloat16, got torch\.float64"):
        build_kernel(
            block_size=4, head_dim=8, group=1, dtype=torch.float32, cache_dtype=torch.float64
        )
    assert (
        paged_decode_kernel(
            block_size=4,
            head_dim=8,
            num_heads=2,
            num_kv_heads=1,
            dtype=torch.float32,
            cache_dtype=torch.int8,
        )
        is None
    )


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    shape=st.sampled_from([(16, 64, 3), (4, 8, 2), (5, 8, 1)]),
    spans=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=5),
    shared=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_prefill_chunks_match_torch(
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    spans: list[tuple[int, int]],
    shared: bool,
    seed: int,
) -> None:
    """Chunks (and decodes, chunks of one) from any position, several tiles of query tokens
    or part of one, blocks shared by every chunk (a prefix cache's) or not, NaN in every
    slot past a chunk's end: the prefill agrees with each token attended as a decode, and
    writes no other row."""
    block_size, head_dim, group = shape
    kernel = build_kernel(block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    widths = [-(-(start + count) // block_size) for start, count in spans]
    width = max(widths)
    num_blocks = width if shared else sum(widths)
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = torch.zeros(len(spans), width, dtype=torch.int32)
    used = 0
    for row, used_width in enumerate(widths):
        first = 0 if shared else used
        tables[row, :used_width] = order[first : first + used_width]
        used += used_width
    kv_heads = 2
    keys = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=generator)
    values = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=generator)
    keys, values = keys.to(dtype), values.to(dtype)
    if not shared:  # past each chunk's end, in its last block: never written, never read
        for row, (start, count) in enumerate(spans):
            last, filled = int(tables[row, widths[row] - 1]), (start + count - 1) % block_size + 1
            keys[last, :, :, filled:] = math.nan
            values[last, :, filled:] = math.nan
    counts = torch.tensor([count for _, count in spans], dtype=torch.int32)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32) - counts + 1  # row 0 unused
    tokens = int(counts.sum()) + 2
    heads = kv_heads * group
    query = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    starts = torch.tensor([start for start, _ in spans], dtype=torch.int32)
    out = torch.full((tokens, heads * head_dim), 7.0, dtype=dtype)
    kernel.prefill(query, keys, values, tables, starts, counts, offsets, 0.3, out)
    expected = reference_paged_prefill(query, keys, values, tables, starts, counts, offsets, 0.3)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    written = slice(1, tokens - 1)
    torch.testing.assert_close(out[written].float(), expected[written], atol=tolerance, rtol=0)
    assert (out[0] == 7).all()
    assert (out[-1] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "group"), [(16, 64, 3), (16, 64, 1), (5, 8, 1), (4, 8, 2)]
)
def test_a_chunks_tokens_are_their_decodes_bit_for_bit(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    """Each token of a prefill chunk, whatever its place in a tile of query tokens, gets
    exactly what it gets attended alone as a decode: a recomputed preempted request and a
    verified draft see the numbers a decode saw (SmolLM2's shape, 16-lane vectors, summed
    its decodes' scores in two chains and its chunks' in one: greedy answers changed)."""
    kernel = build_kernel(block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    start, count = 3, 21  # a partial first block, several tiles, a partial last one
    query, keys, values, tables, _ = batch(kernel, [start + count], kv_heads=2)
    tokens = torch.randn(
        count, query.shape[1], head_dim, generator=torch.Generator().manual_seed(1)
    )
    tokens = tokens.to(dtype)
    one = torch.ones(1, dtype=torch.int32)
    out = torch.empty(count, query.shape[1] * head_dim, dtype=dtype)
    starts, counts = (
        torch.tensor([start], dtype=torch.int32),
        torch.tensor([count], dtype=torch.int32),
    )
    kernel.prefill(tokens, keys, values, tables, starts, counts, 0 * one, 0.3, out)
    for index in range(count):
        length = torch.tensor([start + index + 1], dtype=torch.int32)
        alone = kernel(tokens[index : index + 1], keys, values, tables, length, 0.3)
        assert torch.equal(out[index : index + 1], alone), f"token {index} of the chunk"
        chunk_of_one = torch.empty_like(alone)
        kernel.prefill(
            tokens[index : index + 1],
            keys,
            values,
            tables,
            length - 1,
            one,
            0 * one,
            0.3,
            chunk_of_one,
        )
        assert torch.equal(chunk_of_one, alone), f"token {index} as a chunk of one"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "head_dim", "group"), [(16, 64, 3), (5, 8, 1), (3, 4, 2)])
def test_a_decode_is_the_same_bits_beside_any_others(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    """A decode's output does not depend on the decodes beside it (their number, or a longer
    history that widens the step's scratch rows)."""
    kernel = build_kernel(block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    lengths = [7, 1, 2 * block_size + 3, 61, block_size, 13]
    query, keys, values, tables, lengths_tensor = batch(kernel, lengths)
    together = kernel(query, keys, values, tables, lengths_tensor, 0.3)
    for row in range(len(lengths)):
        alone = kernel(
            query[row : row + 1],
            keys,
            values,
            tables[row : row + 1],
            lengths_tensor[row : row + 1],
            0.3,
        )
        assert torch.equal(together[row : row + 1], alone), f"decode {row}"


def test_prefill_refuses_tensors_it_was_not_built_for() -> None:
    kernel = build_kernel(block_size=4, head_dim=8, group=2, dtype=torch.float32)
    query, keys, values, tables, _ = batch(kernel, [3, 9])
    one = torch.ones(2, dtype=torch.int32)
    out = torch.empty(2, query.shape[1] * 8)
    with pytest.raises(ValueError, match=r"int32 tables, starts, counts and offsets; .* tables"):
        kernel.prefill(query, keys, values, tables.long(), one, one, one, 1.0, out)
    with pytest.raises(ValueError, match=r"out torch\.bfloat16"):
        kernel.prefill(query, keys, values, tables, one, one, one, 1.0, out.bfloat16())


def test_a_query_of_any_strides_is_read_right() -> None:
    kernel = build_kernel(block_size=4, head_dim=8, group=2, dtype=torch.float32)
    query, keys, values, tables, lengths = batch(kernel, [3, 9, 17])
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)  # rows not of head_dim
    inside = torch.zeros(3, query.shape[1] + 5, 8)[:, 2 : 2 + query.shape[1]].copy_(query)
    expected = kernel(query, keys, values, tables, lengths, 0.5)
    for view in (strided, inside):
        torch.testing.assert_close(kernel(view, keys, values, tables, lengths, 0.5), expected)


def test_a_second_build_loads_the_cached_library(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=build.__name__)
    first = build_kernel(block_size=2, head_dim=4, group=3, dtype=torch.float32)
    built = first.path.stat().st_mtime_ns
    caplog.clear()
    second = build_kernel(block_size=2, head_dim=4, group=3, dtype=torch.float32)
    assert second.path == first.path
    assert second.path.stat().st_mtime_ns == built
    assert "compiling" not in caplog.text
    assert first.path.parent.parent == Path(os.environ[CACHE_DIR_ENV]) / "native"


def test_each_shape_and_element_type_has_its_own_library() -> None:
    # Blocks of 5 are test_the_kernel_matches_torch's (built once in the run: two compiles
    # of about 2 s of CPU each fewer); blocks of 2 differ from them in the block size alone.
    paths = {
        build_kernel(block_size=size, head_dim=8, group=1, dtype=dtype).path
        for size in (2, 5)
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert len(paths) == 4


def test_without_the_cache_the_library_is_built_and_left_nowhere(tmp_path: Path) -> None:
    env = environment(**{NO_CACHE_ENV: "1", CACHE_DIR_ENV: str(tmp_path)})
    kernel = build_kernel(block_size=3, head_dim=4, group=2, dtype=torch.float32, environ=env)
    query, keys, values, tables, lengths = batch(kernel, [4, 7])
    expected = reference_paged_decode(query, keys, values, tables, lengths, 1.0)
    torch.testing.assert_close(kernel(query, keys, values, tables, lengths, 1.0), expected)
    assert not kernel.path.exists()
    assert list(tmp_path.iterdir()) == []


def test_loading_the_library_leaves_denormals_alone() -> None:
    """Fast-math flags go to the compile only: linked in, GCC's crtfastmath would flush
    denormals to zero for the whole process, torch included."""
    build_kernel(block_size=16, head_dim=64, group=3, dtype=torch.float32)
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float(tiny * 1.0) != 0.0
    assert float(torch.tensor(1e-38) / torch.tensor(100.0)) != 0.0


@pytest.mark.parametrize(
    ("compiler", "message"),
    [
        ("/nonexistent/cc", "'/nonexistent/cc', which is not an executable"),
        ("false", "exited with 1"),
    ],
)
def test_a_compiler_that_fails_is_named_in_the_error(
    tmp_path: Path, compiler: str, message: str
) -> None:
    env = environment(CC=compiler, **{CACHE_DIR_ENV: str(tmp_path)})
    with pytest.raises(NativeBuildError, match=message):
        build_kernel(block_size=4, head_dim=8, group=1, dtype=torch.float32, environ=env)


def test_no_compiler_found_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    env = environment(CC="", **{CACHE_DIR_ENV: str(tmp_path)})
    with pytest.raises(NativeBuildError, match=r"no C compiler found \(set \$CC"):
        build_kernel(block_size=4, head_dim=8, group=1, dtype=torch.float32, environ=env)


def test_a_kernel_that_disagrees_with_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(paged_attention._TOLERANCE, torch.float32, -1.0)  # nothing passes
    with pytest.raises(NativeBuildError, match=r"check differs from torch by .* torch\.float32"):
        build_kernel(block_size=4, head_dim=8, group=1, dtype=torch.float32)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [("block_size", 0, "block_size must be >= 1, got 0"), ("group", -2, "group must be >= 1")],
)
def test_bad_sizes_are_rejected(name: str, value: int, message: str) -> None:
    sizes = {"block_size": 4, "head_dim": 8, "group": 1, name: value}
    with pytest.raises(ValueError, match=message):
        build_kernel(**sizes, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"takes float32 or bfloat16, got torch\.float16"):
        build_kernel(block_size=4, head_dim=8, group=1, dtype=torch.float16)


def chosen_attention(dtype: torch.dtype, device: torch.device = CPU) -> str:
    """The attention chosen for a model of 6 query heads of 8 over 2 (blocks of 4)."""
    config = _config(num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    kernels = select_kernels(config, dtype=dtype, device=device, exact=True, block_size=4)
    return kernels.attention


@pytest.mark.usefixtures("fresh_kernels")
def test_where_the_build_fails_the_bag_kernel_is_chosen_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=paged_attention.__name__):
        assert chosen_attention(torch.float32) == "bag"
        assert chosen_attention(torch.float32) == "bag"
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per shape and process
    assert "/nonexistent/cc" in warnings[0].getMessage()
    assert "'bag' kernel instead" in warnings[0].getMessage()
    shape = {"block_size": 4, "num_heads": 6, "num_kv_heads": 2, "head_dim": 8}
    with pytest.raises(ValueError, match=r"the 'native' kernel does not run for torch\.float32"):
        native_kernel(CPU, dtype=torch.float32, **shape)


def test_what_each_machine_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chosen_attention(torch.float32) == "native"
    assert chosen_attention(torch.bfloat16) == "native"
    assert chosen_attention(torch.float16) == "bag"  # no float16 build
    assert chosen_attention(torch.float32, torch.device("cuda", 0)) == "sdpa"
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert chosen_attention(torch.float32) == "bag"


def test_a_step_is_laid_out_for_the_compiled_kernel_it_is_given() -> None:
    """The layout resolves nothing: the compiled kernel is passed as itself, built for the
    cache's shape, and ``"native"`` by name is refused."""
    shape = {"block_size": 4, "num_heads": 6, "num_kv_heads": 2, "head_dim": 8}
    kernel = native_kernel(CPU, dtype=torch.float32, **shape)
    chunks = [ChunkSpec(2, 1, (1,))]
    step = AttentionMetadata.build(
        chunks, num_blocks=3, dtype=torch.float32, device=CPU, kernel=kernel, **shape
    )
    assert step.kernel == "native"
    assert step.decode_groups[0].paged is not None
    assert step.decode_groups[0].paged.kernel is kernel
    with pytest.raises(ValueError, match=r"'native' kernel is passed as itself"):
        AttentionMetadata.build(
            chunks, num_blocks=3, dtype=torch.float32, device=CPU, kernel="native", **shape
        )
    with pytest.raises(ValueError, match=r"built for blocks of 4, .* the cache has blocks of 8"):
        AttentionMetadata.build(
            chunks,
            num_blocks=3,
            dtype=torch.float32,
            device=CPU,
            kernel=kernel,
            **{**shape, "block_size": 8},
        )


def test_heads_that_do_not_share_evenly_get_no_kernel() -> None:
    assert (
        paged_decode_kernel(
            block_size=4, head_dim=8, num_heads=5, num_kv_heads=2, dtype=torch.float32
        )
        is None
    )


def test_nothing_past_a_decode_is_read() -> None:
    """NaN in every slot past each decode's length changes nothing."""
    kernel = build_kernel(block_size=4, head_dim=8, group=2, dtype=torch.float32)
    query, keys, values, tables, lengths = batch(kernel, [1, 6, 11])
    expected = kernel(query, keys, values, tables, lengths, 0.7)
    for row, length in enumerate(lengths.tolist()):
        last, used = int(tables[row, (length - 1) // 4]), (length - 1) % 4 + 1
        keys[last, :, :, used:] = math.nan
        values[last, :, used:] = math.nan
    assert torch.equal(kernel(query, keys, values, tables, lengths, 0.7), expected)


def test_tensors_the_kernel_was_not_built_for_are_refused() -> None:
    kernel = build_kernel(block_size=4, head_dim=8, group=2, dtype=torch.float32)
    query, keys, values, tables, lengths = batch(kernel, [3, 9])
    with pytest.raises(ValueError, match=r"got query torch\.float32 .* keys torch\.bfloat16"):
        kernel(query, keys.bfloat16(), values, tables, lengths, 1.0)
    with pytest.raises(ValueError, match=r"int32 tables and lengths; .* tables torch\.int64"):
        kernel(query, keys, values, tables.long(), lengths, 1.0)
    with pytest.raises(ValueError, match=r"blocks of 4 and heads of 8"):
        kernel(query, keys.transpose(-1, -2), values, tables, lengths, 1.0)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}


def test_the_library_runs_on_torchs_own_openmp() -> None:
    """Loading a library adds no OpenMP runtime: its libgomp.so.1 is the one torch loaded (two
    would each keep a thread team, and oversubscribe the cores). Another package may have
    brought a runtime of its own (scikit-learn does): that one is not the library's."""
    with torch_threads(2):
        torch.ones(64, 64).sum(0)  # torch's runtime is mapped and its team started
    before = openmp_runtimes()
    build_kernel(block_size=3, head_dim=8, group=5, dtype=torch.float32)  # a shape of its own
    assert openmp_runtimes() == before


def test_timed_adds_up_the_kernel_calls_made_in_its_block() -> None:
    kernel = build_kernel(block_size=4, head_dim=8, group=1, dtype=torch.float32)
    query, keys, values, tables, lengths = batch(kernel, [3, 9])
    kernel(query, keys, values, tables, lengths, 0.5)  # not timed: no block is active
    with build.timed() as outer:
        kernel(query, keys, values, tables, lengths, 0.5)
        with build.timed() as inner:
            assert build.call(max, 2, 7) == 7  # any callable: what it returns comes back
        kernel(query, keys, values, tables, lengths, 0.5)
    assert (outer.calls, inner.calls) == (2, 1)  # the inner block's call is its own
    assert outer.seconds > 0
    assert inner.seconds >= 0
    with build.timed() as failing, pytest.raises(ZeroDivisionError):
        build.call(lambda: 1 / 0)
    assert failing.calls == 1  # a call that raised was timed too


def dense_window_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: list[int],
    window: int,
    scale: float,
) -> torch.Tensor:
    """Each query row at ``positions[row]`` over the contiguous history ``keys``/``values``
    ``[L, kv_heads, dim]``, seeing ``(p - window, p]`` (transformers' sliding window), in
    float64: ``[rows, heads * dim]``."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    at = torch.tensor(positions)[:, None]
    key = torch.arange(keys.shape[0])[None, :]
    scores = scores.masked_fill((key > at) | (key <= at - window), -math.inf)
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.reshape(len(positions), -1)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    shape=st.sampled_from([(16, 64, 3), (4, 8, 2), (5, 8, 1)]),
    start=st.integers(0, 40),
    count=st.integers(1, 30),
    window=st.integers(1, 80),
    seed=st.integers(0, 2**16),
)
def test_a_sliding_window_reads_only_the_blocks_it_reaches(
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    start: int,
    count: int,
    window: int,
    seed: int,
) -> None:
    """A chunk through a window (its edge anywhere in a block; shorter or longer than the
    history) equals the dense window mask; every block wholly before its first token's
    window is NaN and read by no token; and each of its tokens is what that token gets as a
    windowed decode alone, bit for bit."""
    block_size, head_dim, group = shape
    kernel = build_kernel(block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    kv_heads, end = 2, start + count
    width = -(-end // block_size)
    history_keys = torch.randn(end, kv_heads, head_dim, generator=generator).to(dtype)
    history_values = torch.randn(end, kv_heads, head_dim, generator=generator).to(dtype)
    # Block 0 is NaN; the blocks wholly before the first token's window name it.
    order = (torch.randperm(width, generator=generator) + 1).to(torch.int32)
    behind = max(0, start + 1 - window) // block_size
    tables = order.clone()[None]
    tables[0, :behind] = 0
    keys = torch.full((width + 1, kv_heads, head_dim, block_size), math.nan, dtype=dtype)
    values = torch.full((width + 1, kv_heads, block_size, head_dim), math.nan, dtype=dtype)
    padded = -(-end // block_size) * block_size
    stored_keys = torch.zeros(padded, kv_heads, head_dim, dtype=dtype)
    stored_values = torch.zeros(padded, kv_heads, head_dim, dtype=dtype)
    stored_keys[:end], stored_values[:end] = history_keys, history_values
    blocks = (width, block_size, kv_heads, head_dim)
    keys[order.long()] = stored_keys.view(blocks).permute(0, 2, 3, 1)  # tiles [dim, size]
    values[order.long()] = stored_values.view(blocks).transpose(1, 2)
    query = torch.randn(count, kv_heads * group, head_dim, generator=generator).to(dtype)
    int32, one = torch.int32, torch.ones(1, dtype=torch.int32)
    out = torch.empty(count, kv_heads * group * head_dim, dtype=dtype)
    starts = torch.tensor([start], dtype=int32)
    counts = torch.tensor([count], dtype=int32)
    kernel.prefill(query, keys, values, tables, starts, counts, 0 * one, 0.3, out, window)
    positions = list(range(start, end))
    expected = dense_window_reference(query, history_keys, history_values, positions, window, 0.3)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)
    reference = reference_paged_prefill(
        query, keys, values, tables, starts, counts, 0 * one, 0.3, window
    )
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=0)
    for index, position in enumerate(positions):
        length = torch.tensor([position + 1], dtype=int32)
        alone = kernel(query[index : index + 1], keys, values, tables, length, 0.3, window)
        assert torch.equal(out[index : index + 1], alone), f"token {index} as a decode"


def test_a_window_as_wide_as_the_history_changes_no_bit() -> None:
    """A window that reaches position 0 is no window: the same bits as none."""
    kernel = build_kernel(block_size=4, head_dim=8, group=2, dtype=torch.float32)
    query, keys, values, tables, lengths = batch(kernel, [1, 6, 11])
    whole = kernel(query, keys, values, tables, lengths, 0.7)
    assert torch.equal(kernel(query, keys, values, tables, lengths, 0.7, 11), whole)
    assert not torch.equal(kernel(query, keys, values, tables, lengths, 0.7, 10), whole)


@pytest.mark.parametrize("window", [0, -1])
def test_a_window_below_one_is_refused_by_the_kernel(window: int) -> None:
    kernel = build_kernel(block_size=4, head_dim=8, group=2, dtype=torch.float32)
    query, keys, values, tables, lengths = batch(kernel, [3, 9])
    message = rf"a sliding window must be >= 1 \(a query sees its own position\), got {window}"
    with pytest.raises(ValueError, match=message):
        kernel(query, keys, values, tables, lengths, 1.0, window)
    out = torch.empty(2, query.shape[1] * 8)
    with pytest.raises(ValueError, match=message):
        kernel.prefill(query, keys, values, tables, lengths - 1, lengths * 0 + 1,
                       torch.arange(2, dtype=torch.int32), 1.0, out, window)  # fmt: skip
