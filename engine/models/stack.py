"""The compiled decoder stack as a model drives it: :class:`DecoderStack`.

The kernels' floor holds the driver's library and the C structures it reads
(:mod:`~twostroke.engine.kernels.stack`, which also says what it is for and what it gains);
this module binds a model's layers to it and hands it each step: the step's layout and the
paged cache, which the kernels' floor does not know.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence

import attrs
import torch

from twostroke.engine.attention.kv_cache import KVCache
from twostroke.engine.attention.metadata import AttentionMetadata
from twostroke.engine.kernels.build import call
from twostroke.engine.kernels.glue import DecoderGlue, rotary_inputs_fit
from twostroke.engine.kernels.paged_attention import PagedDecodeKernel
from twostroke.engine.kernels.stack import (
    StackLayer,
    StackProjection,
    stack_model,
    structure,
)

__all__ = ["DecoderStack", "build_stack"]


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
            (:attr:`~twostroke.engine.models.choice.Projections.stack_rows`).
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
        """Whether the step calls the compiled attention once a layer, which the stack
        calls: decodes only, read in place, or every chunk through the compiled prefill;
        and its tokens no more than :attr:`most_tokens`. The kernel is the one the run's
        plan built for this model (:mod:`~twostroke.engine.models.plan`), asked once: not
        checked again here. Never where the windowed layers keep their KV apart
        (:attr:`AttentionMetadata.windowed_apart`): the stack writes every layer's cache
        through one layout."""
        if metadata.windowed_apart:
            return False
        if self.most_tokens is not None and metadata.positions.shape[0] > self.most_tokens:
            return False
        return metadata.keys_transposed and self._attention_kernel(metadata) is not None

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
        :meth:`~twostroke.engine.models.decoder_layer.DecoderLayer.forward` does layer by
        layer, with the compiled glue.

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
        step = structure("step")(
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
    """The stack for these layers, calling the driver ``function``
    (:func:`~twostroke.engine.kernels.stack.stack_library` of ``glue.dtype``).

    Args:
        layers: Every decoder layer, in order, its projections laid out for ``projection``.
        function: The driver's entry point, built for ``glue.dtype``.
        glue: The glue library built for the model (its dtype the projection's activations').
        projection: The kernel the layers' projections are laid out for.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        intermediate: Width of the MLP.
        most_tokens: The most tokens a step it runs may have (``None``: any number).

    Raises:
        ValueError: no layers, glue of another dtype than the projection's activations, or
            layers whose shapes or kernels disagree with the arguments.
    """
    model, kept = stack_model(
        layers,
        glue=glue,
        projection=projection,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate=intermediate,
    )
    return DecoderStack(
        num_heads,
        num_kv_heads,
        glue.head_dim,
        glue.hidden,
        intermediate,
        glue.dtype,
        glue.cache_dtype,
        most_tokens,
        function=function,
        model=model,
        kept=kept,
    )
