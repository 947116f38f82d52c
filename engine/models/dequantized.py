"""A GGUF file's weights dequantized into the model's dtype, kept in the artifact cache.

Each tensor is dequantized to float32 by the ``gguf`` package and converted to the chosen
dtype on its way into its parameter. That conversion takes seconds, so its result (the
weights in the chosen dtype, and the configuration) is kept in the artifact cache
(:mod:`~twostroke.engine.artifacts.cache`) and read back from there by the next load of the
same file, once its CRC-32 (summed as the weights are read) is the one recorded when they
were written: a damaged entry is logged, removed and converted again, never loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from twostroke.engine.artifacts.cache import ArtifactCache
from twostroke.engine.artifacts.records import (
    DamagedArtifact,
    Provenance,
    UnsafeCachePath,
    crc32_digest,
)
from twostroke.engine.checkpoints.safetensors import read_into
from twostroke.engine.checkpoints.source import ModelLoadError
from twostroke.engine.models.architectures import checkpoint_names, model_class
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.decoder import CausalLM, WeightError
from twostroke.engine.models.llama import unpermute_rotary
from twostroke.engine.models.source import ModelSource
from twostroke.gpu.isa import cpu_personality

__all__ = ["check_complete", "dequantized", "load_dequantized", "new_model", "stored_rows"]

_CACHED_CONFIG = "config.json"
_CACHED_WEIGHTS = "model.safetensors"

_log = logging.getLogger(__name__)


def load_dequantized(source: ModelSource, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The GGUF file's model in ``dtype``: read from the artifact cache, or converted from
    the file and cached.

    Raises:
        ModelLoadError: a tensor cannot be decoded or does not fit the model.
        UnsafeCachePath: never: an unsafe cache folder is logged and left unused.
    """
    path = source.checkpoint.path
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
    module = _convert_gguf(source, dtype, device)
    if artifact is not None and cache is not None:
        with contextlib.suppress(OSError):  # the file just read vanished: write all the same
            cache.prepare(path)  # records the source, removes stale folders
        _write_cached(cache, artifact, path, source.config, module)
    return module


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cached_weights(entry: Path, dtype: torch.dtype) -> Path:
    """The artifact folder of the weights in ``dtype``: ``model.safetensors``, the
    configuration, and their record."""
    return entry / f"model-{_dtype_name(dtype)}"


def _read_cached(
    cache: ArtifactCache, artifact: Path, dtype: torch.dtype, device: torch.device
) -> CausalLM | None:
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
        module = model_class(config)(config, dtype=dtype, device=device)
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
    return module


def _write_cached(
    cache: ArtifactCache,
    artifact: Path,
    source: Path,
    config: ModelConfig,
    module: CausalLM,
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


def _convert_gguf(source: ModelSource, dtype: torch.dtype, device: torch.device) -> CausalLM:
    from gguf.quants import dequantize

    path, config = source.checkpoint.path, source.config
    module = new_model(path, config, dtype, device)
    names = checkpoint_names(config)
    for gguf_name, weights in dequantized(path, source.tensors, dequantize):
        name = names.hf_name(gguf_name)
        if name is None:
            raise ModelLoadError(
                path, f"unexpected tensor {gguf_name!r}: the model has no such weight"
            )
        weights = stored_rows(source, gguf_name, weights)
        try:
            module.load_weight(name, torch.from_numpy(weights))
        except WeightError as error:
            raise ModelLoadError(path, f"tensor {gguf_name!r}: {error}") from error
    check_complete(module, path)
    return module


def stored_rows(source: ModelSource, gguf_name: str, weights: Any) -> Any:
    """A dequantized tensor's rows in transformers' order: a ``llama`` file's q/k rows are
    in llama.cpp's rotary order (:func:`~twostroke.engine.models.llama.unpermute_rotary`)."""
    heads = rotary_heads(source, gguf_name)
    return weights if heads is None else unpermute_rotary(weights, heads)


def rotary_heads(source: ModelSource, gguf_name: str) -> int | None:
    """The heads whose rows llama.cpp's converter permuted in a tensor of the file (the q and
    k projections of an architecture it stores in its rotary order,
    :attr:`CheckpointNames.gguf_rotary_order
    <twostroke.engine.models.decoder.CheckpointNames.gguf_rotary_order>`), or ``None``:
    stored in transformers' order."""
    order = checkpoint_names(source.config).gguf_rotary_order
    if source.checkpoint.metadata.get("general.architecture") not in order:
        return None
    if ".attn_q." in gguf_name:
        return source.config.num_heads
    if ".attn_k." in gguf_name:
        return source.config.num_kv_heads
    return None


def new_model(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> CausalLM:
    """The model, its weights allocated and not yet read.

    Raises:
        ModelLoadError: the weights do not fit in memory (torch's allocation error, a
            ``RuntimeError``, or ``MemoryError``), naming the sizes that asked for them.
    """
    try:
        return model_class(config)(config, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as error:
        raise ModelLoadError(
            path,
            f"the model's weights cannot be allocated on {device.type} (vocab_size="
            f"{config.vocab_size}, hidden_size={config.hidden_size}, intermediate_size="
            f"{config.intermediate_size}, num_layers={config.num_layers}): {error}",
        ) from error


def check_complete(module: CausalLM, path: Path) -> None:
    missing = module.missing_weights()
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(path, f"missing tensors: {shown}")


def dequantized(
    path: Path, tensors: Mapping[str, Any], dequantize: Any
) -> Iterator[tuple[str, Any]]:
    """Each tensor dequantized to float32 (a numpy array torch may write), by name.

    Raises:
        ModelLoadError: a tensor the ``gguf`` package cannot decode.
    """
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
