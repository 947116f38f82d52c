"""resolve_dtype: the dtype names, and bfloat16 on a CPU without native bf16 (warned, honoured)."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from twostroke.engine.models import plan as plan_module
from twostroke.engine.models.plan import EmulatedBFloat16Warning, resolve_dtype
from twostroke.engine.runners import loading
from twostroke.gpu import dtype as dtype_module
from twostroke.gpu.device import CpuDevice
from twostroke.gpu.fake import FakeDevice
from twostroke.gpu.isa import cpu_personality

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = pytest.mark.isa

#: A stand-in for the tokenizer of a model that has none (load_runner asks its size only).
NO_TOKENS = SimpleNamespace(vocab_size=0)


@pytest.fixture(params=[True, False], ids=["native-bf16", "no-native-bf16"])
def native_bf16(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    native: bool = request.param
    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: native)
    return native


def test_bfloat16_without_native_support_warns_with_its_cost_and_runs() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: False)
        capability = torch.backends.cpu.get_cpu_capability()
        message = plan_module.EMULATED_BF16_MESSAGE.format(capability=capability)
        with pytest.warns(EmulatedBFloat16Warning, match=f"^{re.escape(message)}$"):
            assert resolve_dtype("bfloat16", CpuDevice()) == torch.bfloat16
    assert "4.4x slower than float32" in message
    assert issubclass(EmulatedBFloat16Warning, UserWarning)


def test_auto_and_the_other_names_never_warn(native_bf16: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = torch.bfloat16 if native_bf16 else torch.float32
        assert resolve_dtype("auto", CpuDevice()) == expected
        assert resolve_dtype("float32", CpuDevice()) == torch.float32
        assert resolve_dtype("float16", CpuDevice()) == torch.float16
        # The fake device is no CPU whose instructions matter: bfloat16 there is silent.
        assert resolve_dtype("bfloat16", FakeDevice()) == torch.bfloat16
        if native_bf16:
            assert resolve_dtype("bfloat16", CpuDevice()) == torch.bfloat16


def test_unknown_names_are_refused() -> None:
    message = "dtype must be 'auto' or one of 'float32', 'bfloat16', 'float16', got 'fp8'"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolve_dtype("fp8", CpuDevice())


def test_the_default_thread_count_is_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [loading.default_torch_threads(cores) for cores in (1, 2, 3, 8)] == [1, 2, 3, 8]
    # The cores this process may run on (taskset, a container's cpuset), where there is an
    # affinity; else all of them.
    assert loading.default_torch_threads() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert loading.default_torch_threads() == 5
    with pytest.raises(ValueError, match=r"^cores must be >= 1, got 0$"):
        loading.default_torch_threads(0)
    with pytest.raises(TypeError, match=r"^cores must be an int, got float 2\.0$"):
        loading.default_torch_threads(2.0)  # type: ignore[arg-type]


def test_auto_quantization_is_fp16_weights_only_with_auto_float32_on_a_cpu(
    native_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The measured policy (docs/models.md): dtype='auto' on a CPU that computes in float32
    (``exact=False``) takes fp16 weights where the kernel runs (its self-test passes, and
    the CPU's personality runs fbgemm: AVX2 and up); an explicit dtype keeps its weights."""
    from tests.engine.models.test_llama import _config
    from twostroke.engine.models import quantization
    from twostroke.engine.models.choice import select_kernels

    def layers(dtype: torch.dtype, exact: bool, device: str = "cpu", name: Any = "auto") -> str:
        kernels = select_kernels(
            _config(),
            dtype=dtype,
            device=torch.device(device),
            exact=exact,
            quantization=name,
            attention="bag",
        )
        return kernels.projection.layers

    fbgemm = cpu_personality().fbgemm
    for kernel in (True, False):
        monkeypatch.setattr(quantization, "_self_test", lambda kind, ok=kernel: ok)
        auto = resolve_dtype("auto", CpuDevice())
        fp16 = kernel and fbgemm and not native_bf16
        assert (layers(auto, exact=False) == "fp16") == fp16
        assert layers(torch.float32, exact=True) != "fp16"
        assert layers(torch.float32, exact=False, device="meta") != "fp16"
        assert layers(auto, exact=False, name=None) != "fp16"
        if kernel and fbgemm:
            assert layers(torch.float32, exact=True, name="int8") == "int8"


@pytest.mark.parametrize(("dtype", "packs"), [("auto", True), ("float32", False)])
def test_auto_float32_packs_the_weights_and_an_explicit_float32_keeps_transformers_products(
    dtype: str, packs: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dtype="auto"`` that resolves to float32 packs for oneDNN; ``"float32"`` does not."""
    from tests.engine.models.test_llama import make_tiny_model
    from twostroke.engine.config import EngineConfig
    from twostroke.engine.models.forms import can_pack
    from twostroke.engine.runners.torch import TorchModelRunner
    from twostroke.engine.text.tokenizer import HFTokenizer

    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: False)
    # The tiny model has no tokenizer; loading is what this test is about.
    monkeypatch.setattr(HFTokenizer, "from_pretrained", classmethod(lambda cls, path: NO_TOKENS))
    make_tiny_model("llama", tmp_path, seed=5)
    config = EngineConfig(
        dtype=dtype,  # type: ignore[arg-type]
        quantization=None,
        torch_threads=torch.get_num_threads(),
    )
    runner, _ = loading.load_runner(str(tmp_path), device=CpuDevice(), config=config)
    assert isinstance(runner, TorchModelRunner)
    assert runner.model.dtype == torch.float32
    packed = runner.model.kernels.projection.head == "onednn"
    assert packed == (packs and can_pack(torch.float32, CpuDevice().torch_device, exact=False))


# (gguf and gguf_f32 need a GGUF file: the same rule, tests/engine/checkpoints/test_blocks.py.)
@pytest.mark.parametrize("quantization", sorted(plan_module.QUANTIZE_TO_BLOCKS))
def test_auto_dtype_with_blocks_is_float32_also_where_bfloat16_is_native(
    quantization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block products take float32 activations only: ``dtype="auto"`` resolves to it
    with a block quantization even on a CPU whose default is bfloat16, where an explicit
    ``"bfloat16"`` is refused with the rule."""
    from tests.engine.models.test_llama import make_tiny_model
    from twostroke.engine.config import EngineConfig
    from twostroke.engine.kernels.gguf_blocks import block_kernel
    from twostroke.engine.runners.torch import TorchModelRunner
    from twostroke.engine.text.tokenizer import HFTokenizer

    if block_kernel() is None:
        pytest.skip("the block products do not build here")
    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(HFTokenizer, "from_pretrained", classmethod(lambda cls, path: NO_TOKENS))
    make_tiny_model("llama", tmp_path, seed=5)
    threads = torch.get_num_threads()
    config = EngineConfig(quantization=quantization, torch_threads=threads)  # type: ignore[arg-type]
    runner, _ = loading.load_runner(str(tmp_path), device=CpuDevice(), config=config)
    assert isinstance(runner, TorchModelRunner)
    assert runner.model.dtype == torch.float32
    explicit = EngineConfig(
        dtype="bfloat16",
        quantization=quantization,  # type: ignore[arg-type]
        torch_threads=threads,
    )
    with pytest.raises(ValueError, match="float32 activations; got dtype bfloat16"):
        loading.load_runner(str(tmp_path), device=CpuDevice(), config=explicit)


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path: Path) -> None:
    """Such a pair loaded, and then every prompt holding one of the extra ids failed its
    step; both numbers are named at load instead. A tokenizer no larger loads."""
    from tests.engine.models.test_llama import make_tiny_model
    from tests.engine.text.test_tokenizer import write_model_directory
    from twostroke.engine.checkpoints.source import ModelLoadError
    from twostroke.engine.config import EngineConfig
    from twostroke.engine.text.tokenizer import HFTokenizer

    config = EngineConfig(dtype="float32", quantization=None, torch_threads=1)
    small = tmp_path / "small"
    make_tiny_model("llama", small, seed=5)  # 256 rows
    write_model_directory(small, chat_template=None)
    tokens = HFTokenizer.from_pretrained(small).vocab_size
    assert tokens > 256
    with pytest.raises(
        ModelLoadError,
        match=rf"^{re.escape(str(small))}: the tokenizer has {tokens} tokens, more than the "
        r"embedding's 256 rows: a prompt with a token id >= 256 would fail$",
    ):
        loading.load_runner(str(small), device=CpuDevice(), config=config)
    fits = tmp_path / "fits"
    make_tiny_model("llama", fits, seed=5, vocab_size=tokens)
    write_model_directory(fits, chat_template=None)
    _, tokenizer = loading.load_runner(str(fits), device=CpuDevice(), config=config)
    assert tokenizer.vocab_size == tokens
