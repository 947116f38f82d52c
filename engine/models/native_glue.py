"""The decoder's residual add and RMSNorm as one compiled call per norm, on the CPU.

Each decoder layer adds its attention's output to the residual stream and normalizes the
sum for its MLP, then adds the MLP's output and normalizes for the next layer. In torch
that is, per norm, an ``add`` and ``rms_norm`` (five operators on the CPU), and in bfloat16
two casts and a product more: SmolLM2's batch-32 decode step spent 11 ms of 197 on its norms
in float32 (docs/performance.md). ``rms_norm.c``, next to this module, does the add and the
norm in one pass per row, one call from Python per norm (the GIL released around it).

It is built and cached as the paged decode kernel is (:func:`~.native.compile_library`),
once per hidden size and element type, and checked against torch's arithmetic before use;
where it cannot be, one warning is logged and the model keeps torch's operators.
``TWOSTROKE_NATIVE=0`` keeps them too. The model uses it only where transformers' exact
arithmetic is not asked for (``exact=False``, the engine's ``dtype="auto"``): the mean of the
squares is summed in another order than torch's, so results agree to float32 rounding, not
bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import torch

from twostroke.engine.models.native import ELEMENTS, NativeBuildError, compile_library

__all__ = [
    "NORM_SOURCE",
    "RMSNormKernel",
    "build_norm_kernel",
    "reference_add_rms_norm",
    "rms_norm_kernel",
]

#: The kernel's C source.
NORM_SOURCE = Path(__file__).with_name("rms_norm.c")

#: Largest difference from torch the start-up check accepts, relative to the output's
#: largest magnitude (float32: the mean's summation order; bfloat16: one rounding more).
_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-6, torch.bfloat16: 1e-2}

_log = logging.getLogger(__name__)


@attrs.frozen
class RMSNormKernel:
    """One compiled kernel: residual add and RMSNorm for rows of one width and element type.

    Attributes:
        hidden: The width of a row.
        dtype: Element type of the rows and the weight.
        path: The shared library.
    """

    hidden: int
    dtype: torch.dtype
    path: Path
    _function: Callable[..., None] = attrs.field(repr=False)

    def __call__(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Add ``delta`` to ``residual`` in place (if given) and return the normalized sum.

        Args:
            residual: ``[rows, hidden]``, contiguous; holds ``residual + delta`` afterwards.
            delta: ``[rows, hidden]`` (made contiguous if it is not), or ``None``.
            weight: ``[hidden]``, contiguous.
            eps: Added to the mean of the squares.

        Returns:
            ``weight * residual / sqrt(mean(residual ** 2) + eps)``, a new ``[rows, hidden]``.

        Raises:
            ValueError: a tensor of another dtype or width than the kernel was built for, or
                a residual that is not contiguous (the sum would be lost).
        """
        hidden, dtype = self.hidden, self.dtype
        if (
            residual.dtype != dtype
            or weight.dtype != dtype
            or residual.dim() != 2
            or residual.shape[1] != hidden
            or weight.shape != (hidden,)
            or not residual.is_contiguous()
            or not weight.is_contiguous()
            or (delta is not None and (delta.dtype != dtype or delta.shape != residual.shape))
        ):
            raise ValueError(
                f"the kernel takes a contiguous {dtype} residual [rows, {hidden}], a delta of "
                f"its shape and a contiguous weight [{hidden}]; got residual {residual.dtype} "
                f"{tuple(residual.shape)} (contiguous: {residual.is_contiguous()}), delta "
                f"{None if delta is None else (delta.dtype, tuple(delta.shape))}, weight "
                f"{weight.dtype} {tuple(weight.shape)}"
            )
        if delta is not None and not delta.is_contiguous():
            delta = delta.contiguous()
        out = torch.empty_like(residual)
        self._function(
            residual.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            eps,
            residual.shape[0],
            out.data_ptr(),
        )
        return out


def rms_norm_kernel(*, hidden: int, dtype: torch.dtype) -> RMSNormKernel | None:
    """The kernel for this width and element type, or ``None`` where none runs.

    Built (or loaded from the cache) and checked the first time it is asked for in a
    process; later calls return the same kernel. ``None`` for element types other than
    float32 and bfloat16, and where the build or its check fails (logged once as a warning,
    with the reason).
    """
    if dtype not in ELEMENTS:
        return None
    return _kernel(hidden, dtype)


@functools.cache
def _kernel(hidden: int, dtype: torch.dtype) -> RMSNormKernel | None:
    try:
        return build_norm_kernel(hidden=hidden, dtype=dtype)
    except NativeBuildError as error:
        _log.warning(
            "twostroke: the native RMSNorm kernel is unavailable (%s); the decoder's norms "
            "run as torch operators instead",
            error,
        )
        return None


def build_norm_kernel(
    *, hidden: int, dtype: torch.dtype, environ: Mapping[str, str] | None = None
) -> RMSNormKernel:
    """Compile (or load from the cache), load and check the kernel for one width.

    Args:
        hidden: The width of a row.
        dtype: float32 or bfloat16.
        environ: Where ``$CC`` and the cache folder are read (``os.environ`` if ``None``).

    Raises:
        NativeBuildError: no compiler, a failed compile or load, or results that disagree
            with :func:`reference_add_rms_norm`; the message says which.
        ValueError: a width below 1, or an element type the kernel is not built for.
    """
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    if dtype not in ELEMENTS:
        raise ValueError(f"the native kernel takes float32 or bfloat16, got {dtype}")
    env = os.environ if environ is None else environ
    defines = [f"-DHIDDEN={hidden}"]
    element = ELEMENTS[dtype]
    if element is not None:
        defines.append(f"-D{element}")
    library, path = compile_library(NORM_SOURCE, defines, "the RMSNorm kernel", env)
    function = library.twostroke_add_rms_norm
    function.restype = None
    pointer = ctypes.c_void_p
    function.argtypes = [pointer, pointer, pointer, ctypes.c_float, ctypes.c_ssize_t, pointer]
    kernel = RMSNormKernel(hidden, dtype, path, function=function)
    _check(kernel)
    return kernel


def reference_add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :class:`RMSNormKernel` computes, as transformers does: ``(sum, normalized)``.

    Nothing is modified: the sum is a new tensor.
    """
    total = residual if delta is None else residual + delta
    shape = (total.shape[-1],)
    normalized = torch.rms_norm(total.float(), shape, None, eps).to(total.dtype)
    return total, weight * normalized


def _check(kernel: RMSNormKernel) -> None:
    """Run ``kernel`` on random rows, with and without a delta, against the reference.

    Enough rows that the call runs on the thread team too.
    """
    generator = torch.Generator().manual_seed(0)
    hidden, dtype = kernel.hidden, kernel.dtype
    for rows, with_delta in ((3, False), (3, True), (70, True)):
        residual = (4 * torch.randn(rows, hidden, generator=generator)).to(dtype)
        delta = torch.randn(rows, hidden, generator=generator).to(dtype) if with_delta else None
        weight = (1 + torch.randn(hidden, generator=generator) / 4).to(dtype)
        total, expected = reference_add_rms_norm(residual, delta, weight, 1e-5)
        got = kernel(residual, delta, weight, 1e-5)
        scale = float(expected.float().abs().max())
        difference = max(
            float((got.float() - expected.float()).abs().max()) / scale,
            float((residual.float() - total.float()).abs().max()),
        )
        if not difference <= _TOLERANCE[dtype]:
            raise NativeBuildError(
                f"its check differs from torch by {difference:.3g} (at most "
                f"{_TOLERANCE[dtype]:g} allowed for {dtype})"
            )
