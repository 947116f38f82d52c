"""Loading a model: the files a :class:`~twostroke.engine.models.plan.RunPlan` names, read
into the forms it names (:class:`LoadedModel`).

Nothing is decided here: the weights' form, the activations' dtype and every kernel are the
plan's (:func:`~twostroke.engine.models.plan.resolve_run`). The loader reads:

* a **Hugging Face directory**'s ``*.safetensors``, tensor by tensor through
  ``safe_open``'s memory map, so the weights exist once in RAM (in the parameters);
* a **GGUF file** whose blocks the plan computes as stored: the projections (a mixture's
  experts too, where the plan says), the embedding and the tied output projection compute
  from the blocks in the file's memory map
  (:class:`~twostroke.engine.models.forms.BlockWeight`; no float32 copy, no cache entry),
  and the other tensors (the norms) are dequantized;
* any other **GGUF file** dequantized into the plan's dtype, through the artifact cache
  (:mod:`~twostroke.engine.models.dequantized`);

then, where the plan asks, quantizes the projections (and the experts) into blocks
(``q8_0``, ``q4_0``), and
hands the model the plan's kernels
(:meth:`~twostroke.engine.models.decoder.CausalLM.use_kernels`), which lay each
weight out in its form. Every failure a user can cause (missing file, wrong shape, corrupt
data) raises :class:`~twostroke.engine.checkpoints.errors.ModelLoadError` naming the file and
the problem.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from twostroke.engine.attention.kernels import AttentionKernel
from twostroke.engine.checkpoints.gguf import BLOCK_TYPES, BlockTensor
from twostroke.engine.checkpoints.source import (
    BlockTypeUnsupported,
    ModelLoadError,
    safetensors_tensors,
)
from twostroke.engine.config import QuantizationOption
from twostroke.engine.models.architectures import checkpoint_names
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.decoder import CausalLM, WeightError
from twostroke.engine.models.dequantized import (
    check_complete,
    dequantized,
    load_dequantized,
    new_model,
    rotary_heads,
    stored_rows,
)
from twostroke.engine.models.llama import rotary_columns
from twostroke.engine.models.plan import PLAIN_TYPES, RunPlan, expert_matrix, in_blocks, plan_run
from twostroke.engine.models.source import ModelSource, read_source
from twostroke.gpu.threads import torch_threads

__all__ = ["LoadedModel", "load_model", "open_model", "stored_bytes"]

_log = logging.getLogger(__name__)

#: An expert's matrix among a model's expected weights: ``experts.<n>.<name>.weight``.
_EXPERT_MATRIX = re.compile(r"\.experts\.\d+\.\w+\.weight$")


@attrs.frozen
class LoadedModel:
    """A decoder with its weights, and the plan it was loaded by.

    Attributes:
        plan: What the run decided (weights, dtype, kernels).
        module: The decoder, weights loaded and laid out, on its device.
        load_seconds: Wall time the load took (the plan's building included where
            :func:`open_model` made it).
    """

    plan: RunPlan
    module: CausalLM
    load_seconds: float = 0.0

    @property
    def config(self) -> ModelConfig:
        """The model's shape."""
        return self.plan.config

    @property
    def source(self) -> Path:
        """The directory or GGUF file the weights came from (tokenizers load from it)."""
        return self.plan.source.checkpoint.path

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (in full precision) and the activations' dtype."""
        return self.plan.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.plan.device

    @property
    def quantization(self) -> str | None:
        """The projections' weights when not in :attr:`dtype` (:attr:`RunPlan.weights
        <twostroke.engine.models.plan.RunPlan.weights>`)."""
        return self.plan.weights


def open_model(
    model: str | os.PathLike[str],
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    exact: bool = True,
    quantization: QuantizationOption | None = None,
    pack_weights: bool = True,
    block_size: int | None = None,
    kv_cache_dtype: torch.dtype | Any = None,
    mmap: bool = True,
    deterministic: bool | None = None,
    attention: AttentionKernel | None = None,
) -> LoadedModel:
    """Read a model, plan its run from these values and load it: what tests and tools call
    (the engine plans from its options: :func:`~twostroke.engine.models.plan.resolve_run`).

    Args:
        model: ``"smollm2"``, a directory with ``config.json`` and ``*.safetensors``, or a
            ``.gguf`` file.
        device: Where to put the weights.
        dtype: See :func:`~twostroke.engine.models.plan.plan_run`.
        exact: See :func:`~twostroke.engine.models.plan.plan_run`.
        quantization: See :func:`~twostroke.engine.models.plan.plan_run`.
        pack_weights: See ``pack`` of :func:`~twostroke.engine.models.plan.plan_run`.
        block_size: See :func:`~twostroke.engine.models.plan.plan_run` (``None``: its
            default).
        kv_cache_dtype: See :func:`~twostroke.engine.models.plan.plan_run`.
        mmap: See :func:`~twostroke.engine.models.plan.plan_run`.
        deterministic: See :func:`~twostroke.engine.models.plan.plan_run`.
        attention: See :func:`~twostroke.engine.models.plan.plan_run`.

    Raises:
        ModelLoadError: the model cannot be found, is not supported, or its files are
            incomplete, inconsistent or corrupt.
        ValueError: a value the plan refuses.
    """
    started = time.perf_counter()
    source = read_source(model, mmap=mmap)
    options: dict[str, Any] = {} if block_size is None else {"block_size": block_size}
    plan = plan_run(
        source,
        device,
        dtype=dtype,
        exact=exact,
        quantization=quantization,
        pack=pack_weights,
        kv_cache_dtype=kv_cache_dtype,
        deterministic=deterministic,
        mmap=mmap,
        attention=attention,
        **options,
    )
    loaded = load_model(plan)
    return attrs.evolve(loaded, load_seconds=time.perf_counter() - started)


def load_model(plan: RunPlan) -> LoadedModel:
    """The model ``plan`` names, its weights read and laid out in the plan's forms.

    Raises:
        ModelLoadError: the files are incomplete, inconsistent or corrupt, or do not fit
            the model.
        InvalidCacheLimit: ``TWOSTROKE_CACHE_LIMIT`` is not a size (a ``ValueError``; see
            :mod:`~twostroke.engine.artifacts.cache`).
    """
    started = time.perf_counter()
    source, dtype, device = plan.source, plan.dtype, plan.device
    path = source.checkpoint.path
    # Packing runs a Python thread per intra-op thread the caller allowed (see
    # CausalLM.use_kernels); everything else here runs on one, so that the caller's
    # thread is left without an OpenMP team of the loader's making. With a second team
    # alive in the process (the caller's, beside the engine's forward thread's), GNU OpenMP
    # counts more threads than cores and stops spinning at barriers: one stream's decode took
    # 17-35 ms a token against 9-14 (SmolLM2's blocks, 2 cores, docs/performance.md).
    # Loading is conversions and copies, bound by memory; a second thread gains little, and
    # on a machine whose other core is busy every parallel region waits for it (SmolLM2's
    # load took 4.5 s on two threads against 2.9 s on one, measured).
    threads = torch.get_num_threads()
    with torch_threads(1):
        if not source.is_gguf:
            module = _load_hf_directory(source, dtype, device)
        elif plan.blocks is not None and plan.requantize is None:
            module = _load_gguf_blocks(plan)
        else:
            module = load_dequantized(source, dtype, device)
        if plan.requantize is not None:
            _quantize_to_blocks(path, module, plan.requantize, experts=plan.experts_in_blocks)
        module.eval()
        reduced = plan.kernels.projection.quantization
        if reduced is not None:
            _log.info(
                "twostroke: packing %s's projection weights for fbgemm's %s kernel (%d threads)",
                path.name,
                reduced,
                threads,
            )
        try:
            module.use_kernels(plan.kernels, threads=threads)
        except WeightError as error:
            raise ModelLoadError(path, str(error)) from error
    return LoadedModel(plan, module, time.perf_counter() - started)


def _load_hf_directory(source: ModelSource, dtype: torch.dtype, device: torch.device) -> CausalLM:
    path = source.checkpoint.path
    module = new_model(path, source.config, dtype, device)
    for file, name, tensor in safetensors_tensors(path):
        try:
            module.load_weight(name, tensor)
        except WeightError as error:
            raise ModelLoadError(file, str(error)) from error
    check_complete(module, path)
    return module


def _load_gguf_blocks(plan: RunPlan) -> CausalLM:
    """The model with its matrices of :data:`~twostroke.engine.checkpoints.gguf.BLOCK_TYPES`
    as the file stores them (the memory map's blocks, not copied; with ``mmap=False``, the
    file's bytes read into memory), the rest dequantized; never cached (the file is the
    weights).

    GGUF's q/k rows are in llama.cpp's rotary order: the product's columns are permuted
    back (:attr:`BlockTensor.columns <twostroke.engine.checkpoints.gguf.BlockTensor.columns>`),
    the blocks untouched. A mixture's experts are held in blocks where the plan says
    (:attr:`RunPlan.experts_in_blocks <twostroke.engine.models.plan.RunPlan.experts_in_blocks>`):
    each stacked ``[experts, rows, row bytes]`` tensor is handed over as its experts' rows
    back to back, a view of the same bytes.
    """
    from gguf.quants import dequantize

    source = plan.source
    path = source.checkpoint.path
    module = new_model(path, source.config, plan.dtype, plan.device)
    names = checkpoint_names(source.config)
    experts = plan.experts_in_blocks
    for gguf_name, tensor in source.tensors.items():
        name = names.hf_name(gguf_name)
        if name is None:
            raise ModelLoadError(
                path, f"unexpected tensor {gguf_name!r}: the model has no such weight"
            )
        kind = tensor.tensor_type.name
        try:
            if kind in BLOCK_TYPES and (
                in_blocks(names, gguf_name) or (experts and expert_matrix(names, gguf_name))
            ):
                heads = rotary_heads(source, gguf_name)
                data = tensor.data.reshape(-1, tensor.data.shape[-1])  # a view: no copy
                columns = None if heads is None else rotary_columns(int(data.shape[0]), heads)
                module.load_blocks(name, BlockTensor(gguf_name, BLOCK_TYPES[kind], data, columns))
                continue
            if kind not in PLAIN_TYPES and in_blocks(names, gguf_name):
                # the plan refused the file already (a type the blocks do not compute)
                raise BlockTypeUnsupported(path, gguf_name, kind, plan.weights or "auto")
            [(_, weights)] = dequantized(path, {gguf_name: tensor}, dequantize)
            module.load_weight(name, torch.from_numpy(stored_rows(source, gguf_name, weights)))
        except (WeightError, ValueError) as error:  # BlockTypeUnsupported is neither
            raise ModelLoadError(path, f"tensor {gguf_name!r}: {error}") from error
    check_complete(module, path)
    return module


def _quantize_to_blocks(path: Path, module: CausalLM, block_type: int, *, experts: bool) -> None:
    """Every decoder projection of ``module`` (and every expert's matrix, where ``experts``)
    quantized into blocks of ``block_type``, as llama.cpp's quantizer writes them (the
    ``gguf`` package's ``quantize``: Q8_0's scale max|w| / 127, Q4_0's the signed largest
    magnitude / -8), handed to the model in place of its float32 weights
    (:meth:`~twostroke.engine.models.decoder.CausalLM.load_blocks`).

    Raises:
        ModelLoadError: a projection's input width is not a multiple of 32.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType(block_type)
    for name in module.expected_weights():
        # (An expert's matrix by the checkpoint's own name: Mixtral's are w1, w2 and w3.)
        expert = _EXPERT_MATRIX.search(name) is not None
        if not (experts if expert else name.endswith("_proj.weight")):
            continue
        weight = module.weight(name)
        if weight.shape[1] % 32:
            raise ModelLoadError(
                path,
                f"quantization={kind.name.lower()!r} quantizes projections in blocks of 32 "
                f"weights: {name!r} has rows of {weight.shape[1]}",
            )
        data = quantize(weight.detach().float().numpy(), kind)
        module.load_blocks(name, BlockTensor(name, block_type, data))


def stored_bytes(path: Path) -> dict[str, int]:
    """The bytes each of the GGUF file ``path``'s tensors takes as stored, by transformers'
    name (the benchmark's cost of a model computed as stored: blocks are read as the file
    holds them). Tensors without a transformers name are left out.

    Raises:
        ModelLoadError: not a valid GGUF file.
    """
    sizes = {}
    source = read_source(path)
    names = checkpoint_names(source.config)
    for gguf_name, tensor in source.tensors.items():
        name = names.hf_name(gguf_name)
        if name is not None:
            sizes[name] = int(tensor.data.nbytes)
    return sizes
