"""The decoder's bfloat16 projections in C, on CPUs with AVX512-BF16.

torch runs a bfloat16 ``F.linear`` on the CPU through oneDNN, and twostroke packs its
weights for oneDNN once (:func:`~twostroke.engine.models.forms.pack`). At the batch sizes a
decoder steps with, oneDNN's kernels leave much of the machine unused: on SmolLM2-135M's
30-layer projection stack, a Zen 4 EPYC with 2 threads streamed the weights at 14 GB/s for
one row and reached 242 of its 406 GFLOPS at 32 rows (docs/performance.md).
``projection_bf16.c``, next to this module, lays each weight out once in panels of 48 output
columns whose pairs of inputs sit together, the operand layout of AVX512-BF16's pair-wise
multiply-add; a tile of up to 8 rows by one panel keeps its 24 float32 sums in registers
over the whole input width, so a weight is read from memory once per call, by one thread. On
the same stack: 1.9x oneDNN's speed for one row (27 GB/s) and 1.36x for 32 rows (330
GFLOPS), 1.16x at 512.

Where the CPU has AMX (Intel Xeon from Sapphire Rapids on), oneDNN's bfloat16 products run
on its tiles, and beyond 8 rows the vector panels lost to them (3.2x oneDNN's time at 32
rows). So the same library, built there, multiplies on AMX tiles too (``TDPBF16PS``),
reading the same panels, whose layout is the tiles' operand layout: up to 16 rows of inputs
by a panel's 48 columns a group of tiles. Measured on SmolLM2's four
projections of a layer, each of 30 layers' weights in turn (so read from memory, as in a
step), 2 threads, Intel Xeon with AMX: the vector panels' time over the tiles' 0.90-0.93 at
4 rows, 1.08-1.09 at 5, 3.4-4.0 at 32, 4.8-5.4 at 128; oneDNN's packed products' over the
tiles' 1.6-1.7 at 32 rows, 1.3-1.4 at 128 (both paths with the prefetch hints the C source
describes; before them, 1.08-1.16 at 128 and 512). One copy of each weight then serves every
row count, and the decoder stack runs every step in one call. Every row count runs on the
tiles, one row included, though the vector panels were faster below 5 rows: the two sum in
different orders, and a row's outputs must not change with the rows beside it, or greedy
tokens change with the batch (speculative decoding's check failed); one decode step pays
about 9 % for it (``projection_bf16.c``).

The sums are float32 and each output is rounded to bfloat16 once, as oneDNN does, but in
another order than oneDNN sums, so the products agree with ``F.linear`` to bfloat16
rounding, not bit for bit: the model uses this kernel only where transformers' exact
arithmetic is not asked for (``exact=False``, the engine's ``dtype="auto"``).

It is built and cached as the other kernels are (:func:`~.build.compile_library`) and
checked against torch before use. On a CPU without AVX512-BF16 the library says so and the
projections stay oneDNN's (logged at INFO); where the build or its check fails, one warning
is logged and they stay oneDNN's too. ``TWOSTROKE_NATIVE=0`` keeps them without a word.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ClassVar, Protocol

import attrs
import torch

from twostroke.engine.kernels.build import (
    NativeBuildError,
    address,
    bind,
    call,
    compile_library,
    relative_difference,
)

__all__ = [
    "PROJECTION_SOURCE",
    "SUPPORTED_SYMBOLS",
    "SYMBOLS",
    "Panels",
    "ProjectionKernel",
    "ProjectionUnsupported",
    "build_projection",
    "projection_kernel",
]

#: The kernel's C source.
PROJECTION_SOURCE = Path(__file__).with_name("projection_bf16.c")

#: The functions this module takes from every build of the library
#: (:func:`.build.compile_library` checks each is there).
SYMBOLS = (
    "twostroke_projection_supported",
    "twostroke_projection_panel",
    "twostroke_projection_tiles",
)
#: The functions a build has where the CPU runs it (``twostroke_projection_supported``): the
#: vector tiles alone, and the same with AMX tiles for many rows (:attr:`ProjectionKernel.tiles`).
SUPPORTED_SYMBOLS = ("twostroke_projection", "twostroke_projection_tiled")

#: Largest difference from a float32 product of the same bfloat16 inputs that the start-up
#: check accepts, relative to the product's largest magnitude: the output's rounding to
#: bfloat16 (2**-9 of a value) and float32 sums in another order.
_TOLERANCE = 8e-3

_log = logging.getLogger(__name__)


class ProjectionUnsupported(NativeBuildError):
    """The kernel built, but this CPU has no AVX512-BF16 (the compiler saw none)."""


class Panels(Protocol):
    """A weight laid out by :meth:`ProjectionKernel.lay_out`, as a call reads it."""

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...

    @property
    def addresses(self) -> tuple[int, int | None]:
        """Where the panels and the bias (or ``None``) are."""
        ...


@attrs.frozen
class _Laid:
    """:class:`Panels` for the start-up check."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def addresses(self) -> tuple[int, int | None]:
        return self.panels.data_ptr(), None if self.bias is None else self.bias.data_ptr()


@attrs.frozen
class ProjectionKernel:
    """The compiled bfloat16 projection.

    The GIL is released for a whole call (``ctypes`` drops it around foreign calls).

    Attributes:
        panel: Output columns per panel of a packed weight.
        path: The shared library.
        tiles: Whether the products run on AMX tiles (``TDPBF16PS``), every row count:
            the library is built for them (``-march=native`` on a CPU with AMX-BF16) and
            Linux grants this process their state. Decided once, when the kernel is
            built: the entry point bound (:attr:`address`, which the decoder stack calls
            too) is the tiled one.
    """

    panel: int
    path: Path
    _function: Callable[..., int] = attrs.field(repr=False)
    tiles: bool = False

    #: The activations' dtype (the decoder stack's element type for these projections).
    element: ClassVar[torch.dtype] = torch.bfloat16

    @property
    def address(self) -> int:
        """Where the kernel's entry point is (for ``decoder_stack.c``)."""
        return address(self._function)

    def packed_size(self, out_features: int, in_features: int) -> int:
        """Elements of the panels of an ``[out_features, in_features]`` weight."""
        return -(-out_features // self.panel) * self.panel * in_features

    def lay_out(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        into: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``weight`` (and ``bias``) laid out for this kernel, the originals not kept: the
        panels, bfloat16 ``[panels, in_features // 2, panel, 2]`` zero past
        ``out_features``, and the bias, float32 ``[panels * panel]`` or ``None`` (the model's
        form of them: :class:`~twostroke.engine.models.forms.PanelWeight`).

        Args:
            weight: bfloat16 ``[out_features, in_features]``, ``in_features`` even.
            bias: ``[out_features]`` in any floating dtype, or ``None``.
            into: Where the panels go: a contiguous bfloat16 CPU tensor of
                :meth:`packed_size` elements (a model's weights share one allocation in huge
                pages, :mod:`twostroke.gpu.huge_pages`); ``None`` allocates one.

        Raises:
            ValueError: another dtype, shape or device, an odd input width, or an ``into``
                that does not fit.
        """
        if (
            weight.dtype != torch.bfloat16
            or weight.dim() != 2
            or weight.shape[1] % 2
            or weight.device.type != "cpu"
        ):
            raise ValueError(
                "the projection kernel packs a bfloat16 weight [out_features, in_features] "
                f"on the CPU with in_features even; got {weight.dtype} {tuple(weight.shape)} "
                f"on {weight.device}"
            )
        out_features, in_features = int(weight.shape[0]), int(weight.shape[1])
        if bias is not None and bias.shape != (out_features,):
            raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
        panel = self.panel
        count = -(-out_features // panel)
        padded = weight.detach()
        if out_features % panel:  # zero columns to a whole panel (else no copy: the head's
            # copy was a third tensor of its size at the load's peak, beside it and its panels)
            padded = padded.new_zeros(count * panel, in_features)
            padded[:out_features] = weight.detach()
        laid_out = padded.view(count, panel, in_features // 2, 2).permute(0, 2, 1, 3)
        if into is None:
            panels = laid_out.contiguous()
        elif (
            into.dtype != torch.bfloat16
            or into.device.type != "cpu"
            or into.numel() != laid_out.numel()
            or not into.is_contiguous()
        ):
            raise ValueError(
                f"into must be a contiguous bfloat16 CPU tensor of {laid_out.numel()} elements; "
                f"got {into.dtype} {tuple(into.shape)} on {into.device}"
            )
        else:
            panels = into.view(laid_out.shape).copy_(laid_out)
        padded_bias = None
        if bias is not None:
            padded_bias = torch.zeros(count * panel, dtype=torch.float32, device=weight.device)
            padded_bias[:out_features] = bias.detach().float()
        return panels, padded_bias

    def __call__(self, x: torch.Tensor, weight: Panels) -> torch.Tensor:
        """``x W^T + b`` in bfloat16, for ``x`` ``[..., in_features]`` bfloat16.

        Raises:
            ValueError: ``x`` of another dtype or width, or not on the CPU.
        """
        # Few torch calls: this runs for every projection of every step.
        in_features, out_features = weight.in_features, weight.out_features
        shape = x.shape
        if (
            x.dtype != torch.bfloat16
            or not shape
            or shape[-1] != in_features
            or x.device.type != "cpu"
        ):
            raise ValueError(
                f"the projection takes bfloat16 [..., {in_features}] on the CPU; got {x.dtype} "
                f"{tuple(shape)} on {x.device}"
            )
        rows = x if len(shape) == 2 else x.reshape(-1, in_features)
        strides = rows.stride()
        if strides[1] != 1:
            rows = rows.contiguous()
            strides = rows.stride()
        count = rows.shape[0]
        out = torch.empty((count, out_features), dtype=torch.bfloat16)
        failed = call(
            self._function,
            rows.data_ptr(),
            strides[0],
            count,
            in_features,
            weight.addresses[0],
            out_features,
            weight.addresses[1],
            out.data_ptr(),
            out_features,
        )
        if failed:  # the tiles' copy of a last partial row tile
            raise MemoryError(
                f"the bfloat16 projection could not allocate scratch for {count} rows"
            )
        return out if len(shape) == 2 else out.view(*shape[:-1], out_features)


def projection_kernel() -> ProjectionKernel | None:
    """The bfloat16 projection kernel, or ``None`` where it does not run.

    Built (or loaded from the cache) and checked the first time it is asked for in a
    process; later calls return the same one. ``None`` on a CPU without AVX512-BF16
    (logged at INFO) and where the build or its check fails (logged once as a warning,
    with the reason).
    """
    return _kernel()


@functools.cache
def _kernel() -> ProjectionKernel | None:
    try:
        return build_projection()
    except ProjectionUnsupported as error:
        _log.info("twostroke: bfloat16 projections stay oneDNN's: %s", error)
    except NativeBuildError as error:
        _log.warning(
            "twostroke: the native bfloat16 projection is unavailable (%s); the projections "
            "stay oneDNN's",
            error,
        )
    return None


def build_projection(*, environ: Mapping[str, str] | None = None) -> ProjectionKernel:
    """Compile (or load from the cache), load and check the kernel.

    Args:
        environ: Where ``$CC`` and the cache folder are read (``os.environ`` if ``None``).

    Raises:
        ProjectionUnsupported: the compiler found no AVX512-BF16 on this CPU.
        NativeBuildError: no compiler, a failed compile or load, or results that disagree
            with torch's; the message says which.
    """
    env = os.environ if environ is None else environ
    library, path = compile_library(
        PROJECTION_SOURCE,
        [],
        "the bfloat16 projection",
        env,
        symbols=SYMBOLS,
        dtype=torch.bfloat16,
    )
    if not bind(library, path, "twostroke_projection_supported")():
        raise ProjectionUnsupported(
            "this CPU has no AVX512-BF16 (with AVX512-BW and -VL), which the kernel needs"
        )
    vectors, tiled = SUPPORTED_SYMBOLS
    tiles = bool(bind(library, path, "twostroke_projection_tiles")())
    function = bind(library, path, tiled if tiles else vectors)
    panel = int(bind(library, path, "twostroke_projection_panel")())
    kernel = ProjectionKernel(panel, path, function=function, tiles=tiles)
    _check(kernel)
    return kernel


def _check(kernel: ProjectionKernel) -> None:
    """Products of random shapes against float32 ones of the same bfloat16 inputs.

    Partial panels, a tile's every row count, a row stride, a bias, and a call large
    enough for the thread team.
    """
    generator = torch.Generator().manual_seed(0)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    worst = 0.0
    for rows, out_features, in_features, with_bias in (
        (1, 5, 2, False),
        (7, 2 * kernel.panel + 9, 38, True),
        (13, kernel.panel, 64, False),
        (40, 3 * kernel.panel + 1, 202, True),
        (37, 2 * kernel.panel + 5, 96, True),  # AMX tiles where they run: two and a part
    ):
        x = random(rows, in_features + 6)[:, 3 : 3 + in_features]  # a row stride, unaligned
        weight, bias = random(out_features, in_features), random(out_features)
        panels, padded = kernel.lay_out(weight, bias if with_bias else None)
        packed = _Laid(panels, padded, out_features, in_features)
        expected = x.float() @ weight.float().T + (bias.float() if with_bias else 0.0)
        worst = max(worst, relative_difference(kernel(x, packed), expected))
    if not worst <= _TOLERANCE:
        raise NativeBuildError(
            f"its check differs from torch by {worst:.3g} of the largest output (at most "
            f"{_TOLERANCE:g} allowed)"
        )
