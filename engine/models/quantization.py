"""Reduced-precision projection weights with full-precision activations (CPU, fbgemm).

``quantization="fp16"`` stores every decoder projection's weight in float16 and
``quantization="int8"`` in int8 with one scale per output channel; activations stay float32,
and int8 products quantize them per call (one scale per tensor, 7 bits: fbgemm's
``reduce_range`` for AVX2). Decode is bound by the bytes of the weights it streams, so half
or a quarter of them is most of the speed-up: on the projection stack of SmolLM2-135M at
batch 32, 2.0x (fp16) and 2.35x (int8) over float32 on an AVX2 EPYC (measured; see
docs/performance.md). The names follow vLLM's ``quantization=`` option, which quantizes an
unquantized checkpoint's weights as it loads them (its ``"fp8"``); ``dtype`` stays the
activations' dtype, as in vLLM.

The kernels are fbgemm's, reached through ``torch.ops.quantized`` (``linear_prepack_fp16`` /
``linear_dynamic_fp16``, ``linear_prepack`` / ``linear_dynamic``): torch ships them but marks
the ``torch.ao`` quantization stack for removal, so :func:`kernel_available` runs one small
product at start and the loader falls back to full-precision weights, with one
:class:`QuantizationUnavailable` warning, where the op is missing or wrong (and on any device
but the CPU). The embedding and the output projection stay at full precision, as vLLM leaves
``lm_head`` unquantized by default.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from twostroke.engine.models.forms import Quantization, QuantizedWeight
from twostroke.gpu.isa import cpu_personality

__all__ = ["QuantizationUnavailable", "kernel_available", "unavailable_message"]

#: Relative error (of the largest output) a kernel's self-test accepts: fp16 weights give
#: about 2e-4 on random data, int8 weights and 7-bit activations about 2e-2 (measured).
_SELF_TEST_TOLERANCE: dict[Quantization, float] = {"fp16": 1e-2, "int8": 1e-1}


class QuantizationUnavailable(UserWarning):
    """The requested weight precision cannot run here; the weights stay at full precision."""


def kernel_available(kind: Quantization, device: torch.device) -> bool:
    """Whether ``kind``'s fbgemm kernel runs here and agrees with ``F.linear``.

    CPU only, and a CPU whose personality runs fbgemm (AVX2 and up: fbgemm has no path
    below it, so ``TWOSTROKE_CPU_ISA=portable`` keeps full-precision weights, as a CPU
    without AVX2 would). One tiny prepack and product per kind and process: the ops live in
    torch's quantization stack, slated for removal, so their presence is tested, not assumed.
    """
    return device.type == "cpu" and cpu_personality().fbgemm and _self_test(kind)


@functools.cache
def _self_test(kind: Quantization) -> bool:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 16, generator=generator)
    bias = torch.randn(24, generator=generator)
    x = torch.randn(3, 16, generator=generator)
    try:
        with torch.inference_mode():
            out = QuantizedWeight(weight, bias, kind)(x)
    except (RuntimeError, AttributeError, NotImplementedError):  # op missing or unsupported
        return False
    expected = F.linear(x, weight, bias)
    error = (out - expected).abs().max() / expected.abs().max()
    return bool(error <= _SELF_TEST_TOLERANCE[kind])


def unavailable_message(kind: Quantization, device: torch.device) -> str:
    """The warning's text when ``kind`` cannot run on ``device``."""
    if device.type != "cpu":
        where = f"on {device.type} (fbgemm kernels are CPU-only)"
    elif not cpu_personality().fbgemm:
        where = f"on a {cpu_personality().describe()} CPU (fbgemm needs AVX2)"
    else:
        where = f"in torch {torch.__version__} (its fbgemm op is missing or gives wrong results)"
    return f"quantization={kind!r} is not available {where}: the weights stay at full precision"
