"""The decoder's element-wise glue as one compiled call each, on the CPU.

Between its matrix products a decoder layer adds to the residual stream and normalizes it
(twice), rotates its queries and keys and writes its keys and values into the cache, and
multiplies SiLU of the gate by the up projection; after the last, greedy rows take an
``argmax`` of the logits. In torch that is about twenty operators
a layer, each a pass over the rows and a call from Python that hands the GIL back and forth
with the engine's bookkeeping stroke. ``decoder_glue.c``, next to this module, does each
in one call and one pass (the GIL released around it); on SmolLM2's batch-32 decode step
the fused norms alone took the step 1.04x (float32) and 1.10x (bfloat16) faster
(docs/performance.md).

It is built and cached as the paged decode kernel is (:func:`~.build.compile_library`),
once per model shape and element type, and checked against torch's arithmetic before use;
where it cannot be, one warning is logged and the model keeps torch's operators
(:class:`~twostroke.engine.models.layers.TorchGlue`; the model reaches this library through
:class:`~twostroke.engine.models.glue.CompiledGlue`, which has the same methods: the decoder
layer is written once, against either). ``TWOSTROKE_NATIVE=0`` keeps them too. The run's
plan (:mod:`~twostroke.engine.models.plan`) takes it only where transformers' exact
arithmetic is not asked for (``exact=False``, the engine's ``dtype="auto"``): the rotary
embeddings and the cache writes are torch's bit for bit, but the norm's mean is summed in
another order and SiLU's exp is a polynomial, so those agree to float32 rounding.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch

from twostroke.engine.kernels.build import (
    CACHE_ELEMENTS,
    ELEMENTS,
    NativeBuildError,
    address,
    bind,
    call,
    compile_library,
    element_defines,
    relative_difference,
)
from twostroke.engine.kernels.reference import rms_norm, rotate_, silu_mul

__all__ = [
    "GLUE_SOURCE",
    "SYMBOLS",
    "DecoderGlue",
    "build_glue",
    "decoder_glue",
    "reference_add_rms_norm",
    "reference_head_rms_norm",
    "rotary_inputs_fit",
]

#: The kernels' C source.
GLUE_SOURCE = Path(__file__).with_name("decoder_glue.c")

#: The functions this module takes from the library (:func:`.build.compile_library`
#: checks each is there).
SYMBOLS = (
    "twostroke_add_rms_norm",
    "twostroke_rotate_write",
    "twostroke_silu_mul",
    "twostroke_argmax",
    "twostroke_head_rms_norm",
)

#: Largest difference from torch the start-up check accepts, relative to the output's
#: largest magnitude (float32: the mean's summation order, the polynomial exp; bfloat16:
#: one rounding more).
_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-6, torch.bfloat16: 1e-2}

_log = logging.getLogger(__name__)


@attrs.frozen
class DecoderGlue:
    """The compiled glue for one model shape and element type.

    Attributes:
        hidden: The width of the residual stream.
        head_dim: The width of a head.
        dtype: Element type of every tensor it takes but the cache.
        path: The shared library.
        cache_dtype: Element type of the KV cache its rotary write writes (the engine's
            ``kv_cache_dtype``): each key and value rounded to it once, from ``dtype``, as
            torch's ``.to`` rounds.
    """

    hidden: int
    head_dim: int
    dtype: torch.dtype
    path: Path
    _library: ctypes.CDLL = attrs.field(repr=False)
    cache_dtype: torch.dtype = attrs.field(kw_only=True)

    @cache_dtype.default
    def _same_as_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def addresses(self) -> tuple[int, int, int, int]:
        """Where the norm, the rotary write, SiLU times up and the heads' norm are (for
        ``decoder_stack.c``)."""
        library = self._library
        return (
            address(library.twostroke_add_rms_norm),
            address(library.twostroke_rotate_write),
            address(library.twostroke_silu_mul),
            address(library.twostroke_head_rms_norm),
        )

    def add_rms_norm(
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
        call(
            self._library.twostroke_add_rms_norm,
            residual.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            eps,
            residual.shape[0],
            out.data_ptr(),
        )
        return out

    def head_rms_norm(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> None:
        """RMSNorm of each query head and each key head in place, over ``head_dim`` values
        with the head's weights (Qwen3's norms before rotary); the values are left alone.

        Args:
            qkv: ``[tokens, (num_heads + 2 * num_kv_heads) * head_dim]``, unit stride along
                a row: each token's query heads, key heads and value heads.
            num_heads: Query heads.
            num_kv_heads: Key/value heads.
            q_weight: The queries' weights ``[head_dim]``, contiguous.
            k_weight: The keys' weights ``[head_dim]``, contiguous.
            eps: Added to the mean of the squares.

        Raises:
            ValueError: tensors of another dtype or shape than the kernel was built for.
        """
        dtype, dim = self.dtype, self.head_dim
        width = (num_heads + 2 * num_kv_heads) * dim
        weights_fit = all(
            weight.dtype == dtype and weight.shape == (dim,) and weight.is_contiguous()
            for weight in (q_weight, k_weight)
        )
        if (
            qkv.dtype != dtype
            or qkv.dim() != 2
            or qkv.shape[1] != width
            or qkv.stride(1) != 1
            or not weights_fit
        ):
            raise ValueError(
                f"the kernel takes {dtype} qkv [tokens, {width}] with unit stride along a row "
                f"and contiguous {dtype} weights [{dim}]; got qkv {qkv.dtype} "
                f"{tuple(qkv.shape)} strides {qkv.stride()}, weights {q_weight.dtype} "
                f"{tuple(q_weight.shape)} and {k_weight.dtype} {tuple(k_weight.shape)}"
            )
        call(
            self._library.twostroke_head_rms_norm,
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            num_heads,
            num_kv_heads,
            q_weight.data_ptr(),
            k_weight.data_ptr(),
            eps,
        )

    def rotate_write_slots(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        slots: torch.Tensor,
        cache: torch.Tensor,
    ) -> None:
        """Rotate queries and keys in place and write keys and values into their slots.

        What :func:`~.reference.rotate_` on the queries and keys and
        :func:`~twostroke.engine.attention.ops.write_kv` into a cache with transposed
        keys do, bit for bit, in one call.

        Args:
            qkv: ``[tokens, (num_heads + 2 * num_kv_heads) * head_dim]``, unit stride along
                a row: each token's query heads, key heads and value heads.
            num_heads: Query heads.
            num_kv_heads: Key/value heads.
            cos: ``[tokens, 1, head_dim]`` contiguous, from
                :func:`~twostroke.engine.models.layers.rotary_tables`.
            signed_sin: The same shape, ``sin`` with its first half negated.
            slots: int64 ``[tokens]``, each token's cache slot (``block * block_size +
                offset``); not checked here (the step's metadata built them).
            cache: One layer's cache, ``[2, num_blocks, num_kv_heads, block_size,
                head_dim]``, contiguous, each block's keys held transposed
                (``[head_dim, block_size]``, the ``"native"`` and ``"bag"`` kernels' layout).

        Raises:
            ValueError: tensors of another dtype or shape than the kernel was built for.
        """
        dtype, dim = self.dtype, self.head_dim
        tokens = qkv.shape[0]
        width = (num_heads + 2 * num_kv_heads) * dim
        if (
            qkv.dtype != dtype
            or qkv.dim() != 2
            or qkv.shape[1] != width
            or qkv.stride(1) != 1
            or not rotary_inputs_fit(cos, signed_sin, slots, tokens, dim, dtype)
            or cache.dtype != self.cache_dtype
            or cache.dim() != 5
            or cache.shape[0] != 2
            or cache.shape[2] != num_kv_heads
            or cache.shape[4] != dim
            or not cache.is_contiguous()
        ):
            raise ValueError(
                f"the kernel takes {dtype} qkv [tokens, {width}] with unit stride along a row, "
                f"contiguous cos and sin [tokens, 1, {dim}], int64 slots [tokens] and a "
                f"contiguous {self.cache_dtype} cache [2, blocks, {num_kv_heads}, block_size, "
                f"{dim}]; got qkv "
                f"{qkv.dtype} {tuple(qkv.shape)}, cos {cos.dtype} {tuple(cos.shape)}, sin "
                f"{tuple(signed_sin.shape)}, slots {slots.dtype} {tuple(slots.shape)}, cache "
                f"{cache.dtype} {tuple(cache.shape)}"
            )
        call(
            self._library.twostroke_rotate_write,
            qkv.data_ptr(),
            qkv.stride(0),
            tokens,
            num_heads,
            num_kv_heads,
            cos.data_ptr(),
            signed_sin.data_ptr(),
            slots.data_ptr(),
            cache.shape[3],
            cache[0].data_ptr(),
            cache[1].data_ptr(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` ``[rows, 2 * width]`` (unit stride along a row).

        Raises:
            ValueError: another dtype, an odd width, or a row of stride other than 1.
        """
        if (
            gate_up.dtype != self.dtype
            or gate_up.dim() != 2
            or gate_up.shape[1] % 2
            or gate_up.stride(1) != 1
        ):
            raise ValueError(
                f"the kernel takes {self.dtype} [rows, 2 * width] with unit stride along a "
                f"row; got {gate_up.dtype} {tuple(gate_up.shape)} strides {gate_up.stride()}"
            )
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        call(
            self._library.twostroke_silu_mul,
            gate_up.data_ptr(),
            gate_up.stride(0),
            rows,
            width,
            out.data_ptr(),
        )
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's ``argmax`` as ``torch.argmax(logits, dim=-1)`` gives it (the first of
        equal maxima; the first NaN where a row has one), int64 ``[rows]``.

        Args:
            logits: float32 ``[rows, cols]``, ``cols`` >= 1, any strides.

        Raises:
            ValueError: another dtype or shape.
        """
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] < 1:
            raise ValueError(
                f"argmax takes float32 [rows, cols >= 1]; got {logits.dtype} {tuple(logits.shape)}"
            )
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        call(
            self._library.twostroke_argmax,
            logits.data_ptr(),
            logits.shape[0],
            logits.shape[1],
            logits.stride(0),
            out.data_ptr(),
        )
        return out


def rotary_inputs_fit(
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slots: torch.Tensor,
    tokens: int,
    head_dim: int,
    dtype: torch.dtype,
) -> bool:
    """Whether the rotary tables and slots are what :meth:`DecoderGlue.rotate_write_slots`
    takes for ``tokens`` tokens: contiguous ``dtype`` tables ``[tokens, 1, head_dim]`` and
    int64 slots ``[tokens]``."""
    table = (tokens, 1, head_dim)
    return (
        cos.dtype == dtype
        and signed_sin.dtype == dtype
        and cos.shape == table
        and signed_sin.shape == table
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
        and slots.dtype == torch.int64
        and slots.shape == (tokens,)
    )


def decoder_glue(
    *, hidden: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
) -> DecoderGlue | None:
    """The glue for this shape and element types, or ``None`` where it does not run.

    Built (or loaded from the cache) and checked the first time it is asked for in a
    process; later calls return the same one. ``None`` for element types other than float32
    and bfloat16 (the KV cache: float32, float16 and bfloat16; ``None``: ``dtype``), and
    where the build or its check fails (logged once as a warning, with the reason).
    """
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    if dtype not in ELEMENTS or cache_dtype not in CACHE_ELEMENTS:
        return None
    return _glue(hidden, head_dim, dtype, cache_dtype)


@functools.cache
def _glue(
    hidden: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype
) -> DecoderGlue | None:
    try:
        return build_glue(hidden=hidden, head_dim=head_dim, dtype=dtype, cache_dtype=cache_dtype)
    except NativeBuildError as error:
        _log.warning(
            "twostroke: the native decoder glue is unavailable (%s); norms, rotary "
            "embeddings and SiLU run as torch operators instead",
            error,
        )
        return None


def build_glue(
    *,
    hidden: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    environ: Mapping[str, str] | None = None,
) -> DecoderGlue:
    """Compile (or load from the cache), load and check the glue for one shape.

    Args:
        hidden: The width of the residual stream.
        head_dim: The width of a head (even).
        dtype: float32 or bfloat16.
        cache_dtype: The KV cache's: float32, float16 or bfloat16 (``None``: ``dtype``).
        environ: Where ``$CC`` and the cache folder are read (``os.environ`` if ``None``).

    Raises:
        NativeBuildError: no compiler, a failed compile or load, or results that disagree
            with torch's; the message says which.
        ValueError: a width below 1, an odd head, or an element type it is not built for.
    """
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= 2 (rotary halves), got {head_dim}")
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    env = os.environ if environ is None else environ
    defines = [f"-DHIDDEN={hidden}", f"-DHEAD_DIM={head_dim}", "-ffp-contract=off"]
    defines += element_defines(dtype, cache_dtype)
    library, path = compile_library(
        GLUE_SOURCE, defines, "the decoder glue", env, symbols=SYMBOLS, dtype=dtype
    )
    for name in SYMBOLS:
        bind(library, path, name)
    glue = DecoderGlue(hidden, head_dim, dtype, path, library=library, cache_dtype=cache_dtype)
    _check(glue)
    return glue


def reference_add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :meth:`DecoderGlue.add_rms_norm` computes, as transformers does: ``(sum, normed)``.

    Nothing is modified: the sum is a new tensor.
    """
    total = residual if delta is None else residual + delta
    return total, rms_norm(total, weight, eps)


def reference_head_rms_norm(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """What :meth:`DecoderGlue.head_rms_norm` makes of ``qkv``, as transformers' Qwen3
    computes it (:func:`~.reference.rms_norm` of each head); a new tensor, ``qkv`` left as
    it is."""
    out = qkv.clone()
    tokens, dim = qkv.shape[0], q_weight.shape[0]
    q_width, k_width = num_heads * dim, num_kv_heads * dim
    for weight, start, stop in ((q_weight, 0, q_width), (k_weight, q_width, q_width + k_width)):
        heads = out[:, start:stop].view(tokens, -1, dim)
        heads.copy_(rms_norm(heads, weight, eps))
    return out


def _check(glue: DecoderGlue) -> None:
    """Run each kernel on random rows against torch's operators.

    Enough rows for a call to run on the thread team too; the rotary write into a cache of
    shuffled blocks.
    """
    generator = torch.Generator().manual_seed(0)
    hidden, dim, dtype = glue.hidden, glue.head_dim, glue.dtype

    def random(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(dtype)

    differences = []
    for rows, with_delta in ((3, False), (70, True)):
        residual, weight = random(rows, hidden, scale=4), (1 + random(hidden) / 4).to(dtype)
        delta = random(rows, hidden) if with_delta else None
        total, expected = reference_add_rms_norm(residual, delta, weight, 1e-5)
        got = glue.add_rms_norm(residual, delta, weight, 1e-5)
        differences.append(relative_difference(got, expected))
        differences.append(float((residual.float() - total.float()).abs().max()))
        gate_up = random(rows, 2 * hidden, scale=3)
        differences.append(relative_difference(glue.silu_mul(gate_up), silu_mul(gate_up)))
    heads, kv_heads, block_size, tokens = 3, 1, 4, 70
    qkv = random(tokens, (heads + 2 * kv_heads) * dim, scale=3)
    q_weight, k_weight = (1 + random(dim) / 4).to(dtype), (1 + random(dim) / 4).to(dtype)
    expected_heads = reference_head_rms_norm(qkv, heads, kv_heads, q_weight, k_weight, 1e-6)
    glue.head_rms_norm(qkv, heads, kv_heads, q_weight, k_weight, 1e-6)
    differences.append(relative_difference(qkv, expected_heads))
    qkv = random(tokens, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(tokens, 1, dim, generator=generator) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(block_size * 20, generator=generator)[:tokens]
    cache = torch.zeros(2, 20, kv_heads, block_size, dim, dtype=glue.cache_dtype)
    expected_qkv = qkv.clone()
    rotate_(expected_qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    kv = expected_qkv[:, heads * dim :].view(tokens, 2, kv_heads, dim).to(glue.cache_dtype)
    expected_cache = torch.zeros_like(cache)
    key_tiles = expected_cache[0].view(20, kv_heads, dim, block_size)
    block, within = slots // block_size, slots % block_size
    for h in range(kv_heads):
        key_tiles[block, h, :, within] = kv[:, 0, h]
        expected_cache[1][block, h, within] = kv[:, 1, h]
    glue.rotate_write_slots(qkv, heads, kv_heads, cos, sin, slots, cache)
    if not (torch.equal(qkv, expected_qkv) and torch.equal(cache, expected_cache)):
        differences.append(float("inf"))  # the rotary write is torch's bit for bit
    logits = torch.randn(5, 3 * hidden + 1, generator=generator)
    logits[1, 7 % logits.shape[1]] = logits[1].max()  # a tie: the first index wins
    logits[3, -1] = float("nan")
    if not torch.equal(glue.argmax(logits), logits.argmax(dim=-1)):
        differences.append(float("inf"))
    difference = max(differences)
    if not difference <= _TOLERANCE[dtype]:
        raise NativeBuildError(
            f"its check differs from torch by {difference:.3g} (at most "
            f"{_TOLERANCE[dtype]:g} allowed for {dtype})"
        )
