"""A step's decoder layers in one compiled call, where every kernel they need is compiled.

With the projections (the bfloat16 panels of :mod:`.projection`, or a GGUF file's blocks
as stored, :mod:`.gguf_blocks`, with float32 activations), the glue (:mod:`.glue`) and the
paged attention (:mod:`.paged_attention`) all compiled, a decoder layer is nine calls into
C, and Python only walks between them: checks, output tensors, ``ctypes`` argument
conversion, 30 layers a step. ``decoder_stack.c`` makes the same calls in the same order
from C, so a step's layers are one foreign call: its results are the per-layer path's bit
for bit (a test holds it to that), and the whole stack runs without the GIL, which the
engine's bookkeeping stroke wants meanwhile.

Measured on SmolLM2-135M in bfloat16 (AMD EPYC Zen 4, AVX512-BF16, 2 threads), both paths
alternating in one process: a step of one decode 14.13 ms layer by layer, 11.08 with the
stack; of 32 decodes 41.24 and 37.02 (docs/performance-log.md, "The decoder stack in one call").
With the GGUF blocks, docs/models.md ("GGUF blocks as stored") has the figures.

The library has no shape constants and does no arithmetic, so it is built once a machine
for each element type of the projections it drives, and has no check of its own: the
kernels it calls passed theirs. It never reads the KV cache's elements (the glue and the
attention it calls are built for the cache's type), so one build serves every
``kv_cache_dtype``. Where it does not build, one warning is logged and the model keeps
calling the kernels layer by layer.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import attrs
import torch

from twostroke.engine.kernels.build import (
    NativeBuildError,
    bind,
    compile_library,
    element_defines,
)
from twostroke.engine.kernels.glue import DecoderGlue
from twostroke.engine.kernels.header import KERNELS_HEADER, HeaderError, structures

__all__ = [
    "SOURCE",
    "SYMBOLS",
    "StackLayer",
    "StackProjection",
    "StackWeight",
    "check_layout",
    "load_stack",
    "stack_library",
    "stack_model",
    "structure",
]

#: The driver's C source.
SOURCE = Path(__file__).with_name("decoder_stack.c")

#: The functions this module takes from the library (:func:`.build.compile_library`
#: checks each is there).
SYMBOLS = ("twostroke_decoder_stack",)

_log = logging.getLogger(__name__)

#: The C structures the driver takes (``kernels.h``), by their part.
_STRUCTURES = {"layer": "twostroke_layer", "model": "twostroke_model", "step": "twostroke_step"}


def structure(part: str) -> type[ctypes.Structure]:
    """``kernels.h``'s structure of ``part`` as ctypes lays it out (:func:`.header.structures`).

    Raises:
        NativeBuildError: the header holds C its reader does not read.
    """
    try:
        return structures()[_STRUCTURES[part]]
    except HeaderError as error:
        raise NativeBuildError(f"{KERNELS_HEADER.name}: {error}") from error


class StackProjection(Protocol):
    """A compiled projection the stack calls (``kernels.h``'s
    ``twostroke_stack_projection_fn``): :class:`~.projection.ProjectionKernel` (bfloat16)
    or :class:`~.gguf_blocks.BlockKernel` (float32)."""

    @property
    def address(self) -> int:
        """Where its entry point is."""
        ...

    @property
    def element(self) -> torch.dtype:
        """The dtype of the activations it takes and returns."""
        ...


class StackWeight(Protocol):
    """A projection's weight in a :class:`StackProjection`'s form:
    :class:`~twostroke.engine.models.forms.PanelWeight` or
    :class:`~twostroke.engine.models.forms.BlockWeight`."""

    @property
    def kernel(self) -> object:
        """The projection it is laid out for."""
        ...

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...

    @property
    def addresses(self) -> tuple[int, int | None]:
        """What the projection's ``weight`` and ``bias`` parameters take."""
        ...


@attrs.frozen
class StackLayer:
    """What the stack reads of one decoder layer.

    Attributes:
        input_norm: The attention block's RMSNorm weight ``[hidden]``, contiguous.
        input_eps: Its epsilon.
        post_norm: The MLP block's RMSNorm weight.
        post_eps: Its epsilon.
        qkv: The fused query/key/value projection (queries, then keys, then values).
        o: The attention's output projection.
        gate_up: The fused gate and up projection (gate first).
        down: The MLP's down projection.
        window: The attention's sliding window (``paged_attention``'s ``window``): each
            query sees its last ``window`` positions; ``None``: all of them.
        q_norm: Each query head's RMSNorm weight ``[head_dim]`` before rotary (Qwen3's
            per-head norms), contiguous, or ``None``: the layer norms no head.
        k_norm: Each key head's, given with ``q_norm``.
        qk_eps: Their epsilon.
    """

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: StackWeight
    o: StackWeight
    gate_up: StackWeight
    down: StackWeight
    window: int | None = attrs.field(
        default=None, kw_only=True, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    q_norm: torch.Tensor | None = attrs.field(default=None, kw_only=True)
    k_norm: torch.Tensor | None = attrs.field(default=None, kw_only=True)
    qk_eps: float = attrs.field(default=0.0, kw_only=True)

    @k_norm.validator
    def _check_pair(self, attribute: object, value: torch.Tensor | None) -> None:
        if (value is None) != (self.q_norm is None):
            raise ValueError("the heads' norms come as a pair: q_norm and k_norm, or neither")


def stack_library(dtype: torch.dtype = torch.bfloat16) -> Callable[..., int] | None:
    """The entry point of the driver of projections whose activations are ``dtype``
    (bfloat16 or float32), or ``None`` where its library does not build (logged once as a
    warning, with the reason).

    Built (or loaded from the cache) the first time it is asked for in a process; it has no shape
    constants, so one library serves every model (:func:`~twostroke.engine.models.stack.build_stack`
    binds it to one).

    Raises:
        ValueError: a dtype the kernels are not built for.
    """
    element_defines(dtype)  # refuses another dtype
    return _library(dtype)


def stack_model(
    layers: Sequence[StackLayer],
    *,
    glue: DecoderGlue,
    projection: StackProjection,
    num_heads: int,
    num_kv_heads: int,
    intermediate: int,
) -> tuple[ctypes.Structure, tuple[object, ...]]:
    """``kernels.h``'s ``struct twostroke_model`` for these layers, and what it points into
    (to be kept alive with it): the weights' and kernels' addresses the driver reads.

    Args:
        layers: Every decoder layer, in order, its projections laid out for ``projection``.
        glue: The glue built for the model (its dtype the projection's activations').
        projection: The kernel the layers' projections are laid out for.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        intermediate: Width of the MLP.

    Raises:
        ValueError: no layers, glue of another dtype than the projection's activations, or
            layers whose shapes or kernels disagree with the arguments.
    """
    if not layers:
        raise ValueError("the stack needs at least one layer")
    if glue.dtype != projection.element:
        raise ValueError(
            f"the stack's projections take {projection.element} activations; the glue is "
            f"{glue.dtype}"
        )
    hidden, dim = glue.hidden, glue.head_dim
    attended = num_heads * dim
    shapes = {
        "qkv": (hidden, attended + 2 * num_kv_heads * dim),
        "o": (attended, hidden),
        "gate_up": (hidden, 2 * intermediate),
        "down": (intermediate, hidden),
    }
    for index, layer in enumerate(layers):
        for name, (inputs, outputs) in shapes.items():
            weight: StackWeight = getattr(layer, name)
            if (weight.in_features, weight.out_features) != (inputs, outputs):
                raise ValueError(
                    f"layer {index}'s {name} projection maps {weight.in_features} -> "
                    f"{weight.out_features}; the model's shape says {inputs} -> {outputs}"
                )
            if weight.kernel is not projection:
                raise ValueError(
                    f"layer {index}'s {name} projection is laid out for another kernel"
                )
        for scale in (layer.input_norm, layer.post_norm):
            if scale.dtype != glue.dtype or scale.shape != (hidden,) or not scale.is_contiguous():
                raise ValueError(
                    f"layer {index}'s norm weights must be contiguous {glue.dtype} [{hidden}]; "
                    f"got {scale.dtype} {tuple(scale.shape)}"
                )
        for head_scale in (layer.q_norm, layer.k_norm):
            if head_scale is not None and (
                head_scale.dtype != glue.dtype
                or head_scale.shape != (dim,)
                or not head_scale.is_contiguous()
            ):
                raise ValueError(
                    f"layer {index}'s heads' norm weights must be contiguous {glue.dtype} "
                    f"[{dim}]; got {head_scale.dtype} {tuple(head_scale.shape)}"
                )
    layer_type = structure("layer")
    weights = (layer_type * len(layers))(
        *(
            layer_type(
                layer.input_norm.data_ptr(),
                layer.post_norm.data_ptr(),
                layer.input_eps,
                layer.post_eps,
                *(getattr(layer, name).addresses[0] for name in shapes),
                *(getattr(layer, name).addresses[1] for name in shapes),
                0 if layer.window is None else layer.window,
                None if layer.q_norm is None else layer.q_norm.data_ptr(),
                None if layer.k_norm is None else layer.k_norm.data_ptr(),
                layer.qk_eps,
            )
            for layer in layers
        )
    )
    norm, rotate, silu, head_norm = glue.addresses
    model = structure("model")(
        len(layers),
        hidden,
        intermediate,
        num_heads,
        num_kv_heads,
        dim,
        dim**-0.5,
        norm,
        projection.address,
        rotate,
        silu,
        head_norm,
        weights,
    )
    return model, (weights, tuple(layers), glue, projection)


@functools.cache
def _library(dtype: torch.dtype) -> Callable[..., int] | None:
    try:
        return load_stack(dtype)
    except NativeBuildError as error:
        _log.warning(
            "twostroke: the compiled decoder stack is unavailable (%s); the layers' kernels "
            "are called one by one",
            error,
        )
        return None


def load_stack(
    dtype: torch.dtype = torch.bfloat16, *, environ: Mapping[str, str] | None = None
) -> Callable[..., int]:
    """Compile (or load from the cache) the driver of projections whose activations are
    ``dtype`` and return its entry point, once the ctypes structures it takes are checked
    against the compiler's (:func:`check_layout`).

    Args:
        dtype: bfloat16 (the panels' projections) or float32 (the GGUF blocks').
        environ: Where ``$CC`` and the cache folder are read (``os.environ`` if ``None``).

    Raises:
        NativeBuildError: no compiler, a failed compile or load, or structures that ctypes
            lays out otherwise than the compiler.
        ValueError: a dtype the kernels are not built for.
    """
    env = os.environ if environ is None else environ
    # The element type of the kernels it drives, for kernels.h's function types.
    library, path = compile_library(
        SOURCE, element_defines(dtype), "the decoder stack", env, symbols=SYMBOLS
    )
    check_layout(environ=env)
    function: Callable[..., int] = bind(library, path, "twostroke_decoder_stack")
    return function


def check_layout(
    *,
    environ: Mapping[str, str] | None = None,
    layouts: Mapping[str, type[ctypes.Structure]] | None = None,
) -> None:
    """Compare the ctypes layout of ``kernels.h``'s structures with the compiler's.

    A probe (generated from the structures' fields, built and cached like a kernel) reports
    each structure's size and each field's offset as the compiler lays them out; ctypes
    must agree on every one, or a call would hand the driver misplaced fields.

    Args:
        environ: Where ``$CC`` and the cache folder are read (``os.environ`` if ``None``).
        layouts: The ctypes structures to check, by C name (``None``: the header's,
            :func:`.header.structures`).

    Raises:
        NativeBuildError: a size or an offset differs (the message names the first), the
            probe does not build, or the header holds C its reader does not read.
    """
    env = os.environ if environ is None else environ
    if layouts is None:
        try:
            layouts = structures()
        except HeaderError as error:
            raise NativeBuildError(f"{KERNELS_HEADER.name}: {error}") from error
    names: list[str] = []
    statements: list[str] = []
    expected: list[int] = []
    for name, layout in layouts.items():
        names.append(f"the size of struct {name}")
        statements.append(f"sizeof(struct {name})")
        expected.append(ctypes.sizeof(layout))
        for field, *_ in layout._fields_:
            names.append(f"the offset of struct {name}'s {field}")
            statements.append(f"offsetof(struct {name}, {field})")
            expected.append(getattr(layout, field).offset)
    digest = hashlib.sha256(KERNELS_HEADER.read_bytes()).hexdigest()
    body = "".join(f"    out[{i}] = {value};\n" for i, value in enumerate(statements))
    source = (
        f"/* The layout of kernels.h's structures (sha256 {digest}). */\n"
        '#include "kernels.h"\n'
        f"void twostroke_layout(ptrdiff_t *out) {{\n{body}}}\n"
    )
    with tempfile.TemporaryDirectory(prefix="twostroke-layout-") as folder:
        probe = Path(folder) / "stack_layout.c"
        probe.write_text(source, encoding="utf-8")
        defines = ["-DELEMENT_BF16", f"-I{KERNELS_HEADER.parent}"]
        what = "the probe of the stack's structures"
        library, path = compile_library(probe, defines, what, env, symbols=("twostroke_layout",))
    found = (ctypes.c_ssize_t * len(expected))()
    bind(library, path, "twostroke_layout")(found)
    for name, ours, theirs in zip(names, expected, found, strict=True):
        if ours != theirs:
            raise NativeBuildError(
                f"kernels.h's structures are not laid out as ctypes lays them out: {name} is "
                f"{theirs} for the compiler, {ours} for ctypes"
            )
