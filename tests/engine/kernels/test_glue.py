"""The decoder's compiled glue (norms, rotary embeddings with the cache write, SiLU times up):
against torch's arithmetic, in the decoder, and refused or left out with a reason."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.models.test_llama import _config, make_tiny_model, random_sequences
from twostroke.engine.artifacts.cache import CACHE_DIR_ENV
from twostroke.engine.attention.kernels import AttentionKernel
from twostroke.engine.attention.kv_cache import KVCache
from twostroke.engine.attention.metadata import AttentionMetadata, ChunkSpec
from twostroke.engine.attention.ops import write_kv
from twostroke.engine.kernels import glue as glue_module
from twostroke.engine.kernels.build import NATIVE_ENV, NativeBuildError
from twostroke.engine.kernels.glue import (
    DecoderGlue,
    build_glue,
    decoder_glue,
    reference_add_rms_norm,
)
from twostroke.engine.kernels.reference import rms_norm, rotate_, silu_mul
from twostroke.engine.models.choice import select_kernels
from twostroke.engine.models.glue import CompiledGlue
from twostroke.engine.models.layers import Glue, TorchGlue, rotary_tables
from twostroke.engine.models.loading import open_model
from twostroke.engine.runners.sampler import Sampler
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.states.params import SamplingParams

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")

#: Largest difference from the reference, relative to the output's largest magnitude: the
#: norm's mean is summed in another order and SiLU's exp is a polynomial (float32), and a
#: result may then round differently (bfloat16).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """Forget the kernels this process built, before and after (they are cached per shape)."""
    glue_module._glue.cache_clear()
    yield
    glue_module._glue.cache_clear()


def rows(count: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    residual = (3 * torch.randn(count, hidden, generator=generator)).to(dtype)
    delta = torch.randn(count, hidden, generator=generator).to(dtype)
    weight = (1 + torch.randn(hidden, generator=generator) / 4).to(dtype)
    return residual, delta, weight


def assert_close_to(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(expected.float().abs().max())
    assert float((got.float() - expected.float()).abs().max()) <= TOLERANCE[dtype] * scale


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    hidden=st.sampled_from([1, 7, 64, 576]),
    count=st.integers(1, 140),  # 64 rows and more run on the thread team
    with_delta=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_norm_is_transformers_arithmetic_to_rounding(
    dtype: torch.dtype, hidden: int, count: int, with_delta: bool, seed: int
) -> None:
    glue = build_glue(hidden=hidden, head_dim=8, dtype=dtype)
    residual, delta, weight = rows(count, hidden, dtype, seed)
    total, expected = reference_add_rms_norm(residual, delta if with_delta else None, weight, 1e-6)
    got = glue.add_rms_norm(residual, delta if with_delta else None, weight, 1e-6)
    assert got.dtype == dtype
    assert got.shape == (count, hidden)
    assert torch.equal(residual, total)  # the add is one rounding, as torch's
    assert_close_to(got, expected, dtype)


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    width=st.integers(1, 200),
    count=st.integers(1, 140),
    padding=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_silu_times_up_is_torchs_to_rounding(
    dtype: torch.dtype, width: int, count: int, padding: int, seed: int
) -> None:
    """Rows of any stride (a view of a wider projection), gates from -30 to 30."""
    glue = build_glue(hidden=8, head_dim=8, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    wide = (10 * torch.randn(count, 2 * width + padding, generator=generator)).to(dtype)
    gate_up = wide[:, : 2 * width]
    got = glue.silu_mul(gate_up)
    assert got.shape == (count, width)
    assert_close_to(got, silu_mul(gate_up), dtype)


def written(
    glue: Glue | None,
    dtype: torch.dtype,
    chunks: list[ChunkSpec],
    heads: int,
    kv_heads: int,
    seed: int,
    kernel: AttentionKernel = "bag",
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's q/k/v rows after rotation and the layer's cache (laid out for ``kernel``,
    in ``cache_dtype``, ``None``: ``dtype``) after the write, through ``glue`` or, with
    ``None``, torch's operators."""
    dim, block_size, num_blocks = 8, 4, 24
    metadata = AttentionMetadata.build(
        chunks,
        block_size=block_size,
        num_blocks=num_blocks,
        num_kv_heads=kv_heads,
        dtype=dtype,
        device=CPU,
        kernel=kernel,
        num_heads=heads,
        head_dim=dim,
    )
    tokens = metadata.num_tokens
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = rotary_tables(metadata.positions, inv_freq, dtype)
    shape = {"num_blocks": num_blocks, "block_size": block_size, "num_kv_heads": kv_heads}
    cached = dtype if cache_dtype is None else cache_dtype
    layer = KVCache.allocate(num_layers=1, head_dim=dim, dtype=cached, device=CPU, **shape)
    cache = layer.layers[0]
    if glue is None:
        rotate_(qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
        write_kv(cache, qkv[:, heads * dim :].view(tokens, 2, kv_heads, dim), metadata)
    else:
        glue.rotate_write(qkv, heads, kv_heads, cos, sin, metadata, cache)
    return qkv, cache.data


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    heads_per_kv=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    lengths=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 70)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    kernel=st.sampled_from(["bag", "matmul"]),
    cache_dtype=st.sampled_from([None, torch.float32, torch.float16, torch.bfloat16]),
)
def test_the_rotary_write_is_the_models_bit_for_bit(
    dtype: torch.dtype,
    heads_per_kv: int,
    kv_heads: int,
    lengths: list[tuple[int, int]],
    seed: int,
    kernel: AttentionKernel,
    cache_dtype: torch.dtype | None,
) -> None:
    """Decodes and chunks at any positions (64 tokens and more run on the thread team),
    shuffled blocks: the rotated queries and keys and every slot of the cache, written or
    not, equal the operators' (``rotate_``, then ``write_kv``), through the compiled glue
    and through torch's, into keys held transposed (the compiled write) or not (the
    gathering kernels' layout, which the compiled glue leaves to torch's operators), and
    into a cache of any dtype (``kv_cache_dtype``: each key and value rounded once, as
    ``.to`` rounds)."""
    glue = build_glue(hidden=8, head_dim=8, dtype=dtype, cache_dtype=cache_dtype)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(seed)).tolist()
    chunks: list[ChunkSpec] = []
    used = 0
    for start, count in sorted(lengths, key=lambda item: item[1] != 1):  # decodes first
        width = -(-(start + count) // 4)
        if used + width <= 24:
            chunks.append(ChunkSpec(start, count, tuple(order[used : used + width])))
            used += width
    if not chunks:
        chunks = [ChunkSpec(0, 1, (order[0],))]
    heads = heads_per_kv * kv_heads
    theirs = written(None, dtype, chunks, heads, kv_heads, seed, kernel, cache_dtype)
    for each in (CompiledGlue(glue), TorchGlue()):
        ours = written(each, dtype, chunks, heads, kv_heads, seed, kernel, cache_dtype)
        assert torch.equal(ours[0], theirs[0])
        assert torch.equal(ours[1], theirs[1])


def test_tensors_the_glue_was_not_built_for_are_refused() -> None:
    glue = build_glue(hidden=8, head_dim=4, dtype=torch.float32)
    residual, delta, weight = rows(4, 8, torch.float32, seed=4)
    with pytest.raises(ValueError, match=r"contiguous torch\.float32 residual \[rows, 8\]"):
        glue.add_rms_norm(residual.bfloat16(), None, weight, 1e-5)
    with pytest.raises(ValueError, match=r"residual torch\.float32 \(4, 8\) \(contiguous: False\)"):
        glue.add_rms_norm(residual.view(8, 4).t(), None, weight, 1e-5)  # the sum would be lost
    with pytest.raises(ValueError, match=r"delta \(torch\.float32, \(3, 8\)\)"):
        glue.add_rms_norm(residual, delta[:3], weight, 1e-5)
    with pytest.raises(ValueError, match=r"weight torch\.float32 \(9,\)"):
        glue.add_rms_norm(residual, None, torch.ones(9), 1e-5)
    assert torch.equal(residual, rows(4, 8, torch.float32, seed=4)[0])  # nothing written
    with pytest.raises(ValueError, match=r"\[rows, 2 \* width\] .* got torch\.float32 \(3, 5\)"):
        glue.silu_mul(torch.ones(3, 5))
    with pytest.raises(ValueError, match=r"unit stride along a row; got .* strides \(1, 3\)"):
        glue.silu_mul(torch.ones(4, 3).t())
    qkv, cos, sin = torch.ones(2, 16), torch.ones(2, 1, 4), torch.ones(2, 1, 4)
    cache = torch.zeros(2, 3, 1, 4, 4)
    slots = torch.tensor([0, 5])
    with pytest.raises(
        ValueError, match=r"qkv \[tokens, 16\] .* int64 slots .* slots torch\.int32"
    ):
        glue.rotate_write_slots(qkv, 2, 1, cos, sin, slots.int(), cache)
    with pytest.raises(
        ValueError, match=r"cache \[2, blocks, 1, block_size, 4\]; .* \(2, 3, 2, 4, 2\)"
    ):
        glue.rotate_write_slots(qkv, 2, 1, cos, sin, slots, torch.zeros(2, 3, 2, 4, 2))
    with pytest.raises(ValueError, match=r"got qkv torch\.float32 \(2, 12\)"):
        glue.rotate_write_slots(qkv[:, :12], 2, 1, cos, sin, slots, cache)
    assert not cache.any()


def test_bad_sizes_and_element_types_are_rejected() -> None:
    with pytest.raises(ValueError, match="hidden must be >= 1, got 0"):
        build_glue(hidden=0, head_dim=8, dtype=torch.float32)
    with pytest.raises(
        ValueError, match=r"head_dim must be even and >= 2 \(rotary halves\), got 7"
    ):
        build_glue(hidden=8, head_dim=7, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"takes float32 or bfloat16, got torch\.float16"):
        build_glue(hidden=8, head_dim=8, dtype=torch.float16)
    assert decoder_glue(hidden=8, head_dim=8, dtype=torch.float16) is None
    with pytest.raises(
        ValueError, match=r"KV cache in float32, float16 or bfloat16, got torch\.int8"
    ):
        build_glue(hidden=8, head_dim=8, dtype=torch.float32, cache_dtype=torch.int8)
    assert decoder_glue(hidden=8, head_dim=8, dtype=torch.float32, cache_dtype=torch.int8) is None


def test_its_library_is_cached_beside_the_attention_kernels() -> None:
    first = build_glue(hidden=12, head_dim=4, dtype=torch.bfloat16)
    assert first.path.parent.parent == Path(os.environ[CACHE_DIR_ENV]) / "native"
    assert first.path.name.startswith("decoder_glue-")
    assert build_glue(hidden=12, head_dim=4, dtype=torch.bfloat16).path == first.path
    assert build_glue(hidden=12, head_dim=4, dtype=torch.float32).path != first.path
    assert "library" not in repr(first)


def test_a_glue_that_disagrees_with_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(glue_module._TOLERANCE, torch.float32, -1.0)  # nothing passes
    with pytest.raises(NativeBuildError, match=r"check differs from torch by .* torch\.float32"):
        build_glue(hidden=8, head_dim=8, dtype=torch.float32)


def chosen_glue(dtype: torch.dtype, *, exact: bool = False) -> DecoderGlue | None:
    """The compiled glue chosen for the tiny model's shape, or ``None`` where torch's is
    (the attention is not built: it is given)."""
    kernels = select_kernels(_config(), dtype=dtype, device=CPU, exact=exact, attention="bag")
    if isinstance(kernels.glue, CompiledGlue):
        return kernels.glue.library
    assert isinstance(kernels.glue, TorchGlue)
    return None


@pytest.mark.usefixtures("fresh_kernels")
def test_where_the_build_fails_the_decoder_keeps_torchs_operators_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=glue_module.__name__):
        assert chosen_glue(torch.float32) is None
        assert chosen_glue(torch.float32) is None
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per shape and process
    assert "/nonexistent/cc" in warnings[0].getMessage()
    assert "run as torch operators instead" in warnings[0].getMessage()


def test_which_decoders_compile_their_glue(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chosen_glue(torch.float32) is not None
    assert chosen_glue(torch.bfloat16) is not None
    assert chosen_glue(torch.float16) is None  # no float16 build
    assert chosen_glue(torch.float32, exact=True) is None  # transformers' arithmetic
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert chosen_glue(torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_glue_computes_what_torchs_operators_do_to_rounding(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    """Only ``exact=False`` compiles it; its logits are the operators' to rounding, through
    prefill chunks and decodes, and so are its greedy tokens."""
    make_tiny_model("llama", tmp_path, seed=7)
    exact = open_model(tmp_path, dtype=dtype, device=CPU)
    fused = open_model(tmp_path, dtype=dtype, device=CPU, exact=False)
    assert isinstance(exact.module.kernels.glue, TorchGlue)
    assert isinstance(fused.module.kernels.glue, CompiledGlue)
    sequences = random_sequences([1, 5, 30], seed=8)
    operators = open_model(tmp_path, dtype=dtype, device=CPU, exact=False)
    # The same packed weights, torch's operators.
    operators.module._kernels = attrs.evolve(operators.module.kernels, glue=TorchGlue(), stack=None)
    expected = operators.module.forward_logits(sequences, chunk_size=4)
    got = fused.module.forward_logits(sequences, chunk_size=4)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
        if dtype == torch.float32:
            assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(0, 40),
    cols=st.integers(1, 3000),
    specials=st.lists(
        st.tuples(
            st.integers(0, 39),
            st.integers(0, 2999),
            st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 5.0]),
        ),
        max_size=12,
    ),
    seed=st.integers(0, 2**16),
)
def test_argmax_is_torchs(
    rows: int, cols: int, specials: list[tuple[int, int, float]], seed: int
) -> None:
    """Ties (values drawn from a few), NaN, infinities and signed zeros anywhere: the
    compiled argmax picks the index torch.argmax picks."""
    glue = build_glue(hidden=8, head_dim=8, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (rows, cols), generator=generator).float()
    for row, col, value in specials:
        if row < rows and col < cols:
            logits[row, col] = value
    assert torch.equal(glue.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(glue.argmax(logits.t().contiguous().t()), logits.argmax(dim=-1))
    with pytest.raises(ValueError, match=r"argmax takes float32 \[rows, cols >= 1\]"):
        glue.argmax(logits.double())


def test_the_cpu_runners_sampler_takes_the_compiled_argmax(tmp_path: Path) -> None:
    """Greedy rows through the sampler with the compiled argmax: torch's tokens (ties
    included); the runner hands it over only where the glue is compiled."""
    make_tiny_model("llama", tmp_path, seed=9)
    fused = TorchModelRunner.from_loaded(open_model(tmp_path, device=CPU, exact=False))
    exact = TorchModelRunner.from_loaded(open_model(tmp_path, device=CPU))
    glue = fused.kernels.glue
    assert isinstance(glue, CompiledGlue)
    assert fused._sampler._argmax == glue.argmax
    assert isinstance(exact.kernels.glue, TorchGlue)
    assert exact._sampler._argmax == exact.kernels.glue.argmax  # torch's
    logits = torch.randint(-2, 3, (6, 40)).float()
    greedy = [SamplingParams(temperature=0.0)] * 6
    compiled = Sampler(40, CPU, argmax=glue.argmax)
    plain = Sampler(40, CPU)
    ours = compiled.sample(logits, compiled.prepare(greedy, [0] * 6)).sampled
    assert torch.equal(ours, plain.sample(logits, plain.prepare(greedy, [0] * 6)).sampled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchs_glue_is_the_operators_bit_for_bit(dtype: torch.dtype) -> None:
    """The glue a decoder runs where the compiled one is not chosen (``exact=True`` among
    them): the residual added in place, the norm, SiLU times up and the argmax are
    transformers' arithmetic, to the bit."""
    glue = TorchGlue()
    residual, delta, weight = rows(7, 24, dtype, seed=5)
    total, expected = reference_add_rms_norm(residual, delta, weight, 1e-5)
    normed = glue.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(normed, expected)
    assert torch.equal(residual, total)  # the sum, in place
    assert torch.equal(
        glue.add_rms_norm(residual, None, weight, 1e-5), rms_norm(total, weight, 1e-5)
    )
    assert torch.equal(residual, total)  # nothing added
    gate_up = rows(5, 48, dtype, seed=6)[0]
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(glue.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    logits = torch.randint(-2, 3, (4, 9)).float()
    assert torch.equal(glue.argmax(logits), logits.argmax(dim=-1))
