"""The GGUF block products: every path this run's CPU personality allows against gguf's own
dequantization, the activations' quantization against llama.cpp's rule, the rows of an
embedding, and the refusals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from twostroke.engine.kernels.gguf_blocks import (
    BLOCK_TYPES,
    BlockKernel,
    BlockTensor,
    BlockWeight,
    build_blocks,
    random_blocks,
)
from twostroke.gpu.isa import ISA_ENV, RUNGS, cpu_personality

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

#: The rungs this run may build for: each one up to the personality's own.
ALLOWED = [rung.name for rung in RUNGS if rung.rank <= cpu_personality().rung.rank]

#: Largest difference from the float64 product of the dequantized operands, relative to the
#: sum of the products' magnitudes: float32 rounding of per-block sums (and of gguf's own
#: float32 dequantization of Q4_1's d q + m).
TOLERANCE = 1e-5


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
    for rung, kernel in kernels.items():
        assert kernel.avx2 == (rung != "portable"), rung


def reference_quantize(x: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...]:
    """llama.cpp's Q8_0 rule for activations, in float32: scale max|x| / 127, ties to even."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0)
    q = np.rint(blocks * inverse.astype(np.float32)[..., None]).astype(np.int8)
    return q.reshape(x.shape), scale


def expected_product(
    kernel: BlockKernel, x: torch.Tensor, tensor: BlockTensor
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """gguf's dequantized weights times the dequantized activations, in float64, and the
    sum of the products' magnitudes."""
    weights = dequantize(tensor.data, GGMLQuantizationType(tensor.block_type)).astype(np.float64)
    activations = kernel.quantize(x).dequantized().double().numpy()
    products = activations[:, None, :] * weights[None, :, :]
    return products.sum(-1), np.abs(products).sum(-1)


@settings(max_examples=40, deadline=None)
@given(
    rung=st.sampled_from(ALLOWED),
    type_name=st.sampled_from(sorted(BLOCK_TYPES)),
    rows=st.integers(0, 37),  # one row, a few, several tiles of 4 and the last partial one
    out_features=st.integers(1, 45),
    blocks=st.integers(1, 9),
    row_gap=st.integers(0, 3),  # rows of x further apart than its width
    permuted=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_products_equal_the_dequantized_reference(
    kernels: dict[str, BlockKernel],
    rung: str,
    type_name: str,
    rows: int,
    out_features: int,
    blocks: int,
    row_gap: int,
    permuted: bool,
    seed: int,
) -> None:
    kernel = kernels[rung]
    generator = np.random.default_rng(seed)
    in_features = 32 * blocks
    data = random_blocks(generator, BLOCK_TYPES[type_name], out_features, in_features)
    order = generator.permutation(out_features) if permuted else np.arange(out_features)
    columns = torch.from_numpy(order.astype(np.int32)) if permuted else None
    tensor = BlockTensor("w", BLOCK_TYPES[type_name], data, columns)
    wide = generator.normal(0, 1, (rows, in_features + row_gap)).astype(np.float32)
    x = torch.from_numpy(wide)[:, :in_features]
    got = BlockWeight(kernel, (tensor,))(x).double().numpy()
    expected, magnitude = expected_product(kernel, x, tensor)
    inverse = np.argsort(order)
    expected, magnitude = expected[:, inverse], magnitude[:, inverse]
    assert got.shape == (rows, out_features)
    assert np.all(np.abs(got - expected) <= TOLERANCE * magnitude + 1e-30)


@pytest.mark.parametrize("rung", ALLOWED)
def test_many_rows_by_a_model_shaped_weight_split_across_threads(
    kernels: dict[str, BlockKernel], rung: str
) -> None:
    """SmolLM2's down projection's shape at batch 33, two threads splitting the columns:
    the same products as one thread, bit for bit, and as the reference."""
    kernel = kernels[rung]
    generator = np.random.default_rng(3)
    tensor = BlockTensor("down", BLOCK_TYPES["Q4_1"], random_blocks(generator, 3, 576, 1536))
    x = torch.from_numpy(generator.normal(0, 1, (33, 1536)).astype(np.float32))
    weight = BlockWeight(kernel, (tensor,))
    alone = weight(x)
    from twostroke.gpu.threads import torch_threads

    with torch_threads(2):
        split = weight(x)
    assert torch.equal(split, alone)
    expected, magnitude = expected_product(kernel, x, tensor)
    assert np.all(np.abs(alone.double().numpy() - expected) <= TOLERANCE * magnitude)


@given(
    x=st.lists(
        st.floats(-1e4, 1e4, allow_nan=False, width=32)
        | st.sampled_from([0.0, 0.5, -0.5, 1.5, 2.5, 1e-30]),
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
    data = random_blocks(generator, BLOCK_TYPES[type_name], 50, 96)
    tensor = BlockTensor("token_embd.weight", BLOCK_TYPES[type_name], data)
    ids = torch.tensor([[3, 49], [0, 3]])
    expected = dequantize(data, GGMLQuantizationType(BLOCK_TYPES[type_name]))[ids.numpy()]
    for kernel in kernels.values():
        got = kernel.rows(tensor, ids)
        assert got.shape == (2, 2, 96)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-7)


def test_rows_out_of_range_are_refused(kernels: dict[str, BlockKernel]) -> None:
    tensor = BlockTensor("e", 8, random_blocks(np.random.default_rng(0), 8, 4, 32))
    kernel = next(iter(kernels.values()))
    with pytest.raises(IndexError, match=r"e: row ids must be in \[0, 4\)"):
        kernel.rows(tensor, torch.tensor([4]))


def test_fused_parts_bias_and_leading_dimensions(kernels: dict[str, BlockKernel]) -> None:
    generator = np.random.default_rng(7)
    kernel = next(iter(kernels.values()))
    parts = (
        BlockTensor("q", 3, random_blocks(generator, 3, 10, 64)),
        BlockTensor("k", 8, random_blocks(generator, 8, 6, 64)),
    )
    bias = torch.randn(16)
    weight = BlockWeight(kernel, parts, bias)
    x = torch.randn(2, 3, 64)
    got = weight(x)
    assert got.shape == (2, 3, 16)
    flat = x.reshape(6, 64)
    for part, start in zip(parts, (0, 10), strict=True):
        alone = BlockWeight(kernel, (part,))(flat)
        # The same products, the bias added once (bit for bit: one call computes each part
        # as a call of its own would).
        expected = alone + bias[start : start + part.out_features]
        assert torch.equal(got.reshape(6, 16)[:, start : start + part.out_features], expected)


def test_bad_blocks_and_inputs_are_refused(kernels: dict[str, BlockKernel]) -> None:
    kernel = next(iter(kernels.values()))
    data = random_blocks(np.random.default_rng(0), 3, 4, 64)
    with pytest.raises(ValueError, match=r"w: block type 12 is not one of"):
        BlockTensor("w", 12, data)
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
