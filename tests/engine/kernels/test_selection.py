"""The kernels a model computes with: chosen once per engine, said in one line, and each
choice, forced by the environment or by configuration, is the path that runs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.engine.models.test_llama import _config, make_tiny_model, random_sequences
from tests.engine.runners.test_torch import entry
from tests.gpu.test_isa import run_child
from twostroke.engine.attention import kernels as attention_kernels
from twostroke.engine.attention.metadata import AttentionMetadata
from twostroke.engine.config import EngineConfig
from twostroke.engine.kernels import build
from twostroke.engine.kernels.build import NATIVE_ENV
from twostroke.engine.kernels.paged_attention import PagedDecodeKernel
from twostroke.engine.models import plan as plan_module
from twostroke.engine.models.choice import select_kernels
from twostroke.engine.models.glue import CompiledGlue
from twostroke.engine.models.layers import TorchGlue
from twostroke.engine.models.loading import LoadedModel, load_model, open_model
from twostroke.engine.runners import loading
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.engine.text.tokenizer import HFTokenizer
from twostroke.gpu.device import CpuDevice
from twostroke.gpu.isa import ISA_ENV, cpu_personality
from twostroke.states.plan import StepPlan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: A stand-in for the tokenizer of a model that has none (load_runner asks its size only).
NO_TOKENS = SimpleNamespace(vocab_size=0)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", path, seed=5)
    return path


def counted(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """Replace ``module.name`` by a wrapper that records its results; the list of them."""
    original = getattr(module, name)
    results: list[Any] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        results.append(original(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(module, name, wrapper)
    return results


def test_an_engines_kernels_are_chosen_once_and_no_step_chooses_again(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_runner`` (what an engine calls, once) chooses; allocating the cache builds
    the chosen attention for its blocks; the steps only receive it."""
    monkeypatch.setattr(HFTokenizer, "from_pretrained", classmethod(lambda cls, path: NO_TOKENS))
    choices = counted(monkeypatch, plan_module, "select_kernels")
    lookups = counted(monkeypatch, attention_kernels, "paged_decode_kernel")
    given: list[Any] = []
    build_step = AttentionMetadata.build.__func__  # type: ignore[attr-defined]

    def spy(cls: type, *args: Any, **kwargs: Any) -> AttentionMetadata:
        given.append(kwargs["kernel"])
        return build_step(cls, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(AttentionMetadata, "build", classmethod(spy))
    config = EngineConfig(dtype="float32", block_size=4, torch_threads=1)
    runner, _ = loading.load_runner(str(tiny), device=CpuDevice(), config=config)
    assert isinstance(runner, TorchModelRunner)
    assert len(choices) == 1
    assert runner.kernels is choices[0]
    assert runner.model.kernels is choices[0]
    assert runner.kernels.attention == "native"
    assert len(lookups) == 1  # checked for the engine's blocks at load
    runner.allocate_kv_cache(8, 4)
    assert len(lookups) == 2  # built (from the process's cache) for the cache, once
    prompt = (9, 8, 7, 6, 5)
    runner.execute(StepPlan(0, (entry(1, 0, prompt, block_table=(3, 1, 2)),))).readback()
    for step in range(1, 5):
        plan = StepPlan(
            step,
            (entry(1, 4 + step, (), pending_input=True, sample_index=step, block_table=(3, 1, 2)),),
        )
        runner.execute(plan).readback()
    assert len(choices) == 1
    assert len(lookups) == 2  # no step looked a kernel up
    assert len(given) == 5
    assert all(isinstance(kernel, PagedDecodeKernel) for kernel in given)
    assert len({id(kernel) for kernel in given}) == 1  # the one built at allocation


def test_the_plan_is_one_info_line(tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=plan_module.__name__):
        open_model(tiny, dtype=torch.float32, device=CPU)
    said = [record.getMessage() for record in caplog.records if record.name == plan_module.__name__]
    assert len(said) == 1
    assert said[0].startswith(f"twostroke: {tiny.name} on ")
    assert "glue torch (exact arithmetic asked for)" in said[0]
    assert "projections dense (exact arithmetic asked for)" in said[0]
    assert "attention native" in said[0]
    assert (
        "stack off (it needs the compiled glue and projections (bfloat16 panels or blocks))"
        in said[0]
    )


def compiled_calls(loaded: LoadedModel, **forward: Any) -> int:
    """Calls into compiled kernels while ``forward_logits`` runs two steps of two sequences."""
    with build.timed() as timer:
        loaded.module.forward_logits(random_sequences([5, 3], seed=2), chunk_size=4, **forward)
    return timer.calls


def test_each_forced_choice_is_the_path_that_runs(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = 3  # the tiny model's
    steps = 2
    # Speed asked for (exact=False): the compiled glue (norms, rotary writes, SiLU) and the
    # compiled attention, every layer of every step.
    fast = open_model(tiny, dtype=torch.float32, device=CPU, exact=False)
    assert isinstance(fast.module.kernels.glue, CompiledGlue)
    assert fast.module.kernels.attention == "native"
    assert compiled_calls(fast) > steps * layers * 4
    # transformers' arithmetic (exact=True): torch's glue, the compiled attention only.
    exact = open_model(tiny, dtype=torch.float32, device=CPU)
    assert isinstance(exact.module.kernels.glue, TorchGlue)
    assert compiled_calls(exact) == steps * layers
    # Configuration: another attention, asked for through the plan.
    assert compiled_calls(exact, kernel="bag") == 0
    forced = TorchModelRunner.from_loaded(load_model(exact.plan.replanned(attention="matmul")))
    assert forced.attention_kernel == "matmul"
    assert isinstance(forced.kernels.glue, TorchGlue)
    assert exact.module.kernels.attention == "native"  # the first plan's choice stays
    # The environment: TWOSTROKE_NATIVE=0 at load, torch's operators for everything.
    monkeypatch.setenv(NATIVE_ENV, "0")
    plain = open_model(tiny, dtype=torch.float32, device=CPU, exact=False)
    kernels = plain.module.kernels
    assert isinstance(kernels.glue, TorchGlue)
    assert kernels.attention == "bag"
    assert kernels.stack is None
    assert dict(kernels.reasons) == {
        "glue": "TWOSTROKE_NATIVE=0",
        "projections": "the compiled projection takes bfloat16, not float32",
        "attention": "TWOSTROKE_NATIVE=0",
        "stack": "it needs the compiled glue and projections (bfloat16 panels or blocks)",
    }
    assert compiled_calls(plain) == 0


# The tiny model's configuration comes as JSON ($MODEL_CONFIG): importing the test module
# that makes it would import transformers and hypothesis into the child (8.1 -> 3.4 s of
# CPU for the child, its kernel cached, 2 AVX2 cores at load 4-5).
CAPPED = """
import json, os, warnings
import torch
from twostroke.engine.models.glue import CompiledGlue
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.choice import select_kernels
from twostroke.engine.attention.kernels import native_kernel
warnings.simplefilter("error")
config = ModelConfig.from_dict(json.loads(os.environ["MODEL_CONFIG"]))
kernels = select_kernels(
    config, dtype=torch.float32, device=torch.device("cpu"), exact=False,
    quantization="auto", block_size=4,
)
print(kernels.projection.layers)
print(kernels.attention)
shape = dict(block_size=4, num_heads=4, num_kv_heads=2, head_dim=16)
print(native_kernel(torch.device("cpu"), dtype=torch.float32, **shape).vector_bits)
"""


def test_a_capped_personality_is_what_the_choice_is_made_for() -> None:
    """``TWOSTROKE_CPU_ISA=portable``: no fbgemm (float32 weights, without a warning for
    ``"auto"``), and the attention compiled for SSE's 128-bit vectors."""
    config = json.dumps(_config().to_dict())
    layers, attention, bits = run_child(
        CAPPED, MODEL_CONFIG=config, **{ISA_ENV: "portable"}
    ).split()
    assert layers in ("onednn", "dense")  # float32, oneDNN's where it packs
    assert attention == "native"
    assert bits == "128"


def test_what_a_choice_refuses() -> None:
    with pytest.raises(ValueError, match=r"^attention_kernel must be one of .* got 'fast'$"):
        select_kernels(_config(), dtype=torch.float32, device=CPU, exact=True, attention="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^quantization must be 'auto', one of .* got 'int4'$"):
        select_kernels(_config(), dtype=torch.float32, device=CPU, exact=True, quantization="int4")  # type: ignore[arg-type]
    asked = select_kernels(_config(), dtype=torch.float32, device=CPU, exact=True, attention="sdpa")
    assert ("attention", "asked") in asked.reasons


def test_the_kv_cache_dtype_is_chosen_once_and_the_cache_is_held_in_it(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kv_cache_dtype="auto"``: float16 where float32 activations run the compiled kernels
    on a rung with F16C (avx2 and up), else the activations' dtype; the cache, its bytes,
    the compiled attention and the glue's write all follow the one choice, and the logits
    differ from a float32 cache's by the cache's rounding only."""
    half = cpu_personality().rung.vector_bits >= 256  # F16C: x86-64-v3 and up
    fast = open_model(tiny, dtype=torch.float32, device=CPU, exact=False, kv_cache_dtype="auto")
    kernels = fast.module.kernels
    assert fast.module.cache_dtype == (torch.float16 if half else torch.float32)
    assert kernels.attention == "native"
    runner = TorchModelRunner.from_loaded(fast)
    per_block = runner.kv_cache_bytes_per_block(4)
    full = open_model(tiny, dtype=torch.float32, device=CPU, exact=False)
    assert full.module.cache_dtype == torch.float32  # None: the dtype
    assert TorchModelRunner.from_loaded(full).kv_cache_bytes_per_block(4) == per_block * (
        2 if half else 1
    )
    # transformers' arithmetic asked for, or activations already in 16 bits: their dtype.
    exact = open_model(tiny, dtype=torch.float32, device=CPU, kv_cache_dtype="auto")
    assert exact.module.cache_dtype == torch.float32
    bf16 = open_model(tiny, dtype=torch.bfloat16, device=CPU, exact=False, kv_cache_dtype="auto")
    assert bf16.module.cache_dtype == torch.bfloat16
    # Asked for: float16 through the compiled kernels, read and written in place.
    asked = open_model(
        tiny, dtype=torch.float32, device=CPU, exact=False, kv_cache_dtype=torch.float16
    )
    native = asked.module.attention_for(4)
    assert isinstance(native, PagedDecodeKernel)
    assert (native.dtype, native.cache_dtype) == (torch.float32, torch.float16)
    glue = asked.module.kernels.glue
    assert isinstance(glue, CompiledGlue)
    assert glue.cache_dtype == torch.float16
    assert "attention native over a float16 cache" in asked.module.kernels.describe()
    assert asked.module.allocate_kv_cache(3, 4).data.dtype == torch.float16
    sequences = random_sequences([9, 6], seed=4)
    reference = full.module.forward_logits(sequences, chunk_size=4, block_size=4)
    halved = asked.module.forward_logits(sequences, chunk_size=4, block_size=4)
    for got, expected in zip(halved, reference, strict=True):
        assert not torch.equal(got, expected)  # the cache's rounding reaches the logits
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)
    # Without the compiled kernels: "auto" keeps the dtype (the bag kernel reads only
    # that); float16 asked for attends by gathering ("matmul"), widening what it gathers
    # (a chunk from position 0 attends over its own keys, not yet rounded to the cache's).
    monkeypatch.setenv(NATIVE_ENV, "0")
    plain = open_model(tiny, dtype=torch.float32, device=CPU, exact=False, kv_cache_dtype="auto")
    assert (plain.module.cache_dtype, plain.module.kernels.attention) == (torch.float32, "bag")
    gathered = open_model(
        tiny, dtype=torch.float32, device=CPU, exact=False, kv_cache_dtype=torch.float16
    )
    assert gathered.module.kernels.attention == "matmul"
    assert dict(gathered.module.kernels.reasons)["attention"] == "TWOSTROKE_NATIVE=0"
    again = gathered.module.forward_logits(sequences, chunk_size=4, block_size=4)
    for got, expected in zip(again, reference, strict=True):
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)


def test_what_the_kv_cache_dtype_refuses() -> None:
    with pytest.raises(
        ValueError, match=r"^kv_cache_dtype must be 'auto', one of .* got torch.int8$"
    ):
        select_kernels(
            _config(), dtype=torch.float32, device=CPU, exact=True, kv_cache_dtype=torch.int8
        )
    with pytest.raises(ValueError, match=r"'bag' attention reads the KV cache in the activations"):
        select_kernels(
            _config(),
            dtype=torch.float32,
            device=CPU,
            exact=True,
            attention="bag",
            kv_cache_dtype=torch.float16,
        )
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be 'auto' or one of"):
        plan_module.resolve_kv_cache_dtype("half")
    assert plan_module.resolve_kv_cache_dtype("bfloat16") == torch.bfloat16


def test_the_engines_kv_cache_dtype_reaches_the_runners_cache(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(HFTokenizer, "from_pretrained", classmethod(lambda cls, path: NO_TOKENS))
    config = EngineConfig(dtype="float32", kv_cache_dtype="bfloat16", block_size=4)
    runner, _ = loading.load_runner(str(tiny), device=CpuDevice(), config=config)
    assert isinstance(runner, TorchModelRunner)
    assert runner.model.cache_dtype == torch.bfloat16
    runner.allocate_kv_cache(8, 4)
    prompt = (9, 8, 7, 6, 5)
    tokens = runner.execute(StepPlan(0, (entry(1, 0, prompt, block_table=(3, 1)),))).readback()
    assert tokens is not None
