"""What this CPU runs, as the program decides it: the personality and the paths it chose.

``twostroke isa`` prints it; the tests of :mod:`twostroke.gpu.isa` read it to show that a
capped personality reaches every decision (ATen, the compiled kernels, the dtype, the
weights). Nothing here decides anything: each line asks the function that makes the choice
(:func:`~twostroke.gpu.dtype.default_dtype`,
:func:`~twostroke.engine.models.quantization.kernel_available`,
:func:`.projection.projection_kernel`, :func:`.paged_attention.paged_decode_kernel`),
for the default model's attention shape (SmolLM2-135M: 9 query heads of 64 over 3 key/value
heads, blocks of 16 positions).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs
import torch

from twostroke.engine.kernels.build import native_wanted
from twostroke.engine.kernels.paged_attention import paged_decode_kernel
from twostroke.engine.kernels.projection import projection_kernel
from twostroke.engine.models.quantization import kernel_available
from twostroke.gpu.dtype import default_dtype
from twostroke.gpu.host import cpu_model_name
from twostroke.gpu.isa import (
    ISA_ENV,
    LIBRARY_VARIABLES,
    Personality,
    cpu_personality,
    rungs_to_test,
)

__all__ = ["CpuReport", "cpu_report"]

#: The attention shape the report builds its kernel for: the default model's.
_ATTENTION = {"block_size": 16, "head_dim": 64, "num_heads": 9, "num_kv_heads": 3}

_CPU = torch.device("cpu")


@attrs.frozen
class CpuReport:
    """The CPU's personality and what each decision made of it.

    Attributes:
        personality: :func:`~twostroke.gpu.isa.cpu_personality`.
        cpu: The CPU's model name, where the host says.
        aten: The instruction set ATen dispatches on
            (``torch.backends.cpu.get_cpu_capability()``).
        variables: The libraries' caps in this process's environment.
        unapplied: What of the personality a library did not take (empty: all).
        dtype: What ``dtype="auto"`` is on the CPU.
        weights: What ``quantization="auto"`` gives the projections' weights.
        projections: The bfloat16 projections: compiled, or oneDNN's (and why).
        attention: The decode attention for the default model's shape and ``dtype``:
            compiled (with its vector width), or the bag kernel (and why).
        rungs_to_test: The lower rungs ``make test`` runs the ``isa`` tests on again.
    """

    personality: Personality
    cpu: str | None
    aten: str
    variables: Mapping[str, str]
    unapplied: tuple[str, ...]
    dtype: torch.dtype
    weights: str
    projections: str
    attention: str
    rungs_to_test: tuple[str, ...]

    def lines(self) -> list[str]:
        """The report as ``name: value`` lines."""
        caps = ", ".join(f"{name}={value}" for name, value in self.variables.items())
        rows = [
            ("cpu", self.cpu or "unknown"),
            ("personality", self.personality.describe()),
            ("compile flags", " ".join(self.personality.compile_flags) or "(compiler default)"),
            ("aten", self.aten),
            ("library caps", caps or "none"),
            ("dtype auto", str(self.dtype).removeprefix("torch.")),
            ("weights auto", self.weights),
            ("bf16 projections", self.projections),
            ("decode attention", self.attention),
            ("lower rungs make test runs", ", ".join(self.rungs_to_test) or "none"),
        ]
        rows += [("not applied", line) for line in self.unapplied]
        return [f"{name}: {value}" for name, value in rows]


def cpu_report(environ: Mapping[str, str] | None = None) -> CpuReport:
    """Ask each decision what it makes of this CPU (compiling kernels if not cached).

    Args:
        environ: Where the library caps are read (``os.environ`` if ``None``).

    Raises:
        ValueError: ``TWOSTROKE_CPU_ISA`` names no rung, or one above this CPU's.
    """
    env = os.environ if environ is None else environ
    personality = cpu_personality()
    aten = torch.backends.cpu.get_cpu_capability()
    dtype = default_dtype(_CPU)
    weights = str(dtype).removeprefix("torch.")
    if dtype == torch.float32 and kernel_available("fp16", _CPU):
        weights = "fp16 (fbgemm)"
    return CpuReport(
        personality=personality,
        cpu=cpu_model_name(),
        aten=aten,
        variables={name: env[name] for name in (ISA_ENV, *LIBRARY_VARIABLES) if name in env},
        unapplied=tuple(personality.unapplied(aten)),
        dtype=dtype,
        weights=weights,
        projections=_projections(),
        attention=_attention(dtype),
        rungs_to_test=tuple(rungs_to_test(personality.machine)),
    )


def _projections() -> str:
    if not native_wanted():
        return "oneDNN's (TWOSTROKE_NATIVE=0)"
    kernel = projection_kernel()
    if kernel is None:
        return "oneDNN's (no compiled kernel runs here; the log says why)"
    return f"compiled, {kernel.panel}-column panels"


def _attention(dtype: torch.dtype) -> str:
    if not native_wanted():
        return "bag (TWOSTROKE_NATIVE=0)"
    kernel = paged_decode_kernel(dtype=dtype, **_ATTENTION)
    if kernel is None:
        return "bag (the compiled kernel did not build or check; the log says why)"
    return f"compiled, {kernel.vector_bits}-bit vectors"
