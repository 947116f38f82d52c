"""What runs the decoder here, chosen once when a model loads: :class:`CpuKernels`.

Four parts of a step can run as twostroke's compiled kernels or as torch's operators: the
element-wise glue between the matrix products (:mod:`.glue`), the projections (oneDNN's packed
weights, fbgemm's reduced-precision ones, or the compiled bfloat16 panels of
:mod:`~twostroke.engine.kernels.projection`), the attention over the paged cache
(:mod:`~twostroke.engine.kernels.paged_attention`, or the ``"bag"`` kernel) and the whole stack of
layers in one call (:mod:`.stack`). Which one runs follows from the CPU (its personality,
:mod:`twostroke.gpu.isa`, and what builds on it), the dtype, whether transformers' exact arithmetic
is asked for, and the weight form asked for. :func:`select_kernels` decides all four at once, when
the model loads; the model and its runner then read the one frozen value it returns, and nothing
decides again (not per step: a step's attention layout receives the kernel chosen here). One INFO
line says what runs, and why where a compiled kernel does not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal, get_args

import attrs
import torch

from twostroke.engine.attention.kernels import AttentionKernel, default_kernel, native_kernel
from twostroke.engine.kernels.build import CACHE_ELEMENTS, ELEMENTS, native_wanted
from twostroke.engine.kernels.gguf_blocks import BlockKernel
from twostroke.engine.kernels.glue import decoder_glue
from twostroke.engine.kernels.projection import ProjectionKernel, projection_kernel
from twostroke.engine.kernels.stack import stack_library
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.forms import QUANTIZATIONS, Quantization, WeightForm, can_pack
from twostroke.engine.models.glue import CompiledGlue
from twostroke.engine.models.layers import Glue, TorchGlue
from twostroke.engine.models.quantization import (
    QuantizationUnavailable,
    kernel_available,
    unavailable_message,
)
from twostroke.gpu.isa import cpu_personality
from twostroke.states.errors import EngineError

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "CpuKernels",
    "DeterminismUnavailable",
    "Projections",
    "auto_kv_cache_dtype",
    "auto_quantization",
    "select_kernels",
    "torch_kernels",
]

#: The KV cache's block size the compiled attention is built and checked for at load unless
#: another is given: the engine's default (``EngineConfig.block_size``).
DEFAULT_BLOCK_SIZE = 16


class DeterminismUnavailable(EngineError, ValueError):
    """``deterministic=True`` was asked for, and a part of the run this model would take
    sums a token's numbers in an order that depends on the tokens beside it, with no other
    arrangement here that does not (transformers' exact float32 arithmetic, ``int8``
    weights, an attention other than the compiled one).

    Attributes:
        reason: Which part, and why.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"deterministic=True: {reason}, so a request's tokens could depend on the requests "
            "beside it (docs/models.md, 'One answer per request')"
        )


@attrs.frozen
class Projections:
    """How a model's projections hold their weights, and so which kernel multiplies by them.

    Attributes:
        layers: The decoder layers' projections (q/k/v, output, gate/up, down).
        head: The output projection: never quantized, as vLLM leaves ``lm_head`` at full
            precision (a tied one keeps the embedding dense for lookups besides).
        kernel: The compiled bfloat16 projection the ``"panels"`` forms are laid out for.
        blocks: The compiled GGUF block products the ``"blocks"`` forms compute with.
        sixteen: With ``"blocks"``, the form of a decoder projection the file holds in 16
            bits (F16, or BF16 values float16 holds): ``"fp16"`` where fbgemm's kernel runs
            (the values exact, half float32's bytes), else ``"dense"``.
        panel_rows: With ``"panels"``, the most rows the panels multiply; more go to a
            oneDNN-packed copy of each weight (``None``: the panels take every row count).
            Where oneDNN's bfloat16 products run on AMX tiles and the panels' own do not
            (:data:`AMX_PANEL_ROWS`).
    """

    layers: WeightForm
    head: WeightForm
    kernel: ProjectionKernel | None = None
    blocks: BlockKernel | None = None
    sixteen: WeightForm = "dense"
    panel_rows: int | None = None

    @property
    def stack_rows(self) -> int | None:
        """The most tokens a step the compiled stack runs may have (``None``: any): beyond
        them a projection takes a path the stack does not call (the blocks' dense one,
        oneDNN's AMX products), and the step runs layer by layer."""
        if self.layers == "blocks" and self.blocks is not None:
            return self.blocks.most_rows
        return self.panel_rows if self.layers == "panels" else None

    @property
    def quantization(self) -> Quantization | None:
        """The layers' reduced weight precision, if any."""
        layers = self.layers
        return layers if layers == "fp16" or layers == "int8" else None


@attrs.frozen
class CpuKernels:
    """What runs a model's decoder on this machine (see the module).

    On any device but the CPU every part is torch's (the attention its device's default).

    Attributes:
        glue: The element-wise glue: the compiled one
            (:class:`~twostroke.engine.models.glue.CompiledGlue`) or torch's operators
            (:class:`~twostroke.engine.models.layers.TorchGlue`).
        projection: The projections' weight forms.
        attention: How decodes and prefill chunks attend over the cache. ``"native"`` is
            compiled per block size: :meth:`CausalLM.attention_for
            <twostroke.engine.models.decoder.CausalLM.attention_for>` builds it for a
            cache.
        stack: The compiled driver of every layer in one call (its library's entry point;
            the model binds it to its packed weights), where the glue, the projections and
            the attention all run compiled; else ``None``.
        reasons: Why each part that does not run compiled does not, as ``(part, reason)``.
        cache_dtype: The KV cache's element type (``kv_cache_dtype``); ``None``: the
            model's dtype.
        row_dependences: Why a token's numbers can depend on the tokens that share its
            steps, a reason per part that can (:func:`row_dependences`); none: every part
            sums a token's numbers the same way whatever runs beside it, and the run is
            batch-invariant (:attr:`deterministic`).
        experts_by_row: A mixture of experts multiplies each token's rows by its experts
            one row at a time (``deterministic=True``): one product shape whatever shares
            the step, at the cost of a product a row; else each expert's rows at once.
    """

    glue: Glue
    projection: Projections
    attention: AttentionKernel
    stack: Callable[..., int] | None = attrs.field(default=None, repr=False)
    reasons: tuple[tuple[str, str], ...] = ()
    cache_dtype: torch.dtype | None = None
    row_dependences: tuple[str, ...] = ()
    experts_by_row: bool = False

    @property
    def deterministic(self) -> bool:
        """Whether a request's tokens and logprobs are a function of the model, its prompt,
        its parameters and its seed alone, whatever shares its steps (chunking, prefix-cache
        hits, preemption, drafts, the pipeline depth included)."""
        return not self.row_dependences

    def describe(self) -> str:
        """One line: what runs each part, and why where a compiled kernel does not."""
        reasons = dict(self.reasons)

        def why(part: str) -> str:
            return f" ({reasons[part]})" if part in reasons else ""

        projection = self.projection
        head = "" if projection.head == projection.layers else f", output {projection.head}"
        compiled = isinstance(self.glue, CompiledGlue)
        cache = "" if self.cache_dtype is None else f" over a {_name(self.cache_dtype)} cache"
        parts = [
            f"glue {'compiled' if compiled else 'torch'}{why('glue')}",
            f"projections {projection.layers}{head}{why('projections')}",
            f"attention {self.attention}{cache}{why('attention')}",
            f"stack {'compiled' if self.stack is not None else 'off'}{why('stack')}",
            *(["experts row by row"] if self.experts_by_row else []),
            "batch-invariant"
            if self.deterministic
            else f"not batch-invariant ({'; '.join(self.row_dependences)})",
        ]
        return "; ".join(parts)


_ATTENTION = "the attention"


def _attention_dependence(attention: AttentionKernel) -> tuple[str, ...]:
    """Why ``attention`` makes a token's numbers depend on its step, if it does: only the
    compiled kernel attends every token, a decode's and a chunk's, through one body."""
    if attention == "native":
        return ()
    return (
        f"{_ATTENTION} is {attention!r}: decodes and prefill chunks are summed by other operators",
    )


def fp16_rows_dependent() -> bool:
    """Whether fbgemm's fp16 products sum a row in an order that changes with the rows beside
    it here: its AVX2 kernels do (measured: SmolLM2's 576 x 1536 projection, a row's result
    among 2 to 300 rows against alone); its AVX-512 kernels and its reference code do not."""
    return cpu_personality().rung.fbgemm == "AVX2"


def _form_dependence(form: WeightForm, projection: Projections, dtype: torch.dtype) -> str | None:
    """Why products in ``form`` make a row's result depend on the rows beside it, if they
    do (each measured at 1 to 300 rows, on every rung; the ``isa`` tests hold the policy)."""
    if form == "dense" and dtype == torch.float32:
        return (
            "are MKL's float32 products (transformers' exact arithmetic, dtype='float32'), "
            "which sum a row another way as the rows change"
        )
    if form == "dense" and dtype != torch.bfloat16:
        return f"are {_name(dtype)} products, not measured to sum a row alike among others"
    if form == "fp16" and fp16_rows_dependent():
        return (
            "are fbgemm's fp16 products, whose AVX2 kernels sum a row another way as the rows "
            "change"
        )
    if form == "int8":
        return "are fbgemm's int8 products, which quantize a step's rows with one scale"
    if form == "panels" and projection.panel_rows is not None:
        return (
            f"switch from the compiled panels to oneDNN's AMX products above "
            f"{projection.panel_rows} rows"
        )
    if form == "blocks" and projection.blocks is not None:
        dense_rows = projection.blocks.dense_rows
        if dense_rows is not None:
            dense = str(projection.blocks.dense_dtype).removeprefix("torch.")
            return f"switch from the GGUF blocks to a dense {dense} product from {dense_rows} rows"
    return None


def row_dependences(
    projection: Projections, attention: AttentionKernel, dtype: torch.dtype
) -> tuple[str, ...]:
    """Why a token's numbers can depend on the tokens that share its steps under these
    kernels: a reason per part that can, none where the run is batch-invariant.

    Every other part sums a row the same way whatever the rows beside it: the compiled glue
    and torch's (row by row), oneDNN's packed products in float32 (a one-row product
    computed as two: :class:`~twostroke.engine.models.forms.OneDNNWeight`) and in
    bfloat16, the compiled panels and tiles, the GGUF blocks block by block, the sampler.
    """
    reasons = list(_attention_dependence(attention))
    parts = [("the decoder's projections", projection.layers)]
    if projection.head != projection.layers:
        parts.append(("the output projection", projection.head))
    for part, form in parts:
        why = _form_dependence(form, projection, dtype)
        if why is not None:
            reasons.append(f"{part} {why}")
    if projection.layers == "blocks":
        why = _form_dependence(projection.sixteen, projection, dtype)
        if why is not None:
            reasons.append(f"a GGUF file's 16-bit matrices {why}")
    return tuple(reasons)


#: Where oneDNN's bfloat16 products run on AMX tiles and the compiled panels do not (their
#: library built by a compiler without AMX: :attr:`ProjectionKernel.tiles
#: <twostroke.engine.kernels.projection.ProjectionKernel.tiles>`), the most rows the panels
#: multiply: from 9 rows on oneDNN's packed products are faster. SmolLM2's four projections
#: of a layer, 2 threads, Intel Xeon with AMX (2026-12-05), the vector panels against oneDNN
#: packed: 0.49x the time at 1 row, 0.64 at 4, 1.02 at 8, 1.48 at 12, 1.92 at 16, 3.18 at
#: 32, 3.73 at 256 (docs/performance.md).
AMX_PANEL_ROWS = 8


def torch_kernels(device: torch.device) -> CpuKernels:
    """torch's operators everywhere, dense weights, the device's default attention: what a
    model computes with before :func:`select_kernels` chose for it."""
    projection, attention = Projections("dense", "dense"), default_kernel(device)
    # Dense float32 products (MKL's) and a torch attention: never batch-invariant.
    dependences = row_dependences(projection, attention, torch.float32)
    return CpuKernels(TorchGlue(), projection, attention, row_dependences=dependences)


def select_kernels(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    exact: bool,
    quantization: Quantization | Literal["auto"] | None = None,
    pack: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    attention: AttentionKernel | None = None,
    blocks: BlockKernel | None = None,
    kv_cache_dtype: torch.dtype | Literal["auto"] | None = None,
    deterministic: bool | None = None,
) -> CpuKernels:
    """Choose every kernel of a model once, building (or loading from the cache) the
    compiled ones that run here, and log the choice in one INFO line.

    Args:
        config: The model's shape.
        dtype: Its weights' and activations' dtype.
        device: Where it runs.
        exact: Keep transformers' arithmetic exactly: no compiled glue, no compiled
            bfloat16 projections, float32 products MKL's (unpacked).
        quantization: The decoder projections' weights in ``"fp16"`` or ``"int8"`` (fbgemm;
            where its kernel does not run, a :class:`QuantizationUnavailable` warning and
            full precision); ``"auto"``: fp16 where ``exact`` is false, the dtype float32
            and fp16's kernel runs on this CPU (the engine's ``quantization="auto"``, see
            :class:`~twostroke.engine.config.EngineConfig`), else full precision without a
            word; ``None``: full precision.
        pack: Lay full-precision weights out for a faster kernel where one runs (oneDNN's
            packing, the compiled bfloat16 panels); ``False`` keeps ``F.linear``'s.
        block_size: The KV cache's block size, for which the compiled attention is built
            and checked.
        attention: The attention asked for (``None``: the fastest that runs here).
        blocks: The GGUF block products, where the loader keeps a GGUF file's blocks as
            stored (its decision: :func:`~twostroke.engine.models.loading.load_model`):
            every projection, the output one included, computes in the ``"blocks"`` form
            (those whose file tensor is in 16 bits take fp16 where fbgemm runs, the others
            stay dense), and ``quantization`` is not consulted.
        kv_cache_dtype: The KV cache's element type: float32, float16 or bfloat16, read
            and written in place by the compiled attention and glue (the other attention
            kernels cast what they gather; ``"bag"`` cannot, so a cache in another dtype
            than the activations attends with ``"matmul"`` where the compiled kernel does
            not run); ``"auto"``: :func:`auto_kv_cache_dtype`; ``None``: ``dtype``.
        deterministic: ``True``: the batch-invariant arrangement (:func:`row_dependences`
            finds nothing), at its cost where the fastest one is not invariant: float32
            weights packed for oneDNN instead of fbgemm's fp16 on AVX2 (``quantization``
            ``"auto"``), the compiled panels at every row count where oneDNN's AMX products
            would take large ones, the GGUF blocks block by block where the dense path
            would take long prefills (``blocks`` must be :meth:`BlockKernel.block_by_block
            <twostroke.engine.kernels.gguf_blocks.BlockKernel.block_by_block>` already: the
            loader made it); where no arrangement is invariant,
            :class:`DeterminismUnavailable`. ``None`` (the engine's default) or ``False``:
            the fastest arrangement, invariant or not (:attr:`CpuKernels.deterministic`
            says which).

    Raises:
        ValueError: ``quantization``, ``attention`` or ``kv_cache_dtype`` is not one of its
            values, or ``"bag"`` is asked for over a cache in another dtype.
        DeterminismUnavailable: ``deterministic=True``, and a part of the run cannot be
            batch-invariant here.
    """
    if attention is not None:
        _check_attention(attention)
    cache = _cache_dtype(kv_cache_dtype, dtype=dtype, device=device, exact=exact)
    if attention == "bag" and cache != dtype:
        raise ValueError(_BAG_CACHE.format(_name(cache)))
    if quantization is not None and quantization != "auto" and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be 'auto', one of {QUANTIZATIONS} or None, got {quantization!r}"
        )
    reasons: list[tuple[str, str]] = []

    def because(part: str, reason: str | None) -> None:
        if reason is not None:
            reasons.append((part, reason))

    chosen, why = _attention(config, dtype, device, block_size, attention, cache)
    if chosen != "native" and cache != dtype and kv_cache_dtype == "auto":
        cache = dtype  # the 16-bit cache is for the compiled kernel, which does not run
        chosen, why = _attention(config, dtype, device, block_size, attention, cache)
    because("attention", why)
    glue, why = _glue(config, dtype, device, exact, cache)
    because("glue", why)
    if blocks is not None:
        sixteen = _sixteen(device, deterministic=bool(deterministic))
        projection, why = Projections("blocks", "blocks", blocks=blocks, sixteen=sixteen), None
    else:
        projection, why = _projections(
            config, dtype, device, exact, quantization, pack, deterministic=bool(deterministic)
        )
    because("projections", why)
    stack, why = _stack(glue, projection, config)
    because("stack", why)
    if device.type == "cpu":
        dependences = row_dependences(projection, chosen, dtype)
        if config.num_experts and not deterministic:
            # Each expert multiplies the rows that picked it, as many as picked it this step,
            # in the projections' form (engine.models.experts); asked for determinism, it
            # multiplies them one row at a time instead (experts_by_row).
            dependences += (
                "the experts' products take as many rows as picked each expert, and may sum "
                "a row another way as that count changes",
            )
    else:
        dependences = (
            f"on {device.type} the kernels are torch's, whose products and attention change "
            "their summation order with the batch",
        )
    if deterministic and dependences:
        raise DeterminismUnavailable(dependences[0])
    kernels = CpuKernels(
        glue,
        projection,
        chosen,
        stack,
        tuple(reasons),
        None if cache == dtype else cache,
        dependences,
        experts_by_row=bool(config.num_experts) and bool(deterministic),
    )
    return kernels


def _check_attention(attention: str) -> None:
    if attention not in get_args(AttentionKernel):
        raise ValueError(
            f"attention_kernel must be one of {get_args(AttentionKernel)} or None, got "
            f"{attention!r}"
        )


_BAG_CACHE = (
    "the 'bag' attention reads the KV cache in the activations' dtype; a {} cache "
    "(kv_cache_dtype) attends with 'native', 'matmul' or 'sdpa'"
)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def auto_kv_cache_dtype(*, dtype: torch.dtype, device: torch.device, exact: bool) -> torch.dtype:
    """What ``kv_cache_dtype="auto"`` holds the KV cache in: float16 where the activations
    are float32 on a CPU, transformers' exact arithmetic is not asked for, the compiled
    kernels run and the instruction set converts half precision in one instruction (F16C,
    in every rung from ``avx2`` up: :mod:`twostroke.gpu.isa`); else ``dtype``.

    Half the bytes a decode reads from the cache, at a measured cost to quality
    (docs/models.md). Float16 rather than bfloat16 even where bfloat16 is native: it keeps
    three more bits of each key and value, and converts as fast; activations already in
    16 bits keep their own dtype. Where the compiled attention turns out not to run,
    :func:`select_kernels` keeps ``dtype`` after all (the ``"bag"`` kernel reads the cache
    in the activations' dtype only).
    """
    wanted = (
        not exact
        and dtype == torch.float32
        and _compiled_unwanted(device) is None
        and cpu_personality().rung.vector_bits >= 256
    )
    return torch.float16 if wanted else dtype


def _cache_dtype(
    asked: torch.dtype | Literal["auto"] | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    exact: bool,
) -> torch.dtype:
    if asked is None:
        return dtype
    if asked == "auto":
        return auto_kv_cache_dtype(dtype=dtype, device=device, exact=exact)
    if asked not in CACHE_ELEMENTS:
        raise ValueError(
            f"kv_cache_dtype must be 'auto', one of {tuple(CACHE_ELEMENTS)} or None, got {asked!r}"
        )
    return asked


def _compiled_unwanted(device: torch.device) -> str | None:
    """Why no compiled kernel runs on ``device`` at all, if none does."""
    if device.type != "cpu":
        return f"compiled kernels run on the CPU, not {device.type}"
    if not native_wanted():
        return "TWOSTROKE_NATIVE=0"
    return None


def _glue(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, exact: bool, cache: torch.dtype
) -> tuple[Glue, str | None]:
    """The compiled glue where transformers' exact arithmetic is not asked for (its norms
    and SiLU agree with torch's to float32 rounding, not bit for bit), else torch's."""
    if exact:
        return TorchGlue(), "exact arithmetic asked for"
    unwanted = _compiled_unwanted(device)
    if unwanted is not None:
        return TorchGlue(), unwanted
    glue = decoder_glue(
        hidden=config.hidden_size, head_dim=config.head_dim, dtype=dtype, cache_dtype=cache
    )
    if glue is None:
        if dtype not in ELEMENTS:
            return TorchGlue(), f"none is built for {dtype}"
        return TorchGlue(), "it did not build or check here: see the warning"
    # The compiled glue computes Llama's norm and SiLU; a model's other arithmetic runs as
    # torch's operators beside it (its layers pick them), which the plan's line says.
    torch_parts = [
        part
        for part, differs in (
            ("its (offset + weight) norms", config.norm_offset is not None),
            (f"its {config.hidden_activation} MLP", config.hidden_activation != "silu"),
        )
        if differs
    ]
    if torch_parts:
        return CompiledGlue(glue), f"{' and '.join(torch_parts)} as torch's operators"
    return CompiledGlue(glue), None


def _sixteen(device: torch.device, *, deterministic: bool) -> WeightForm:
    """The form of a GGUF file's 16-bit decoder matrices beside its blocks: fbgemm's fp16
    (the values exact, half float32's bytes) where its kernel runs (and, ``deterministic``,
    sums a row the same way whatever the rows beside it), else dense; ``deterministic``,
    float32 packed for oneDNN rather than dense (MKL's products are not invariant)."""
    if kernel_available("fp16", device) and not (deterministic and fp16_rows_dependent()):
        return "fp16"
    if deterministic and can_pack(torch.float32, device, exact=False):
        return "onednn"
    return "dense"


def auto_quantization(
    *, dtype: torch.dtype, device: torch.device, exact: bool
) -> Quantization | None:
    """What ``quantization="auto"`` holds the decoder projections in (for a model whose
    blocks are not computed as stored): fp16 where the activations are float32 on a CPU,
    transformers' exact arithmetic is not asked for and fbgemm's fp16 kernel runs here (the
    measured policy, docs/models.md); else ``None``, the dtype."""
    automatic = not exact and dtype == torch.float32 and device.type == "cpu"
    return "fp16" if automatic and kernel_available("fp16", device) else None


def _projections(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    exact: bool,
    quantization: Quantization | Literal["auto"] | None,
    pack: bool,
    *,
    deterministic: bool,
) -> tuple[Projections, str | None]:
    """The layers' and the output projection's weight forms (``deterministic``: the
    batch-invariant ones, see :func:`select_kernels`).

    Full-precision weights go to the compiled bfloat16 kernel where it runs, they are
    bfloat16 and ``exact`` is false (1.36x oneDNN's speed at 32 rows, 1.9x at one, on
    SmolLM2's projections, AVX512-BF16; summed in another order, so not ``F.linear``'s bits),
    else to oneDNN's packing where :func:`~twostroke.engine.models.forms.can_pack` says
    it works, else they stay ``F.linear``'s.
    """
    reduced: Quantization | None = None
    if quantization == "auto":
        reduced = auto_quantization(dtype=dtype, device=device, exact=exact)
        if deterministic and reduced == "fp16" and fp16_rows_dependent():
            reduced = None  # float32 weights, packed for oneDNN: their products are invariant
    elif quantization is not None:
        if kernel_available(quantization, device):
            reduced = quantization
        else:
            warnings.warn(
                unavailable_message(quantization, device), QuantizationUnavailable, stacklevel=3
            )
    # Inputs of each projection the full-precision form takes (the compiled kernel reads
    # them in pairs: a model with an odd width stays on oneDNN).
    inputs = [config.hidden_size]
    if reduced is None:
        inputs += [config.num_heads * config.head_dim, config.intermediate_size]
    full, kernel, why = _full_precision(dtype, device, exact, pack, inputs)
    rows = None
    if not deterministic and _amx_split_wanted(full, kernel, dtype, device, exact):
        rows = AMX_PANEL_ROWS
    return Projections(reduced or full, full, kernel, panel_rows=rows), why


def _amx_split_wanted(
    form: WeightForm,
    kernel: ProjectionKernel | None,
    dtype: torch.dtype,
    device: torch.device,
    exact: bool,
) -> bool:
    """Whether the panels should give products of more than :data:`AMX_PANEL_ROWS` rows to
    oneDNN: where its bfloat16 products run on AMX tiles and the panels' own do not."""
    return (
        form == "panels"
        and kernel is not None
        and not kernel.tiles
        and cpu_personality().amx
        and can_pack(dtype, device, exact=exact)
    )


def _full_precision(
    dtype: torch.dtype, device: torch.device, exact: bool, pack: bool, inputs: list[int]
) -> tuple[WeightForm, ProjectionKernel | None, str | None]:
    if not pack:
        return "dense", None, "packing not asked for"
    why = _panels_unwanted(dtype, device, exact, inputs)
    if why is None:
        kernel = projection_kernel()
        if kernel is not None:
            return "panels", kernel, None
        why = "no compiled bfloat16 projection runs here: the log says why"
    if can_pack(dtype, device, exact=exact):
        return "onednn", None, why
    return "dense", None, why


def _panels_unwanted(
    dtype: torch.dtype, device: torch.device, exact: bool, inputs: list[int]
) -> str | None:
    """Why the compiled bfloat16 projection is not for these weights, if it is not."""
    if exact:
        return "exact arithmetic asked for"
    if dtype != torch.bfloat16:
        return f"the compiled projection takes bfloat16, not {str(dtype).removeprefix('torch.')}"
    unwanted = _compiled_unwanted(device)
    if unwanted is not None:
        return unwanted
    if any(width % 2 for width in inputs):
        return "an odd input width"
    return None


def _attention(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    asked: AttentionKernel | None,
    cache: torch.dtype,
) -> tuple[AttentionKernel, str | None]:
    """The compiled attention where it runs (1.7-1.9x the ``"bag"`` kernel's speed on
    SmolLM2's batch-32 attention), else the device's default (``"matmul"`` for a cache in
    another dtype than the activations, which ``"bag"`` does not read). A model whose
    scores are soft-capped (Gemma 2) attends with ``"matmul"``, the one kernel that computes
    its scores in torch's operators, where they can be capped before the mask.

    Raises:
        ValueError: another kernel is asked for a model with soft-capped scores.
    """
    if config.attn_logit_softcapping is not None:
        if asked not in (None, "matmul"):
            raise ValueError(
                f"attention_kernel must be 'matmul' or None for a model whose attention "
                f"scores are soft-capped (attn_logit_softcapping="
                f"{config.attn_logit_softcapping}): only it caps scores, got {asked!r}"
            )
        return "matmul", "the other kernels do not soft-cap attention scores"
    if asked is not None:
        return asked, "asked"
    kernel = default_kernel(device)
    if kernel != "bag":
        return kernel, None
    fallback: AttentionKernel = "bag" if cache == dtype else "matmul"
    unwanted = _compiled_unwanted(device)
    if unwanted is not None:
        return fallback, unwanted
    try:
        native_kernel(
            device,
            block_size=block_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            cache_dtype=cache,
        )
    except ValueError:  # logged where the build failed
        return fallback, "the compiled kernel does not run for this shape or dtype here"
    return "native", None


def _stack(
    glue: Glue, projection: Projections, config: ModelConfig
) -> tuple[Callable[..., int] | None, str | None]:
    """The whole stack in one call where every kernel a layer calls is compiled: the glue
    and every projection's (the bfloat16 panels, or a GGUF file's blocks; the attention is
    checked step by step: a step whose attention is another kernel's runs layer by layer).
    A model whose decoder projections are not all in that form (a GGUF file with a matrix
    in 16 bits) runs layer by layer too (the model finds it when it binds the stack), and so
    does a model whose layer is not Llama's (:attr:`ModelConfig.departures
    <twostroke.engine.models.config.ModelConfig.departures>`): the stack computes Llama's."""
    if config.departures:
        return (
            None,
            f"it computes Llama's layer, and this model's has {', '.join(config.departures)}",
        )
    if not isinstance(glue, CompiledGlue) or projection.layers not in ("panels", "blocks"):
        return None, "it needs the compiled glue and projections (bfloat16 panels or blocks)"
    function = stack_library(glue.library.dtype)
    if function is None:
        return None, "its library did not build: see the warning"
    return function, None
