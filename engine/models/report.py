"""What this CPU runs, as the program decides it: the personality and the paths it chose.

``twostroke isa`` prints it; the tests of :mod:`twostroke.gpu.isa` read it to show that a capped
personality reaches every decision (ATen, the compiled kernels, the dtype, the weights). Nothing
here decides anything: each line asks the functions that make the choices
(:func:`~twostroke.gpu.dtype.default_dtype`, and
:func:`~twostroke.engine.models.choice.select_kernels` for the engine's defaults, ``dtype="auto"``
and ``quantization="auto"``, and for bfloat16 weights), for the default model's shape (SmolLM2-135M:
9 query heads of 64 over 3 key/value heads, blocks of 16 positions).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from twostroke.engine.attention.kernels import native_kernel
from twostroke.engine.models.choice import CpuKernels, select_kernels
from twostroke.engine.models.config import ModelConfig
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

#: The shape the report chooses kernels for: the default model's (SmolLM2-135M).
_MODEL = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
_BLOCK_SIZE = 16

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
    auto = _choose(dtype, quantization="auto")
    weights = str(dtype).removeprefix("torch.")
    if auto.projection.quantization is not None:
        weights = f"{auto.projection.quantization} (fbgemm)"
    return CpuReport(
        personality=personality,
        cpu=cpu_model_name(),
        aten=aten,
        variables={name: env[name] for name in (ISA_ENV, *LIBRARY_VARIABLES) if name in env},
        unapplied=tuple(personality.unapplied(aten)),
        dtype=dtype,
        weights=weights,
        projections=_projections(_choose(torch.bfloat16, attention="bag")),
        attention=_attention(auto, dtype),
        rungs_to_test=tuple(rungs_to_test(personality.machine)),
    )


def _choose(dtype: torch.dtype, **options: Any) -> CpuKernels:
    """What the engine chooses for the default model in ``dtype``, its ``exact=False``."""
    return select_kernels(
        _MODEL, dtype=dtype, device=_CPU, exact=False, block_size=_BLOCK_SIZE, **options
    )


def _projections(kernels: CpuKernels) -> str:
    projection = kernels.projection
    if projection.kernel is not None and projection.layers == "panels":
        return f"compiled, {projection.kernel.panel}-column panels"
    return f"oneDNN's ({dict(kernels.reasons).get('projections', 'not compiled')})"


def _attention(kernels: CpuKernels, dtype: torch.dtype) -> str:
    if kernels.attention != "native":
        return f"{kernels.attention} ({dict(kernels.reasons).get('attention', 'chosen')})"
    config = _MODEL
    kernel = native_kernel(
        _CPU,
        block_size=_BLOCK_SIZE,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )
    return f"compiled, {kernel.vector_bits}-bit vectors"
