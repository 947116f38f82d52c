"""A step's decoder layers in one compiled call, where every kernel they need is compiled.

With the bfloat16 projections (:mod:`.projection`), the glue (:mod:`.glue`)
and the paged attention (:mod:`.paged_attention`) all compiled, a decoder layer is nine
calls into C, and Python only walks between them: checks, output tensors, ``ctypes``
argument conversion, 30 layers a step. ``decoder_stack.c`` makes the same calls in the same
order from C, so a step's layers are one foreign call: its results are the per-layer path's
bit for bit (a test holds it to that), and the whole stack runs without the GIL, which the
engine's bookkeeping stroke wants meanwhile.

Measured on SmolLM2-135M in bfloat16 (AMD EPYC Zen 4, AVX512-BF16, 2 threads), both paths
alternating in one process: a step of one decode 14.13 ms layer by layer, 11.08 with the
stack; of 32 decodes 41.24 and 37.02 (docs/performance.md, "The decoder stack in one call").

The library has no shape constants and does no arithmetic, so it is built once a machine
and has no check of its own: the kernels it calls passed theirs. Where it does not build,
one warning is logged and the model keeps calling the kernels layer by layer.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
import torch

from twostroke.engine.attention.kv_cache import KVCache
from twostroke.engine.attention.metadata import AttentionMetadata
from twostroke.engine.kernels.build import NativeBuildError, call, compile_library
from twostroke.engine.kernels.glue import DecoderGlue, rotary_inputs_fit
from twostroke.engine.kernels.paged_attention import PagedDecodeKernel
from twostroke.engine.kernels.projection import PanelWeight, ProjectionKernel

__all__ = [
    "SOURCE",
    "SYMBOLS",
    "DecoderStack",
    "StackLayer",
    "build_stack",
    "load_stack",
    "stack_library",
]

#: The driver's C source.
SOURCE = Path(__file__).with_name("decoder_stack.c")

#: The functions this module takes from the library (:func:`.build.compile_library`
#: checks each is there).
SYMBOLS = ("twostroke_decoder_stack",)

_log = logging.getLogger(__name__)

_POINTER, _SIZE, _FLOAT = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_float


# The structures of decoder_stack.c, field for field.
class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _POINTER),
        ("post_norm", _POINTER),
        ("input_eps", _FLOAT),
        ("post_eps", _FLOAT),
        *((name, _POINTER) for name in ("qkv", "o", "gate_up", "down")),
        *((name, _POINTER) for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias")),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _SIZE) for name in ("layers", "hidden", "intermediate", "heads")),
        ("kv_heads", _SIZE),
        ("head_dim", _SIZE),
        ("scale", _FLOAT),
        *((name, _POINTER) for name in ("norm", "projection", "rotate", "silu")),
        ("layer", ctypes.POINTER(_Layer)),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _SIZE),
        *((name, _POINTER) for name in ("residual", "cos", "sin", "slots")),
        ("block_size", _SIZE),
        ("keys", ctypes.POINTER(_POINTER)),
        ("values", ctypes.POINTER(_POINTER)),
        *((name, _POINTER) for name in ("decode", "prefill", "tables")),
        ("table_stride", _SIZE),
        *((name, _POINTER) for name in ("lengths", "starts", "counts", "offsets")),
        ("chunks", _SIZE),
        *(
            (name, _POINTER)
            for name in ("normed", "qkv", "attended", "projected", "gate_up", "mixed", "delta")
        ),
    ]


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
    qkv: PanelWeight
    o: PanelWeight
    gate_up: PanelWeight
    down: PanelWeight


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
        dtype: Element type of the activations and the cache (bfloat16).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    _function: Callable[..., int] = attrs.field(repr=False)
    _model: _Model = attrs.field(repr=False)
    # What the model structure points into, kept alive with it.
    _kept: tuple[object, ...] = attrs.field(repr=False)
    # The last cache's per-layer key and value addresses.
    _cache: (
        tuple[weakref.ref[KVCache], ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_void_p]]
        | None
    ) = attrs.field(default=None, repr=False)

    def runs(self, metadata: AttentionMetadata) -> bool:
        """Whether the step's attention is the compiled kernel's, which the stack calls:
        decodes only, read in place, or every chunk through the compiled prefill."""
        if not metadata.keys_transposed:
            return False
        kernel = self._attention_kernel(metadata)
        return (
            kernel is not None
            and kernel.dtype == self.dtype
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
            or kv_cache.data.dtype != dtype
            or kv_cache.data.shape[3] != self.num_kv_heads
            or kv_cache.data.shape[5] != self.head_dim
        ):
            raise ValueError(
                f"the stack takes a contiguous {dtype} residual [tokens, {hidden}], contiguous "
                f"cos and sin {list(table)}, int64 slots [tokens] and a {dtype} cache of "
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
        step = _Step(
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
            raise RuntimeError("the paged attention kernel could not allocate its scratch memory")
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
        keys = (_POINTER * count)(*(layer.key_rows.data_ptr() for layer in kv_cache.layers))
        values = (_POINTER * count)(*(layer.value_rows.data_ptr() for layer in kv_cache.layers))
        self._cache = (weakref.ref(kv_cache), keys, values)
        return keys, values


def stack_library() -> Callable[..., int] | None:
    """The driver's entry point, or ``None`` where its library does not build (logged once
    as a warning, with the reason).

    Built (or loaded from the cache) the first time it is asked for in a process; it has no
    shape constants, so one library serves every model (:func:`build_stack` binds it to one).
    """
    return _library()


def build_stack(
    layers: Sequence[StackLayer],
    *,
    function: Callable[..., int],
    glue: DecoderGlue,
    projection: ProjectionKernel,
    num_heads: int,
    num_kv_heads: int,
    intermediate: int,
) -> DecoderStack:
    """The stack for these layers, calling the driver ``function`` (:func:`stack_library`).

    Args:
        layers: Every decoder layer, in order, its projections packed for ``projection``.
        function: The driver's entry point.
        glue: The glue built for the model (bfloat16).
        projection: The kernel the layers' projections are packed for.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        intermediate: Width of the MLP.

    Raises:
        ValueError: no layers, glue of another dtype than bfloat16, or layers whose shapes
            disagree with the arguments.
    """
    if not layers:
        raise ValueError("the stack needs at least one layer")
    if glue.dtype != torch.bfloat16:
        raise ValueError(f"the stack runs the bfloat16 projections; the glue is {glue.dtype}")
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
            weight: PanelWeight = getattr(layer, name)
            if (weight.in_features, weight.out_features) != (inputs, outputs):
                raise ValueError(
                    f"layer {index}'s {name} projection maps {weight.in_features} -> "
                    f"{weight.out_features}; the model's shape says {inputs} -> {outputs}"
                )
            if weight.kernel is not projection:
                raise ValueError(f"layer {index}'s {name} projection is packed for another kernel")
        for scale in (layer.input_norm, layer.post_norm):
            if scale.dtype != glue.dtype or scale.shape != (hidden,) or not scale.is_contiguous():
                raise ValueError(
                    f"layer {index}'s norm weights must be contiguous {glue.dtype} [{hidden}]; "
                    f"got {scale.dtype} {tuple(scale.shape)}"
                )
    structures = (_Layer * len(layers))(
        *(
            _Layer(
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
    model = _Model(
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
        structures,
    )
    return DecoderStack(
        num_heads,
        num_kv_heads,
        dim,
        hidden,
        intermediate,
        glue.dtype,
        function=function,
        model=model,
        kept=(structures, tuple(layers), glue, projection),
    )


@functools.cache
def _library() -> Callable[..., int] | None:
    try:
        return load_stack()
    except NativeBuildError as error:
        _log.warning(
            "twostroke: the compiled decoder stack is unavailable (%s); the layers' kernels "
            "are called one by one",
            error,
        )
        return None


def load_stack(*, environ: Mapping[str, str] | None = None) -> Callable[..., int]:
    """Compile (or load from the cache) the driver and return its entry point.

    Args:
        environ: Where ``$CC`` and the cache folder are read (``os.environ`` if ``None``).

    Raises:
        NativeBuildError: no compiler, or a failed compile or load.
    """
    env = os.environ if environ is None else environ
    library, _ = compile_library(SOURCE, [], "the decoder stack", env, symbols=SYMBOLS)
    function: Callable[..., int] = library.twostroke_decoder_stack
    function.restype = ctypes.c_int  # type: ignore[attr-defined]
    function.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]  # type: ignore[attr-defined]
    return function
