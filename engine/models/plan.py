"""The run's central decision, made once: :class:`RunPlan`.

Which weights a run reads and in which form, on which activations, with which KV-cache
dtype, exact or not, and which kernel computes each part of a step: every one of these is
decided here, by :func:`resolve_run` (from the engine's options) or :func:`plan_run` (from
their values, for tests and tools), when a model loads. The loader
(:func:`~twostroke.engine.models.loading.load_model`) then only reads files into the forms
the plan names; the runner, the engine's statistics, ``twostroke profile-step``, the bench
and its roof read the plan; nobody decides again.

A newcomer's question, "why does this model run fp16 weights on float32 activations?", is
answered by one log line (:meth:`RunPlan.describe`) and one function (:func:`plan_run`):

* ``dtype="auto"`` is the device's default (:func:`twostroke.gpu.dtype.default_dtype`),
  float32 where the weights are GGUF blocks (their products' only activations); an explicit
  dtype asks for transformers' arithmetic (``exact``);
* ``quantization="auto"``: a GGUF file's blocks as stored where they win
  (:func:`auto_blocks`: few sequences on a large model, or a file too large to dequantize),
  else fp16 weights where the activations are float32 on a CPU whose fbgemm runs
  (:func:`~twostroke.engine.models.choice.auto_quantization`), else the dtype's own;
  ``"gguf"`` / ``"gguf_f32"``: a GGUF file's blocks as stored, activations quantized to 8 bits
  per block or not (:data:`BLOCK_ACTIVATIONS`); ``"q8_0"`` / ``"q4_0"``: the projections
  quantized into those blocks at load (:data:`QUANTIZE_TO_BLOCKS`); ``"fp16"`` / ``"int8"``:
  fbgemm's reduced weights;
* the kernels: :func:`~twostroke.engine.models.choice.select_kernels`, the plan's second
  half.
"""

from __future__ import annotations

import logging
import math
import types
import warnings
from collections.abc import Mapping
from typing import Literal, get_args

import attrs
import torch

from twostroke.engine.attention.kernels import AttentionKernel
from twostroke.engine.checkpoints.gguf import BLOCK_TYPES
from twostroke.engine.checkpoints.source import BlockTypeUnsupported, ModelLoadError
from twostroke.engine.config import (
    DTYPE_OPTIONS,
    QUANTIZATION_OPTIONS,
    EngineConfig,
    QuantizationOption,
)
from twostroke.engine.kernels.build import native_wanted
from twostroke.engine.kernels.gguf_blocks import BlockKernel, block_kernel
from twostroke.engine.models.architectures import checkpoint_names
from twostroke.engine.models.choice import DEFAULT_BLOCK_SIZE, CpuKernels, select_kernels
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.decoder import CheckpointNames
from twostroke.engine.models.source import ModelSource
from twostroke.gpu.device import Device
from twostroke.gpu.dtype import default_dtype
from twostroke.gpu.host import available_memory
from twostroke.gpu.isa import cpu_personality
from twostroke.gpu.threads import torch_threads

__all__ = [
    "AUTO_BLOCKS",
    "AUTO_BLOCKS_MAX_SEQS",
    "AUTO_BLOCKS_MEMORY_SHARE",
    "AUTO_BLOCKS_MIN_WEIGHTS",
    "AUTO_BLOCKS_QUANTIZATION",
    "BLOCK_ACTIVATIONS",
    "DTYPES",
    "QUANTIZE_TO_BLOCKS",
    "EmulatedBFloat16Warning",
    "RunPlan",
    "auto_blocks",
    "blocks_asked",
    "exact_asked",
    "expert_matrix",
    "plan_run",
    "projection_weights",
    "resolve_dtype",
    "resolve_kv_cache_dtype",
    "resolve_run",
]

_log = logging.getLogger(__name__)

#: The dtype names ``EngineConfig.dtype`` (and ``twostroke bench --dtype``) take, besides "auto".
DTYPES: Mapping[str, torch.dtype] = types.MappingProxyType(
    {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
)
assert set(DTYPES) | {"auto"} == set(DTYPE_OPTIONS)

#: What each quantization that computes a GGUF file's blocks as stored does with its
#: activations (:attr:`~twostroke.engine.kernels.gguf_blocks.BlockKernel.activations`):
#: ``"gguf"`` as llama.cpp does, quantized to 8 bits per block; ``"gguf_f32"`` as they are.
BLOCK_ACTIVATIONS: Mapping[str, str] = types.MappingProxyType(
    {"gguf": "int8", "gguf_f32": "float32"}
)

#: The quantizations that write a model's projections into GGUF blocks at load, and the
#: blocks' GGML type.
QUANTIZE_TO_BLOCKS: Mapping[str, int] = types.MappingProxyType(
    {"q8_0": BLOCK_TYPES["Q8_0"], "q4_0": BLOCK_TYPES["Q4_0"]}
)

#: Whether ``quantization="auto"`` may compute a GGUF file's blocks as stored, where they run
#: (a CPU whose compiled kernels are wanted, transformers' exact arithmetic not asked for,
#: every matrix in a type :data:`~twostroke.engine.checkpoints.gguf.BLOCK_TYPES` holds, or in
#: 16 or 32 bits) and where they win (:func:`auto_blocks`).
AUTO_BLOCKS = True

#: The blocks win where a step has few rows: their products read a quarter of bfloat16's
#: bytes (decode streams the weights), but at many rows the K super-blocks' integer products
#: cost more than oneDNN's bfloat16 ones, and a prefill dequantizes each weight once a chunk.
#: Measured on Qwen3-1.7B Q4_K_M against the file dequantized to bfloat16 (docs/performance.md,
#: "The blocks by default"; AMD EPYC, AVX-512 with BF16, 2 cores), output tokens/s of the
#: blocks over the dense copy's: 1.30x at one sequence, 1.14x at 2, 0.96x at 4, 0.69x at 8,
#: 0.64x at 32. So ``quantization="auto"`` takes them for an engine that runs at most this
#: many sequences at once.
AUTO_BLOCKS_MAX_SEQS = 2

#: ... on decoder projections (experts' included) of at least this many weights: the sizes
#: measured (Llama-3.2-1B's 0.97 B to Qwen3-4B's); SmolLM2's 0.11 B keep the defaults its
#: quality tables and figures measure.
AUTO_BLOCKS_MIN_WEIGHTS = 900_000_000

#: And whatever the sequences, where the file dequantized would take more than this share of
#: the memory available when it loads (a 30 B mixture's 60 GB in bfloat16 on a 24 GB
#: machine): the blocks run where the dense copy cannot.
AUTO_BLOCKS_MEMORY_SHARE = 0.5

#: The activations the blocks take by default: 8 bits per block, as llama.cpp's (``"gguf"``).
#: Their perplexity's departure from the file's float32 model is within the bar
#: docs/models.md states against llama.cpp's own departure on the same file (all three files
#: measured meet it), and they are faster than float32 activations.
AUTO_BLOCKS_QUANTIZATION: Literal["gguf", "gguf_f32"] = "gguf"

#: Tensor types a GGUF file stores as plain numbers: loaded as float32 (exact), where a
#: decoder projection of 16 bits then takes the 16-bit form
#: (:attr:`~twostroke.engine.models.choice.Projections.sixteen`).
PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64"})

_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class EmulatedBFloat16Warning(UserWarning):
    """bfloat16 was asked for on a CPU that has no native bfloat16 instructions."""


#: What asking for bfloat16 costs on a CPU without native bf16 (measured, see
#: docs/performance.md): torch emulates it, and float32 is the fast dtype there.
EMULATED_BF16_MESSAGE = (
    "dtype='bfloat16' on a CPU without native bf16 (torch CPU capability {capability}, no "
    "AVX512_BF16/AMX): torch emulates it, about 4.4x slower than float32 (SmolLM2-135M, "
    "32 requests on an AVX2 EPYC: 13.6 against 60 output tok/s); dtype='auto' picks float32 "
    "here. Running in bfloat16 as asked."
)


@attrs.frozen
class RunPlan:
    """Everything a run decided about its model, once (see the module).

    Attributes:
        source: The model's files and shape.
        device: Where it runs.
        dtype: The weights' (those in full precision) and the activations' dtype.
        exact: Whether transformers' arithmetic is kept exactly (an explicit ``dtype``):
            no compiled glue or panels, float32 products MKL's.
        weights: The projections' weights when not in ``dtype``: ``"gguf"`` and
            ``"gguf_f32"`` (a GGUF file's blocks as stored, by 8-bit or float32
            activations), ``"q8_0"`` and ``"q4_0"`` (quantized into blocks at load),
            ``"fp16"`` and ``"int8"`` (fbgemm's); ``None``: in ``dtype``.
        requantize: The GGML type the projections are quantized into at load, or ``None``.
        kernels: What computes each part of a step
            (:func:`~twostroke.engine.models.choice.select_kernels`).
        block_size: The KV cache's block size the compiled attention is built for.
        mmap: Whether a GGUF file's blocks are read from its memory map.
        asked: The values :func:`plan_run` was given, by name (:meth:`replanned`).
    """

    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    exact: bool
    weights: str | None
    kernels: CpuKernels
    requantize: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    mmap: bool = True
    asked: Mapping[str, object] = attrs.field(factory=dict, repr=False)

    def replanned(self, **changes: object) -> RunPlan:
        """The plan :func:`plan_run` makes of the same model with the same values but
        ``changes`` (``attention="bag"`` for a comparison of kernels): a new decision, made
        whole, for a new load."""
        return plan_run(self.source, self.device, **{**self.asked, **changes})  # type: ignore[arg-type]

    @property
    def config(self) -> ModelConfig:
        """The model's shape."""
        return self.source.config

    @property
    def blocks(self) -> BlockKernel | None:
        """The GGUF block products the projections compute with (their activations, and
        block by block where the run is deterministic), or ``None``."""
        return self.kernels.projection.blocks

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type."""
        cache = self.kernels.cache_dtype
        return self.dtype if cache is None else cache

    @property
    def deterministic(self) -> bool:
        """Whether the run is batch-invariant
        (:attr:`~twostroke.engine.models.choice.CpuKernels.deterministic`)."""
        return self.kernels.deterministic

    @property
    def experts_in_blocks(self) -> bool:
        """Whether a mixture's experts compute in GGUF blocks as the projections do: a GGUF
        file's blocks as stored where the block products compute every expert tensor's
        type, or quantized at load where an expert's rows are blocks of 32; else they stay
        in :attr:`dtype` (dequantized from the file), and :meth:`describe` says why."""
        return self._experts()[0]

    def _experts(self) -> tuple[bool, str]:
        """:attr:`experts_in_blocks`, and what :meth:`describe` says of the experts after
        the weights (nothing where the projections are not in blocks, or there are no
        experts)."""
        config = self.config
        dtype = _name(self.dtype)
        if not config.num_experts:
            return False, ""
        if self.blocks is None:  # the experts take the dense projections' form
            form = self.kernels.projection.layers
            return False, "" if form == "dense" else f", experts in {form} as the projections"
        if self.requantize is not None:
            ragged = [w for w in (config.hidden_size, config.expert_intermediate_size) if w % 32]
            if ragged:
                return False, (
                    f", experts {dtype} (an expert's rows of {ragged[0]} weights are not blocks "
                    "of 32)"
                )
            return True, f", experts in {self.weights} blocks"
        names = checkpoint_names(config)
        kinds = {
            tensor.tensor_type.name
            for name, tensor in self.source.tensors.items()
            if expert_matrix(names, name)
        }
        odd = sorted(kinds - set(BLOCK_TYPES))
        if not odd:
            return True, f", experts as stored ({', '.join(sorted(kinds))})"
        if set(odd) <= PLAIN_TYPES:
            return False, f", experts {dtype} (stored in {', '.join(odd)})"
        return False, f", experts dequantized to {dtype} ({', '.join(odd)} not computed as stored)"

    def describe(self) -> str:
        """One line: the weights (and a mixture's experts, where the projections are in
        blocks) and activations, then what runs each part of a step, and why where a
        compiled kernel does not."""
        dtype = _name(self.dtype)
        weights = (self.weights or dtype) + self._experts()[1]
        arithmetic = "exact" if self.exact else "fast"
        where = cpu_personality().describe() if self.device.type == "cpu" else self.device.type
        return (
            f"{self.source.checkpoint.path.name} on {where}: weights {weights}, {dtype} "
            f"activations ({arithmetic}); {self.kernels.describe()}"
        )


def resolve_dtype(name: str, device: Device | torch.device) -> torch.dtype:
    """The torch dtype a dtype name stands for on ``device``.

    ``"bfloat16"`` on a CPU without native bf16 is honoured, with an
    :class:`EmulatedBFloat16Warning` that names its cost (Python's warning filters show it
    once per process by default).

    Args:
        name: ``"auto"`` (what :func:`twostroke.gpu.dtype.default_dtype` picks for
            ``device``) or a key of :data:`DTYPES`.
        device: The device the model will run on.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    if name == "auto":
        return default_dtype(device)
    if name not in DTYPES:
        raise ValueError(
            f"dtype must be 'auto' or one of {', '.join(map(repr, DTYPES))}, got {name!r}"
        )
    dtype = DTYPES[name]
    kind = device.type if isinstance(device, torch.device) else device.kind
    if dtype == torch.bfloat16 and kind == "cpu" and default_dtype(device) != dtype:
        capability = torch.backends.cpu.get_cpu_capability()
        warnings.warn(
            EMULATED_BF16_MESSAGE.format(capability=capability),
            EmulatedBFloat16Warning,
            stacklevel=2,
        )
    return dtype


def resolve_kv_cache_dtype(name: str) -> torch.dtype | Literal["auto"]:
    """The KV cache's element type a ``kv_cache_dtype`` name stands for (``"auto"`` stays:
    the kernels' choice decides it,
    :func:`~twostroke.engine.models.choice.auto_kv_cache_dtype`).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be 'auto' or one of {', '.join(map(repr, DTYPES))}, got {name!r}"
        )
    return DTYPES[name]


def resolve_run(
    config: EngineConfig,
    source: ModelSource,
    device: torch.device,
    *,
    attention: AttentionKernel | None = None,
) -> RunPlan:
    """The plan of a run of ``source`` on ``device`` with the engine's options.

    The options' meaning (see the module): ``dtype="auto"`` is the device's default, or
    float32 where the weights are GGUF blocks (:func:`blocks_asked`); an explicit
    ``dtype`` asks for transformers' exact arithmetic.

    Args:
        config: The engine's options (``dtype``, ``quantization``, ``kv_cache_dtype``,
            ``block_size``, ``mmap``, ``deterministic``).
        source: The model (:func:`~twostroke.engine.models.source.read_source`).
        device: Where it runs.
        attention: The attention asked for (``None``: the fastest that runs here).

    Raises:
        ValueError: an unknown option value; ``dtype`` other than float32 with GGUF blocks.
        ModelLoadError: the blocks asked for cannot be computed for this file, here.
        DeterminismUnavailable: ``deterministic=True``, and a part of the run cannot be
            batch-invariant here.
    """
    dtype = resolve_dtype(config.dtype, device)
    exact = exact_asked(config.dtype)
    # Read once, so that the plan below decides on the blocks as this does.
    memory = available_memory()
    if not exact and (
        blocks_asked(config.quantization)
        or (
            config.quantization == "auto"
            and auto_blocks(
                source,
                dtype=torch.float32,
                device=device,
                exact=exact,
                max_num_seqs=config.max_num_seqs,
                memory=memory,
            )
        )
    ):
        dtype = torch.float32  # the block products' only activations
    return plan_run(
        source,
        device,
        dtype=dtype,
        exact=exact,
        quantization=config.quantization,
        block_size=config.block_size,
        kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype),
        deterministic=config.deterministic,
        mmap=config.mmap,
        attention=attention,
        max_num_seqs=config.max_num_seqs,
        memory=memory,
    )


def exact_asked(dtype: str) -> bool:
    """Whether a ``dtype`` option asks for transformers' exact arithmetic: any dtype named
    (``"float32"`` is transformers' own products), not ``"auto"`` (the fastest)."""
    return dtype != "auto"


def blocks_asked(quantization: QuantizationOption | None) -> bool:
    """Whether ``quantization`` computes GGUF blocks (a file's as stored, or projections
    quantized into them at load), whose products take float32 activations."""
    return quantization in BLOCK_ACTIVATIONS or quantization in QUANTIZE_TO_BLOCKS


def plan_run(
    source: ModelSource,
    device: torch.device,
    *,
    dtype: torch.dtype | None = None,
    exact: bool = True,
    quantization: QuantizationOption | None = None,
    pack: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_dtype: torch.dtype | Literal["auto"] | None = None,
    deterministic: bool | None = None,
    mmap: bool = True,
    attention: AttentionKernel | None = None,
    max_num_seqs: int | None = None,
    memory: int | None = None,
) -> RunPlan:
    """The plan of a run from the decision's values (what :func:`resolve_run` makes of the
    engine's options; tests and tools give them directly).

    Args:
        source: The model.
        device: Where it runs.
        dtype: float32, bfloat16 or float16; ``None`` takes
            :func:`twostroke.gpu.dtype.default_dtype` of ``device``.
        exact: float32 products exactly as transformers computes them (MKL's, on the
            CPU); ``False`` lets float32 weights be packed and the glue run compiled.
        quantization: The weights' form (see the module; ``None``: ``dtype``). ``"fp16"``
            or ``"int8"`` where fbgemm's kernel does not run here warns with
            :class:`~twostroke.engine.models.quantization.QuantizationUnavailable` and
            keeps full precision.
        pack: Lay the projections' weights out for a faster kernel where one runs.
        block_size: The KV cache's block size the compiled attention is built for.
        kv_cache_dtype: The KV cache's element type (``None``: ``dtype``; ``"auto"``:
            :func:`~twostroke.engine.models.choice.auto_kv_cache_dtype`).
        deterministic: ``True``: the batch-invariant arrangement (GGUF blocks multiplied
            block by block at every row count among them) or
            :class:`~twostroke.engine.models.choice.DeterminismUnavailable`.
        mmap: Read a GGUF file's blocks from its memory map (``False``: the source was
            read into memory).
        attention: The attention asked for (``None``: the fastest that runs here).
        max_num_seqs: The most sequences the engine runs at once (``quantization="auto"``
            takes a GGUF file's blocks for few: :func:`auto_blocks`); ``None``: not known.
        memory: The bytes of memory available, as :func:`auto_blocks` weighs them
            (``None``: read now).

    Raises:
        ValueError: ``dtype`` is not a floating dtype the model runs in, an unknown
            ``quantization``, or blocks asked for other than float32 activations on a CPU.
        ModelLoadError: blocks asked for a model that is not a GGUF file, or that the block
            products cannot compute
            (:class:`~twostroke.engine.checkpoints.errors.BlockTypeUnsupported`), or that do
            not build here.
    """
    if dtype is None:
        dtype = default_dtype(device)
    if dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if quantization is not None and quantization not in QUANTIZATION_OPTIONS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_OPTIONS} or None, got {quantization!r}"
        )
    # The kernels' checks run on one thread, so that the caller's thread is left without an
    # OpenMP team of the plan's making (see load_model).
    with torch_threads(1):
        blocks = _blocks(source, quantization, dtype, device, exact, max_num_seqs, memory)
    requantize = QUANTIZE_TO_BLOCKS.get(quantization) if quantization is not None else None
    weights: str | None = None
    if quantization in BLOCK_ACTIVATIONS or requantize is not None:
        weights = quantization
    elif blocks is not None:  # "auto", where AUTO_BLOCKS takes them
        weights = next(n for n, a in BLOCK_ACTIVATIONS.items() if a == blocks.activations)
    if blocks is not None and not exact and blocks.activations == "int8" and cpu_personality().bf16:
        # Prefill's many rows multiply in bfloat16 where the CPU does natively: 4-5x float32's
        # products, with rows rounded finer than the 8-bit activations the blocks already take.
        blocks = blocks.densely(torch.bfloat16)
    if deterministic and blocks is not None:
        blocks = blocks.block_by_block()  # before any weight is made of it
    reduced = quantization if quantization in ("auto", "fp16", "int8") else None
    with torch_threads(1):
        kernels = select_kernels(
            source.config,
            dtype=dtype,
            device=device,
            exact=exact,
            quantization=None if blocks is not None else reduced,
            pack=pack,
            block_size=block_size,
            attention=attention,
            blocks=blocks,
            kv_cache_dtype=kv_cache_dtype,
            deterministic=deterministic,
        )
    if weights is None:
        weights = kernels.projection.quantization
    plan = RunPlan(
        source,
        device,
        dtype,
        exact,
        weights,
        kernels,
        requantize=requantize,
        block_size=block_size,
        mmap=mmap,
        asked=types.MappingProxyType(
            {
                "dtype": dtype,
                "exact": exact,
                "quantization": quantization,
                "pack": pack,
                "block_size": block_size,
                "kv_cache_dtype": kv_cache_dtype,
                "deterministic": deterministic,
                "mmap": mmap,
                "attention": attention,
                "max_num_seqs": max_num_seqs,
            }
        ),
    )
    _log.info("twostroke: %s", plan.describe())
    return plan


def _blocks(
    source: ModelSource,
    quantization: QuantizationOption | None,
    dtype: torch.dtype,
    device: torch.device,
    exact: bool,
    max_num_seqs: int | None,
    memory: int | None,
) -> BlockKernel | None:
    """The block products the run computes with, their activations decided: for a GGUF
    file's blocks as stored (``"gguf"``, ``"gguf_f32"``, or ``"auto"`` where
    :func:`auto_blocks` takes them, by float32 activations) or projections quantized into
    blocks at load (``"q8_0"``, ``"q4_0"``); ``None`` for any other weights."""
    if quantization in BLOCK_ACTIVATIONS:
        assert quantization is not None
        asked = f"quantization={quantization!r}"
        if not source.is_gguf:
            raise ModelLoadError(
                source.checkpoint.path,
                f"{asked} computes a GGUF file's blocks as stored: not a GGUF file",
            )
        checked = _checked_kernel(source, asked, dtype, device)
        _check_stored_types(source, quantization)
        return checked.taking(BLOCK_ACTIVATIONS[quantization])
    if quantization in QUANTIZE_TO_BLOCKS:
        return _checked_kernel(source, f"quantization={quantization!r}", dtype, device)
    if quantization != "auto" or not auto_blocks(
        source, dtype=dtype, device=device, exact=exact, max_num_seqs=max_num_seqs, memory=memory
    ):
        return None
    kernel = block_kernel()
    return None if kernel is None else kernel.taking(BLOCK_ACTIVATIONS[AUTO_BLOCKS_QUANTIZATION])


def _checked_kernel(
    source: ModelSource, asked: str, dtype: torch.dtype, device: torch.device
) -> BlockKernel:
    """The block products for ``asked`` (a quantization that computes blocks), or why not."""
    if dtype != torch.float32 or device.type != "cpu":
        raise ValueError(
            f"{asked} computes on the CPU with float32 activations; got dtype "
            f"{_name(dtype)} on {device.type} (ask for dtype='float32' on the CPU)"
        )
    kernel = block_kernel()
    if kernel is None:
        raise ModelLoadError(
            source.checkpoint.path,
            f"{asked}: the block products do not build here (see the warning)",
        )
    return kernel


def _check_stored_types(source: ModelSource, asked: str) -> None:
    """Refuse a GGUF file with a matrix the blocks form holds in a type it does not compute
    (it is never dequantized silently)."""
    names = checkpoint_names(source.config)
    for name, tensor in source.tensors.items():
        kind = tensor.tensor_type.name
        if kind not in BLOCK_TYPES and kind not in PLAIN_TYPES and in_blocks(names, name):
            raise BlockTypeUnsupported(source.checkpoint.path, name, kind, asked)


def auto_blocks(
    source: ModelSource,
    *,
    dtype: torch.dtype,
    device: torch.device,
    exact: bool,
    max_num_seqs: int | None = None,
    memory: int | None = None,
) -> bool:
    """Whether ``quantization="auto"`` computes the GGUF file's blocks as stored
    (:data:`AUTO_BLOCKS`): float32 activations on a CPU whose compiled kernels are wanted,
    transformers' exact arithmetic not asked for, every matrix in a type computed as stored
    or in plain numbers (else the log names the tensor that keeps it dequantized), and
    where they win: an engine of at most :data:`AUTO_BLOCKS_MAX_SEQS` sequences on decoder
    projections of at least :data:`AUTO_BLOCKS_MIN_WEIGHTS` weights, or a file whose
    dequantized copy would take more than :data:`AUTO_BLOCKS_MEMORY_SHARE` of the memory
    available (``memory`` bytes; ``None``: read now). Whether the library builds here is
    not asked: where it does not, the model loads dequantized (one warning)."""
    if not AUTO_BLOCKS or not source.is_gguf or exact:
        return False
    if dtype != torch.float32 or device.type != "cpu" or not native_wanted():
        return False
    names = checkpoint_names(source.config)
    few = max_num_seqs is not None and max_num_seqs <= AUTO_BLOCKS_MAX_SEQS
    if not (few and projection_weights(source, names) >= AUTO_BLOCKS_MIN_WEIGHTS):
        # The dense copy in the dtype "auto" would otherwise take here.
        dense = sum(math.prod(t.shape) for t in source.tensors.values())
        dense *= default_dtype(device).itemsize
        if dense <= AUTO_BLOCKS_MEMORY_SHARE * (available_memory() if memory is None else memory):
            return False
    for name, tensor in source.tensors.items():
        kind = tensor.tensor_type.name
        if kind not in BLOCK_TYPES and kind not in PLAIN_TYPES and in_blocks(names, name):
            _log.info(
                "twostroke: %s loads dequantized: tensor %r is %s, which is not computed as stored",
                source.checkpoint.path.name,
                name,
                kind,
            )
            return False
    return True


def projection_weights(source: ModelSource, names: CheckpointNames) -> int:
    """The weights of a GGUF file's decoder projections, experts' included (not the
    embedding nor the output projection): the size :func:`auto_blocks` goes by."""
    count = 0
    for name, tensor in source.tensors.items():
        hf_name = names.hf_name(name)
        if hf_name is None or not hf_name.startswith("model.layers."):
            continue
        if in_blocks(names, name) or expert_matrix(names, name):
            count += math.prod(tensor.shape)
    return count


def in_blocks(names: CheckpointNames, gguf_name: str) -> bool:
    """Whether a tensor is one the blocks form holds (a matrix: projection, embedding or
    output projection), by its file name and the architecture's ``names``."""
    name = names.hf_name(gguf_name)
    return (
        name is not None
        and ".mlp.experts." not in name  # the plan's experts_in_blocks decides: expert_matrix
        and not name.endswith("layernorm.weight")
        and name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))
    )


def expert_matrix(names: CheckpointNames, gguf_name: str) -> bool:
    """Whether a tensor is a mixture's experts' matrices (``ffn_<proj>_exps``), which the
    blocks form holds where the plan says (:attr:`RunPlan.experts_in_blocks`)."""
    name = names.hf_name(gguf_name)
    return name is not None and ".mlp.experts." in name


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


assert set(get_args(QuantizationOption)) == set(QUANTIZATION_OPTIONS)
