"""The compiled residual add and RMSNorm: against transformers' arithmetic, in the decoder,
and refused or left out with a reason."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.models.test_llama import _config, make_tiny_model, random_sequences
from twostroke.engine.models import native_norm
from twostroke.engine.models.artifacts import CACHE_DIR_ENV
from twostroke.engine.models.llama import LlamaForCausalLM
from twostroke.engine.models.loader import load_model
from twostroke.engine.models.native import NATIVE_ENV, NativeBuildError
from twostroke.engine.models.native_norm import (
    RMSNormKernel,
    build_norm_kernel,
    reference_add_rms_norm,
    rms_norm_kernel,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")

#: Largest difference from the reference, relative to the output's largest magnitude: the
#: mean's sum runs in another order (float32), and may then round differently (bfloat16).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """Forget the kernels this process built, before and after (they are cached per shape)."""
    native_norm._kernel.cache_clear()
    yield
    native_norm._kernel.cache_clear()


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
def test_the_kernel_is_transformers_arithmetic_to_rounding(
    dtype: torch.dtype, hidden: int, count: int, with_delta: bool, seed: int
) -> None:
    kernel = build_norm_kernel(hidden=hidden, dtype=dtype)
    residual, delta, weight = rows(count, hidden, dtype, seed)
    total, expected = reference_add_rms_norm(residual, delta if with_delta else None, weight, 1e-6)
    got = kernel(residual, delta if with_delta else None, weight, 1e-6)
    assert got.dtype == dtype
    assert got.shape == (count, hidden)
    assert torch.equal(residual, total)  # the add is one rounding, as torch's
    assert_close_to(got, expected, dtype)


def test_a_delta_of_any_strides_is_read_right() -> None:
    kernel = build_norm_kernel(hidden=8, dtype=torch.float32)
    residual, delta, weight = rows(5, 8, torch.float32, seed=3)
    strided = delta.t().contiguous().t()
    expected = kernel(residual.clone(), delta, weight, 1e-5)
    assert torch.equal(kernel(residual.clone(), strided, weight, 1e-5), expected)


def test_tensors_the_kernel_was_not_built_for_are_refused() -> None:
    kernel = build_norm_kernel(hidden=8, dtype=torch.float32)
    residual, delta, weight = rows(4, 8, torch.float32, seed=4)
    with pytest.raises(ValueError, match=r"contiguous torch\.float32 residual \[rows, 8\]"):
        kernel(residual.bfloat16(), None, weight, 1e-5)
    with pytest.raises(ValueError, match=r"residual torch\.float32 \(4, 8\) \(contiguous: False\)"):
        kernel(residual.view(8, 4).t(), None, weight, 1e-5)  # the sum would be lost
    with pytest.raises(ValueError, match=r"delta \(torch\.float32, \(3, 8\)\)"):
        kernel(residual, delta[:3], weight, 1e-5)
    with pytest.raises(ValueError, match=r"weight torch\.float32 \(9,\)"):
        kernel(residual, None, torch.ones(9), 1e-5)
    assert torch.equal(residual, rows(4, 8, torch.float32, seed=4)[0])  # nothing written


def test_bad_sizes_and_element_types_are_rejected() -> None:
    with pytest.raises(ValueError, match="hidden must be >= 1, got 0"):
        build_norm_kernel(hidden=0, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"takes float32 or bfloat16, got torch\.float16"):
        build_norm_kernel(hidden=8, dtype=torch.float16)
    assert rms_norm_kernel(hidden=8, dtype=torch.float16) is None


def test_its_library_is_cached_beside_the_attention_kernels() -> None:
    first = build_norm_kernel(hidden=12, dtype=torch.bfloat16)
    assert first.path.parent == Path(os.environ[CACHE_DIR_ENV]) / "native"
    assert first.path.name.startswith("rms_norm-")
    assert build_norm_kernel(hidden=12, dtype=torch.bfloat16).path == first.path
    assert build_norm_kernel(hidden=12, dtype=torch.float32).path != first.path


def test_a_kernel_that_disagrees_with_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(native_norm._TOLERANCE, torch.float32, -1.0)  # nothing passes
    with pytest.raises(NativeBuildError, match=r"check differs from torch by .* torch\.float32"):
        build_norm_kernel(hidden=8, dtype=torch.float32)


def tiny_decoder(dtype: torch.dtype) -> LlamaForCausalLM:
    """A decoder without weights to run: enough for what fuse_norms decides."""
    return LlamaForCausalLM(_config(), dtype=dtype, device=CPU)


@pytest.mark.usefixtures("fresh_kernels")
def test_where_the_build_fails_the_decoder_keeps_torchs_norms_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=native_norm.__name__):
        assert not tiny_decoder(torch.float32).fuse_norms()
        assert not tiny_decoder(torch.float32).fuse_norms()
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per shape and process
    assert "/nonexistent/cc" in warnings[0].getMessage()
    assert "run as torch operators instead" in warnings[0].getMessage()


def test_which_decoders_fuse_their_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tiny_decoder(torch.float32).fuse_norms()
    assert tiny_decoder(torch.bfloat16).fuse_norms()
    assert not tiny_decoder(torch.float16).fuse_norms()  # no float16 build
    monkeypatch.setenv(NATIVE_ENV, "0")
    model = tiny_decoder(torch.float32)
    assert not model.fuse_norms()
    assert not model.fused_norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_compute_what_torchs_do_to_rounding(dtype: torch.dtype, tmp_path: Path) -> None:
    """Only ``exact=False`` fuses; its logits are the operators' to rounding, through prefill
    chunks and decodes, and so are its greedy tokens."""
    make_tiny_model("llama", tmp_path, seed=7)
    exact = load_model(tmp_path, dtype=dtype, device=CPU)
    fused = load_model(tmp_path, dtype=dtype, device=CPU, exact=False)
    assert not exact.module.fused_norms
    assert fused.module.fused_norms
    sequences = random_sequences([1, 5, 30], seed=8)
    unfused = load_model(tmp_path, dtype=dtype, device=CPU, exact=False)
    unfused.module._norm_kernel = None  # the same packed weights, torch's norms
    expected = unfused.module.forward_logits(sequences, chunk_size=4)
    got = fused.module.forward_logits(sequences, chunk_size=4)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
        if dtype == torch.float32:
            assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_kernel_holds_its_shape() -> None:
    kernel = build_norm_kernel(hidden=8, dtype=torch.bfloat16)
    assert isinstance(kernel, RMSNormKernel)
    assert (kernel.hidden, kernel.dtype) == (8, torch.bfloat16)
    assert "function" not in repr(kernel)
