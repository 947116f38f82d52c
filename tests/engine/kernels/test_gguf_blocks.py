"""The GGUF block products: every path this run's CPU personality allows against gguf's own
dequantization, the activations' quantization against llama.cpp's rule, the rows of an
embedding, and the refusals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from twostroke.engine.checkpoints.gguf import BLOCK_TYPES, BlockTensor
from twostroke.engine.kernels import gguf_blocks
from twostroke.engine.kernels.gguf_blocks import (
    ACTIVATIONS,
    BLOCK_BYTES,
    DENSE_ROWS,
    BlockKernel,
    block_weights,
    build_blocks,
    offset_magnitudes,
    random_blocks,
    rounding_bound,
)
from twostroke.engine.models.forms import BlockWeight
from twostroke.gpu.isa import ISA_ENV, RUNGS, cpu_personality

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

#: The rungs this run may build for: each one up to the personality's own.
ALLOWED = [rung.name for rung in RUNGS if rung.rank <= cpu_personality().rung.rank]

#: The K super-block types.
SUPER_TYPES = ["Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def kernels() -> dict[str, BlockKernel]:
    """One library per allowed rung, each built for that rung."""
    return {rung: build_blocks(environ={**_environ(), ISA_ENV: rung}) for rung in ALLOWED}


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_each_rung_builds_the_path_of_its_instruction_set(
    kernels: dict[str, BlockKernel],
) -> None:
    paths = {"portable": "portable", "avx2": "avx2", "avx512": "avx512"}
    for rung, kernel in kernels.items():
        assert kernel.isa == paths.get(rung, "avx512_vnni"), rung


def reference_quantize(x: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...]:
    """llama.cpp's Q8_0 rule for activations, in float32: scale max|x| / 127, ties to even;
    a block whose scale's inverse overflows float32 is zeros, its scale 0 (the kernel's
    rule where llama.cpp's conversion of the infinite quotients is undefined)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    with np.errstate(over="ignore"):
        inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0)
    scale = np.where(np.isfinite(inverse), scale, 0).astype(np.float32)
    inverse = np.where(np.isfinite(inverse), inverse, 0)
    q = np.rint(blocks * inverse.astype(np.float32)[..., None]).astype(np.int8)
    return q.reshape(x.shape), scale


def expected_product(
    kernel: BlockKernel, x: torch.Tensor, tensor: BlockTensor
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """gguf's dequantized weights times the activations the kernel takes (dequantized from
    their 8 bits, or themselves), in float64, and how far the kernel's product may be from it
    (:func:`rounding_bound` times the magnitudes of the terms it sums, a weight's scaled and
    offset terms apart)."""
    weights = dequantize(tensor.data, GGMLQuantizationType(tensor.block_type)).astype(np.float64)
    activations = x.double().numpy()
    if kernel.activations == "int8":
        activations = kernel.quantize(x).dequantized().double().numpy()
    terms = np.abs(weights) + 2 * offset_magnitudes(tensor.data, tensor.block_type)
    bound = rounding_bound(tensor.block_type, tensor.in_features, kernel.activations)
    return activations @ weights.T, bound * (np.abs(activations) @ terms.T)


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("rung", ALLOWED)
@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))  # every type on every path
@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(0, 37),  # one row, a few, several tiles of 4 and the last partial one
    out_features=st.integers(1, 45),  # groups of 4 weight rows and the last partial one
    blocks=st.integers(1, 9),  # the K types take 1 to 3 super-blocks of 256
    row_gap=st.integers(0, 3),  # rows of x further apart than its width
    permuted=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_products_equal_the_dequantized_reference(
    kernels: dict[str, BlockKernel],
    activations: str,
    rung: str,
    type_name: str,
    rows: int,
    out_features: int,
    blocks: int,
    row_gap: int,
    permuted: bool,
    seed: int,
) -> None:
    kernel = kernels[rung].taking(activations)
    generator = np.random.default_rng(seed)
    width = block_weights(BLOCK_TYPES[type_name])
    in_features = width * (blocks if width == 32 else 1 + blocks % 3)
    data = random_blocks(generator, BLOCK_TYPES[type_name], out_features, in_features)
    order = generator.permutation(out_features) if permuted else np.arange(out_features)
    columns = torch.from_numpy(order.astype(np.int32)) if permuted else None
    tensor = BlockTensor("w", BLOCK_TYPES[type_name], data, columns)
    wide = generator.normal(0, 1, (rows, in_features + row_gap)).astype(np.float32)
    x = torch.from_numpy(wide)[:, :in_features]
    got = BlockWeight(kernel, (tensor,))(x).double().numpy()
    expected, allowed = expected_product(kernel, x, tensor)
    inverse = np.argsort(order)
    expected, allowed = expected[:, inverse], allowed[:, inverse]
    assert got.shape == (rows, out_features)
    assert np.all(np.abs(got - expected) <= allowed + 1e-30)


def test_the_bound_is_the_rounding_and_a_wrong_weight_exceeds_it(
    kernels: dict[str, BlockKernel],
) -> None:
    """The bound is tight enough to see one weight's worth of difference: the products of
    blocks with one sub-block's scale changed fail it."""
    generator = np.random.default_rng(11)
    x = torch.from_numpy(generator.normal(0, 1, (3, 512)).astype(np.float32))
    for type_name in SUPER_TYPES:
        block_type = BLOCK_TYPES[type_name]
        data = random_blocks(generator, block_type, 8, 512)
        changed = data.copy()
        changed[:, 4 if type_name != "Q6_K" else 192] ^= 1  # a sub-block scale's lowest bit
        for kernel in (k.taking(a) for k in kernels.values() for a in ACTIVATIONS):
            got = BlockWeight(kernel, (BlockTensor("w", block_type, changed),))(x).double()
            expected, allowed = expected_product(kernel, x, BlockTensor("w", block_type, data))
            assert np.any(np.abs(got.numpy() - expected) > allowed), type_name


def test_offset_magnitudes_read_the_mins_as_gguf_does() -> None:
    generator = np.random.default_rng(4)
    for type_name in ("Q4_K", "Q5_K"):
        data = random_blocks(generator, BLOCK_TYPES[type_name], 3, 512)
        blocks = data.reshape(-1, BLOCK_BYTES[BLOCK_TYPES[type_name]])
        _, mins = Q4_K.get_scale_min(blocks[:, 4:16])
        dmin = np.abs(blocks[:, 2:4].copy().view(np.float16).astype(np.float64))
        expected = (dmin * mins).repeat(32, axis=1).reshape(3, 512)
        np.testing.assert_array_equal(offset_magnitudes(data, BLOCK_TYPES[type_name]), expected)
    q6 = random_blocks(generator, BLOCK_TYPES["Q6_K"], 2, 256)
    assert not offset_magnitudes(q6, BLOCK_TYPES["Q6_K"]).any()


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("rung", ALLOWED)
@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K"])
def test_many_rows_by_a_model_shaped_weight_split_across_threads(
    kernels: dict[str, BlockKernel], activations: str, rung: str, type_name: str
) -> None:
    """SmolLM2's down projection's shape at batch 33, two threads splitting the columns:
    the same products as one thread, bit for bit, and as the reference."""
    kernel = kernels[rung].taking(activations)
    generator = np.random.default_rng(3)
    block_type = BLOCK_TYPES[type_name]
    tensor = BlockTensor("down", block_type, random_blocks(generator, block_type, 576, 1536))
    x = torch.from_numpy(generator.normal(0, 1, (33, 1536)).astype(np.float32))
    weight = BlockWeight(kernel, (tensor,))
    alone = weight(x)
    from twostroke.gpu.threads import torch_threads

    with torch_threads(2):
        split = weight(x)
    assert torch.equal(split, alone)
    expected, allowed = expected_product(kernel, x, tensor)
    assert np.all(np.abs(alone.double().numpy() - expected) <= allowed)


@pytest.mark.parametrize("rung", ALLOWED)
@pytest.mark.parametrize("type_name", SUPER_TYPES)
def test_a_row_sums_alike_whatever_the_rows_beside_it(
    kernels: dict[str, BlockKernel], rung: str, type_name: str
) -> None:
    """A decode's one row, the same row in tiles of 2, 3 and 4 rows, and the same weight row
    among 1 to 4 weight rows of a tile: the same products, bit for bit (the AVX-512 path
    takes sub-blocks in pairs; a row that summed another way alone than among others
    changed greedy answers with the traffic)."""
    kernel = kernels[rung]
    generator = np.random.default_rng(8)
    block_type = BLOCK_TYPES[type_name]
    data = random_blocks(generator, block_type, 7, 768)  # tiles of 4 weight rows, then 3
    x = torch.from_numpy(generator.normal(0, 1, (11, 768)).astype(np.float32))
    weight = BlockWeight(kernel, (BlockTensor("w", block_type, data),))
    together = weight(x)
    alone = torch.cat([weight(x[i : i + 1]) for i in range(11)])
    assert torch.equal(together, alone)
    for rows in (2, 3):
        assert torch.equal(weight(x[:rows]), together[:rows])
    for first in range(7):  # each weight row in a group of 1 to 4 rows
        part = BlockWeight(kernel, (BlockTensor("w", block_type, data[first:]),))
        assert torch.equal(part(x), together[:, first:])


@pytest.mark.parametrize("rung", ALLOWED)
@settings(max_examples=10, deadline=None)
@given(
    types=st.lists(st.sampled_from(sorted(BLOCK_TYPES)), min_size=1, max_size=3),
    rows=st.integers(DENSE_ROWS, DENSE_ROWS + 70),
    out_features=st.integers(1, 40),
    permuted=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_many_rows_multiply_the_dequantized_weight_in_float32(
    kernels: dict[str, BlockKernel],
    rung: str,
    types: list[str],
    rows: int,
    out_features: int,
    permuted: bool,
    seed: int,
) -> None:
    """From DENSE_ROWS rows on, a product is the file's weights (gguf's dequantization) times
    the activations themselves, not their 8-bit rounding: float32 GEMM rounding of the
    float64 product, for fused parts of mixed types, permuted columns and a bias."""
    kernel = kernels[rung]
    generator = np.random.default_rng(seed)
    in_features = 512  # every type's blocks tile it
    tensors, dense = [], []
    for name in types:
        block_type = BLOCK_TYPES[name]
        data = random_blocks(generator, block_type, out_features, in_features)
        order = generator.permutation(out_features) if permuted else np.arange(out_features)
        columns = torch.from_numpy(order.astype(np.int32)) if permuted else None
        tensors.append(BlockTensor(name, block_type, data, columns))
        weights = dequantize(data, GGMLQuantizationType(block_type)).astype(np.float64)
        dense.append(weights[np.argsort(order)])
    bias = torch.from_numpy(generator.normal(0, 1, out_features * len(types)).astype(np.float32))
    x = torch.from_numpy(generator.normal(0, 1, (rows, in_features)).astype(np.float32))
    got = BlockWeight(kernel, tuple(tensors), bias)(x).double().numpy()
    w = np.concatenate(dense)
    xs = x.double().numpy()
    expected = xs @ w.T + bias.double().numpy()
    # Float32 sums of in_features products (and gguf's float32 weights, to 1e-6).
    allowed = (in_features * 2.0**-23 + 2e-6) * (np.abs(xs) @ np.abs(w).T) + 1e-6
    assert np.all(np.abs(got - expected) <= allowed)
    # Below DENSE_ROWS the same weight's products take the 8-bit activations: another sum.
    fewer = BlockWeight(kernel, tuple(tensors))(x[: DENSE_ROWS - 1]).double().numpy()
    assert not np.allclose(fewer, got[: DENSE_ROWS - 1] - bias.double().numpy(), rtol=1e-6)
    # With float32 activations they are the same products, to float32 rounding.
    exact = BlockWeight(kernel.taking("float32"), tuple(tensors))(x[: DENSE_ROWS - 1])
    expected = expected[: DENSE_ROWS - 1] - bias.double().numpy()
    assert np.all(np.abs(exact.double().numpy() - expected) <= allowed[: DENSE_ROWS - 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dense_path_takes_a_large_weight_a_slice_of_rows_at_a_time(
    kernels: dict[str, BlockKernel], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """A weight of more than DENSE_ELEMENTS weights is dequantized and multiplied a slice of
    its rows at a time (slices across the parts' seams here), giving the whole product: the
    file's weights times the rows, in ``dtype`` as torch's GEMM computes it."""
    kernel = kernels[ALLOWED[-1]].densely(dtype)
    generator = np.random.default_rng(11)
    in_features = 256
    tensors, dense = [], []
    for name, out_features in (("Q4_K", 40), ("Q8_0", 24)):
        data = random_blocks(generator, BLOCK_TYPES[name], out_features, in_features)
        tensors.append(BlockTensor(name, BLOCK_TYPES[name], data))
        kind = GGMLQuantizationType(BLOCK_TYPES[name])
        dense.append(torch.from_numpy(dequantize(data, kind).astype(np.float32)))
    x = torch.from_numpy(generator.normal(0, 1, (DENSE_ROWS + 3, in_features)).astype(np.float32))
    expected = torch.mm(x.to(dtype), torch.cat(dense).to(dtype).t()).float()
    whole = BlockWeight(kernel, tuple(tensors))(x)
    monkeypatch.setattr(gguf_blocks, "DENSE_ELEMENTS", 7 * in_features)  # slices of 7 rows
    sliced = BlockWeight(kernel, tuple(tensors))(x)
    # The same sums, each of in_features products, maybe blocked otherwise by the GEMM:
    # float32 rounding of them, then the result's own rounding to dtype.
    eps = torch.finfo(dtype).eps
    scale = x.abs() @ torch.cat(dense).abs().t()
    bound = (in_features * 2.0**-23 + eps) * scale + 1e-6
    for got in (whole, sliced):
        assert torch.all((got - expected).abs() <= bound)


@given(
    x=st.lists(
        st.floats(-1e4, 1e4, allow_nan=False, width=32)
        | st.sampled_from([0.0, 0.5, -0.5, 1.5, 2.5, 1e-30, 1e-40, -1e-45]),
        min_size=64,
        max_size=64,
    ),
    rung=st.sampled_from(ALLOWED),
)
@settings(max_examples=60, deadline=None)
def test_activations_quantize_as_llama_cpp_rounds_them(
    kernels: dict[str, BlockKernel], x: list[float], rung: str
) -> None:
    values = np.array(x, dtype=np.float32).reshape(2, 32)
    quantized = kernels[rung].quantize(torch.from_numpy(values))
    q, scale = reference_quantize(values)
    np.testing.assert_array_equal(quantized.q.numpy(), q)
    np.testing.assert_array_equal(quantized.scales.numpy(), scale.reshape(2, 1))
    sums = scale.reshape(2) * q.astype(np.int32).sum(-1).astype(np.float32)
    np.testing.assert_array_equal(quantized.sums.numpy().reshape(2), sums)


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_rows_are_dequantized_as_gguf_does(kernels: dict[str, BlockKernel], type_name: str) -> None:
    generator = np.random.default_rng(5)
    width = 3 * block_weights(BLOCK_TYPES[type_name])
    data = random_blocks(generator, BLOCK_TYPES[type_name], 50, width)
    tensor = BlockTensor("token_embd.weight", BLOCK_TYPES[type_name], data)
    ids = torch.tensor([[3, 49], [0, 3]])
    expected = dequantize(data, GGMLQuantizationType(BLOCK_TYPES[type_name]))[ids.numpy()]
    for kernel in kernels.values():
        got = kernel.rows(tensor, ids)
        assert got.shape == (2, 2, width)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-7)


def test_rows_out_of_range_are_refused(kernels: dict[str, BlockKernel]) -> None:
    tensor = BlockTensor("e", 8, random_blocks(np.random.default_rng(0), 8, 4, 32))
    kernel = next(iter(kernels.values()))
    with pytest.raises(IndexError, match=r"e: row ids must be in \[0, 4\)"):
        kernel.rows(tensor, torch.tensor([4]))


@pytest.mark.parametrize(
    ("types", "width"), [(("Q4_1", "Q8_0"), 64), (("Q4_K", "Q5_K", "Q6_K", "Q8_0"), 256)]
)
def test_fused_parts_bias_and_leading_dimensions(
    kernels: dict[str, BlockKernel], types: tuple[str, ...], width: int
) -> None:
    """Parts of several types side by side (a Q4_K_M file's q/k/v mixes Q4_K and Q6_K)."""
    generator = np.random.default_rng(7)
    kernel = next(iter(kernels.values()))
    sizes = (10, 6, 3, 5)[: len(types)]
    parts = tuple(
        BlockTensor(
            f"part{i}", BLOCK_TYPES[name], random_blocks(generator, BLOCK_TYPES[name], n, width)
        )
        for i, (name, n) in enumerate(zip(types, sizes, strict=True))
    )
    bias = torch.randn(sum(sizes))
    weight = BlockWeight(kernel, parts, bias)
    x = torch.randn(2, 3, width)
    got = weight(x)
    assert got.shape == (2, 3, sum(sizes))
    flat = x.reshape(6, width)
    starts = np.cumsum((0, *sizes[:-1]))
    for part, start in zip(parts, starts, strict=True):
        alone = BlockWeight(kernel, (part,))(flat)
        # The same products, the bias added once (bit for bit: one call computes each part
        # as a call of its own would).
        expected = alone + bias[start : start + part.out_features]
        assert torch.equal(got.reshape(6, -1)[:, start : start + part.out_features], expected)


def test_bad_blocks_and_inputs_are_refused(kernels: dict[str, BlockKernel]) -> None:
    kernel = next(iter(kernels.values()))
    data = random_blocks(np.random.default_rng(0), 3, 4, 64)
    with pytest.raises(ValueError, match=r"w: block type 10 is not one of"):
        BlockTensor("w", 10, data)
    with pytest.raises(ValueError, match=r"w: blocks must be uint8 \[rows, a multiple of 34"):
        BlockTensor("w", 8, data)
    with pytest.raises(ValueError, match=r"w: columns must be int32 \[4\]"):
        BlockTensor("w", 3, data, torch.arange(4))
    weight = BlockWeight(kernel, (BlockTensor("w", 3, data),))
    with pytest.raises(ValueError, match=r"block products take float32 rows"):
        weight(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"the parts of a projection differ in width"):
        BlockWeight(
            kernel,
            (BlockTensor("a", 3, data), BlockTensor("b", 3, np.ascontiguousarray(data[:, :20]))),
        )
