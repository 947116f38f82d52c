"""The dtype policy: which dtype an engine's weights and activations take on a device.

One rule for the engine (``dtype="auto"``), the model loader and the benchmark:
:func:`default_dtype`. It needs to know whether the CPU computes bf16 natively, which the
CPU's personality says (:func:`twostroke.gpu.isa.cpu_personality`: the machine's flags, or
the rung ``TWOSTROKE_CPU_ISA`` caps them at), unless :data:`CPU_BF16_ENV` says otherwise.
"""

from __future__ import annotations

import os

import torch

from twostroke.gpu.device import Device
from twostroke.gpu.isa import Personality, cpu_personality

__all__ = ["CPU_BF16_ENV", "default_dtype"]


def default_dtype(device: Device | torch.device) -> torch.dtype:
    """The dtype to hold weights and activations in on ``device``: the one rule of twostroke.

    bfloat16 where the hardware computes it natively (same range as float32, so no overflow
    handling; half the memory traffic, which bounds decode speed), else the best fallback:
    float16 on older GPUs (compute capability below 8.0), float32 on CPUs without bf16
    instructions (emulated bf16 there is slower than float32: on an AVX2-only CPU twostroke
    measured 13.6 output tokens/s in bf16 against 60 in float32), or whose personality
    (``TWOSTROKE_CPU_ISA``) stops below ``avx512_bf16``. Fake devices (and any other torch
    device type) use float32, so tests give the same numbers on every machine.

    The engine (``dtype="auto"``), the model loader and the benchmark all ask this function.
    :data:`CPU_BF16_ENV` (``TWOSTROKE_CPU_BF16=native`` or ``emulated``) overrides what it
    finds out about the CPU, so both branches can be exercised on any machine.

    Args:
        device: A :class:`Device`, or a ``torch.device`` (for code below the engine, such as
            the model loader).

    Returns:
        ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.

    Raises:
        ValueError: :data:`CPU_BF16_ENV` holds a value other than ``native`` or ``emulated``,
            or ``TWOSTROKE_CPU_ISA`` one that :func:`~twostroke.gpu.isa.cpu_personality`
            refuses.
    """
    if isinstance(device, Device):
        kind, torch_device = device.kind, device.torch_device
    else:
        kind, torch_device = device.type, device
    if kind == "cuda":
        major, _ = torch.cuda.get_device_capability(torch_device)
        return torch.bfloat16 if major >= 8 else torch.float16
    if kind == "cpu" and _cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


#: The environment variable that overrides what :func:`default_dtype` finds out about the
#: CPU: ``native`` (treat bf16 as native, so ``"auto"`` is bfloat16) or ``emulated`` (so
#: ``"auto"`` is float32). For tests that must exercise both branches of the rule on one
#: machine, and for a user whose CPU is misread. Unset: the machine decides.
CPU_BF16_ENV = "TWOSTROKE_CPU_BF16"
_CPU_BF16_CHOICES = {"native": True, "emulated": False}


def _cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 natively, unless :data:`CPU_BF16_ENV` says otherwise.

    Raises:
        ValueError: :data:`CPU_BF16_ENV` is set to something other than ``native`` or
            ``emulated``; the message names the variable and the value.
    """
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is None or forced == "":
        return _fast_bf16(torch.backends.cpu.get_cpu_capability(), cpu_personality())
    try:
        return _CPU_BF16_CHOICES[forced]
    except KeyError:
        choices = " or ".join(map(repr, _CPU_BF16_CHOICES))
        raise ValueError(f"{CPU_BF16_ENV} must be {choices} (or unset), got {forced!r}") from None


def _fast_bf16(capability: str, personality: Personality) -> bool:
    """Whether torch's CPU kernels (``capability``) and the personality both give native bf16.

    The personality's rung must be ``avx512_bf16`` (the CPU's flags, or the cap), and ATen
    must dispatch to its AVX-512 kernels (a torch built without them, or an
    ``ATEN_CPU_CAPABILITY`` the user set lower, emulates bf16).
    """
    return "AVX512" in capability and personality.bf16
