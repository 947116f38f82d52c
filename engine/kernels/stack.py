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
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import attrs
import torch

from twostroke.engine.attention.kv_cache import KVCache
from twostroke.engine.attention.metadata import AttentionMetadata
from twostroke.engine.kernels.build import (
    NativeBuildError,
    bind,
    call,
    compile_library,
    element_defines,
)
from twostroke.engine.kernels.glue import DecoderGlue, rotary_inputs_fit
from twostroke.engine.kernels.header import KERNELS_HEADER, HeaderError, structures
from twostroke.engine.kernels.paged_attention import PagedDecodeKernel

__all__ = [
    "SOURCE",
    "SYMBOLS",
    "DecoderStack",
    "StackLayer",
    "StackProjection",
    "StackWeight",
    "build_stack",
    "check_layout",
    "load_stack",
    "stack_library",
]

#: The driver's C source.
SOURCE = Path(__file__).with_name("decoder_stack.c")

#: The functions this module takes from the library (:func:`.build.compile_library`
#: checks each is there).
SYMBOLS = ("twostroke_decoder_stack",)

_log = logging.getLogger(__name__)

#: The C structures the driver takes (``kernels.h``), by their part.
_STRUCTURES = {"layer": "twostroke_layer", "model": "twostroke_model", "step": "twostroke_step"}


def _structure(part: str) -> type[ctypes.Structure]:
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
    :class:`~.projection.PanelWeight` or :class:`~.gguf_blocks.BlockWeight`."""

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
    """

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: StackWeight
    o: StackWeight
    gate_up: StackWeight
    down: StackWeight


@attrs.define(eq=False)
class DecoderStack:
    """One model's decoder layers as one compiled call (see the module).

    Make it with :func:`build_stack`. It holds the addresses of the model's weights: the
    weights must outlive it and never move (the model keeps them, packed and frozen).

    Attributes:
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Width of a head.
        hidden: Width of the residual stream.
        intermediate: Width of the MLP.
        dtype: Element type of the activations (bfloat16 or float32: the projections').
        cache_dtype: Element type of the KV cache (the glue's and the attention's).
        most_tokens: The most tokens a step it runs may have (``None``: any number): beyond
            them a projection takes a path the stack does not call
            (:attr:`~.selection.Projections.stack_rows`).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    most_tokens: int | None
    _function: Callable[..., int] = attrs.field(repr=False)
    _model: ctypes.Structure = attrs.field(repr=False)
    # What the model structure points into, kept alive with it.
    _kept: tuple[object, ...] = attrs.field(repr=False)
    # The last cache's per-layer key and value addresses.
    _cache: (
        tuple[weakref.ref[KVCache], ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_void_p]]
        | None
    ) = attrs.field(default=None, repr=False)

    def runs(self, metadata: AttentionMetadata) -> bool:
        """Whether the step's attention is the compiled kernel's, which the stack calls:
        decodes only, read in place, or every chunk through the compiled prefill; and its
        tokens no more than :attr:`most_tokens`."""
        if not metadata.keys_transposed:
            return False
        if self.most_tokens is not None and metadata.positions.shape[0] > self.most_tokens:
            return False
        kernel = self._attention_kernel(metadata)
        return (
            kernel is not None
            and kernel.dtype == self.dtype
            and kernel.cache_dtype == self.cache_dtype
            and kernel.head_dim == self.head_dim
            and kernel.group * self.num_kv_heads == self.num_heads
        )

    @staticmethod
    def _attention_kernel(metadata: AttentionMetadata) -> PagedDecodeKernel | None:
        """The compiled attention a step calls once a layer, if it calls one."""
        groups = metadata.decode_groups
        if not metadata.prefills and len(groups) == 1 and groups[0].paged is not None:
            return groups[0].paged.kernel
        return None if metadata.paged_chunks is None else metadata.paged_chunks.kernel

    def __call__(
        self,
        residual: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Run every layer over the step's rows: what
        :meth:`~twostroke.engine.models.llama.DecoderLayer.forward` does layer by layer, with
        the compiled glue.

        Args:
            residual: ``[tokens, hidden]`` contiguous, the embeddings; holds the residual
                stream before the last layer's MLP output is added, afterwards.
            cos: ``[tokens, 1, head_dim]`` contiguous, from
                :func:`~twostroke.engine.models.layers.rotary_tables`.
            signed_sin: The same shape, ``sin`` with its first half negated.
            metadata: The step's layout; :meth:`runs` must say yes to it.
            kv_cache: The cache (its layers' keys held transposed).

        Returns:
            The last layer's MLP output ``[tokens, hidden]``, which the final norm adds.

        Raises:
            ValueError: tensors of another dtype, shape or layout than the stack takes, or a
                step whose attention it does not call.
            RuntimeError: an attention kernel could not allocate its scratch memory.
        """
        dtype, hidden = self.dtype, self.hidden
        tokens = residual.shape[0]
        table = (tokens, 1, self.head_dim)
        slots = metadata.slot_mapping
        if (
            residual.dtype != dtype
            or residual.shape != (tokens, hidden)
            or not residual.is_contiguous()
            or not rotary_inputs_fit(cos, signed_sin, slots, tokens, self.head_dim, dtype)
            or len(kv_cache.layers) != self._model.layers
            or kv_cache.data.dtype != self.cache_dtype
            or kv_cache.data.shape[3] != self.num_kv_heads
            or kv_cache.data.shape[5] != self.head_dim
        ):
            raise ValueError(
                f"the stack takes a contiguous {dtype} residual [tokens, {hidden}], contiguous "
                f"cos and sin {list(table)}, int64 slots [tokens] and a {self.cache_dtype} "
                "cache of "
                f"{self._model.layers} layers of {self.num_kv_heads} heads of {self.head_dim}; "
                f"got residual {residual.dtype} {tuple(residual.shape)}, cos {cos.dtype} "
                f"{tuple(cos.shape)}, sin {tuple(signed_sin.shape)}, slots {slots.dtype} "
                f"{tuple(slots.shape)}, cache {tuple(kv_cache.data.shape)} in "
                f"{kv_cache.data.dtype}"
            )
        kernel = self._attention_kernel(metadata)
        if not self.runs(metadata) or kernel is None or kernel.block_size != kv_cache.block_size:
            raise ValueError(
                "the stack calls the compiled attention for this model's heads and the "
                "cache's blocks only; this step needs another"
            )
        keys, values = self._cache_addresses(kv_cache)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim

        def rows(width: int) -> torch.Tensor:
            return torch.empty((tokens, width), dtype=dtype)

        scratch = (
            rows(hidden),
            rows((heads + 2 * kv_heads) * dim),
            rows(heads * dim),
            rows(hidden),
            rows(2 * self.intermediate),
            rows(self.intermediate),
            rows(hidden),
        )
        step = _structure("step")(
            tokens,
            residual.data_ptr(),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            slots.data_ptr(),
            kv_cache.block_size,
            keys,
            values,
            *self._attention(metadata),
            *(tensor.data_ptr() for tensor in scratch),
        )
        if call(self._function, ctypes.byref(self._model), ctypes.byref(step)):
            raise RuntimeError(
                "an attention kernel or a projection could not allocate its scratch memory"
            )
        return scratch[-1]

    def _attention(self, metadata: AttentionMetadata) -> tuple[int | None, ...]:
        """The step structure's attention fields, ``decode`` to ``chunks``."""
        groups = metadata.decode_groups
        if not metadata.prefills and len(groups) == 1 and groups[0].paged is not None:
            paged = groups[0].paged
            decode, _ = paged.kernel.addresses
            tables = paged.tables
            lengths = paged.lengths.data_ptr()
            return (decode, None, tables.data_ptr(), tables.stride(0), lengths, None, None, None, 0)
        chunks = metadata.paged_chunks
        assert chunks is not None  # runs() said so
        _, prefill = chunks.kernel.addresses
        tables = chunks.tables
        return (
            None,
            prefill,
            tables.data_ptr(),
            tables.stride(0),
            None,
            chunks.starts.data_ptr(),
            chunks.counts.data_ptr(),
            chunks.offsets.data_ptr(),
            chunks.starts.shape[0],
        )

    def _cache_addresses(
        self, kv_cache: KVCache
    ) -> tuple[ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_void_p]]:
        """Each layer's key and value tiles (a runner keeps one cache: computed once)."""
        if self._cache is not None and self._cache[0]() is kv_cache:
            return self._cache[1], self._cache[2]
        count = len(kv_cache.layers)
        pointers = ctypes.c_void_p * count
        keys = pointers(*(layer.key_rows.data_ptr() for layer in kv_cache.layers))
        values = pointers(*(layer.value_rows.data_ptr() for layer in kv_cache.layers))
        self._cache = (weakref.ref(kv_cache), keys, values)
        return keys, values


def stack_library(dtype: torch.dtype = torch.bfloat16) -> Callable[..., int] | None:
    """The entry point of the driver of projections whose activations are ``dtype``
    (bfloat16 or float32), or ``None`` where its library does not build (logged once as a
    warning, with the reason).

    Built (or loaded from the cache) the first time it is asked for in a process; it has no
    shape constants, so one library serves every model (:func:`build_stack` binds it to one).

    Raises:
        ValueError: a dtype the kernels are not built for.
    """
    element_defines(dtype)  # refuses another dtype
    return _library(dtype)


def build_stack(
    layers: Sequence[StackLayer],
    *,
    function: Callable[..., int],
    glue: DecoderGlue,
    projection: StackProjection,
    num_heads: int,
    num_kv_heads: int,
    intermediate: int,
    most_tokens: int | None = None,
) -> DecoderStack:
    """The stack for these layers, calling the driver ``function`` (:func:`stack_library`
    of ``glue.dtype``).

    Args:
        layers: Every decoder layer, in order, its projections laid out for ``projection``.
        function: The driver's entry point, built for ``glue.dtype``.
        glue: The glue built for the model (its dtype the projection's activations').
        projection: The kernel the layers' projections are laid out for.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        intermediate: Width of the MLP.
        most_tokens: The most tokens a step it runs may have (``None``: any number).

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
    layer_type = _structure("layer")
    weights = (layer_type * len(layers))(
        *(
            layer_type(
                layer.input_norm.data_ptr(),
                layer.post_norm.data_ptr(),
                layer.input_eps,
                layer.post_eps,
                *(getattr(layer, name).addresses[0] for name in shapes),
                *(getattr(layer, name).addresses[1] for name in shapes),
            )
            for layer in layers
        )
    )
    norm, rotate, silu = glue.addresses
    model = _structure("model")(
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
        weights,
    )
    return DecoderStack(
        num_heads,
        num_kv_heads,
        dim,
        hidden,
        intermediate,
        glue.dtype,
        glue.cache_dtype,
        most_tokens,
        function=function,
        model=model,
        kept=(weights, tuple(layers), glue, projection),
    )


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
