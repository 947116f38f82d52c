"""The dtype policy: bfloat16 where the device computes it natively, else the best fallback."""

from __future__ import annotations

import re

import pytest
import torch

from twostroke.gpu import dtype as dtype_module
from twostroke.gpu.device import CpuDevice, CudaDevice
from twostroke.gpu.dtype import default_dtype
from twostroke.gpu.fake import FakeDevice
from twostroke.gpu.isa import ISA_ENV, RUNGS, Personality, cpu_personality, machine_rung

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = pytest.mark.isa


def test_default_dtype_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    capability = (8, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert default_dtype(CudaDevice(0)) == torch.bfloat16
    capability = (7, 5)
    assert default_dtype(CudaDevice(0)) == torch.float16


def test_default_dtype_cpu_and_fake() -> None:
    assert default_dtype(FakeDevice()) == torch.float32
    expected = torch.bfloat16 if dtype_module._cpu_has_fast_bf16() else torch.float32
    assert default_dtype(CpuDevice()) == expected


@pytest.mark.parametrize(
    ("value", "expected"), [("native", torch.bfloat16), ("emulated", torch.float32)]
)
def test_the_environment_overrides_what_the_cpu_says(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: torch.dtype
) -> None:
    monkeypatch.setenv(dtype_module.CPU_BF16_ENV, value)
    assert default_dtype(CpuDevice()) == default_dtype(torch.device("cpu")) == expected
    assert default_dtype(FakeDevice()) == torch.float32  # fake devices ignore it
    monkeypatch.setenv(dtype_module.CPU_BF16_ENV, "")  # empty is unset: the machine decides
    assert dtype_module._cpu_has_fast_bf16() is dtype_module._fast_bf16(
        torch.backends.cpu.get_cpu_capability(), cpu_personality()
    )


def test_an_unknown_override_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWOSTROKE_CPU_BF16", "yes")
    message = "TWOSTROKE_CPU_BF16 must be 'native' or 'emulated' (or unset), got 'yes'"
    with pytest.raises(ValueError, match=re.escape(message)):
        default_dtype(CpuDevice())


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_default_dtype_of_a_torch_device_follows_the_same_rule(
    monkeypatch: pytest.MonkeyPatch, fast_bf16: bool
) -> None:
    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: fast_bf16)
    expected = torch.bfloat16 if fast_bf16 else torch.float32
    assert default_dtype(torch.device("cpu")) == default_dtype(CpuDevice()) == expected
    assert default_dtype(FakeDevice()) == torch.float32  # whatever the CPU
    assert default_dtype(torch.device("meta")) == torch.float32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))
    assert default_dtype(torch.device("cuda", 0)) == torch.float16


@pytest.mark.parametrize(
    ("capability", "flags", "fast"),
    [
        ("AVX512", "fpu avx512f avx512_bf16 sse", True),
        ("AVX512", "fpu avx512f avx512bw", False),  # AVX-512 without bf16 instructions
        ("AVX2", "fpu avx512_bf16", False),  # torch's kernels do not use them
        ("DEFAULT", "", False),
    ],
)
def test_fast_bf16_detection(capability: str, flags: str, fast: bool) -> None:
    """Native bf16 needs the personality's rung to have it and ATen to dispatch to AVX-512."""
    known = frozenset(flags.split())
    if "avx512f" in known:  # the rest of the AVX-512 rung, so that only bf16 decides
        known |= RUNGS[2].requires
    if "avx512_bf16" in known:
        known |= {"avx512_vnni"}
    rung = machine_rung(known, x86=True)
    personality = Personality(rung, rung, capped=False)
    assert dtype_module._fast_bf16(capability, personality) is fast


@pytest.mark.isa
def test_auto_follows_the_personality(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capped personality below ``avx512_bf16`` makes ``"auto"`` float32, whatever the CPU."""
    monkeypatch.delenv(dtype_module.CPU_BF16_ENV, raising=False)
    if not cpu_personality().rung.bf16:  # this run's rung (make test's lower passes too)
        assert default_dtype(CpuDevice()) == torch.float32
    monkeypatch.setenv(ISA_ENV, "portable")  # every CPU runs it
    assert default_dtype(CpuDevice()) == torch.float32
    monkeypatch.setenv(ISA_ENV, "avx3")
    with pytest.raises(ValueError, match=re.escape(f"{ISA_ENV} must be 'native'")):
        default_dtype(CpuDevice())
