"""Synthetic models made once and kept in the artifact cache, for ``--model synthetic:SHAPE``.

An entry per shape and seed (``synthetic-<shape>-<key>``), keyed by the shape's whole
configuration and :data:`GENERATOR` (a changed table or drawing makes a new entry), holding
one artifact per format and type (``hf-bfloat16/``, ``gguf-q8_0/model.gguf``), each stored
whole with its record (CRC-32s, checked when it is opened) as the converted models are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Literal

from twostroke.engine.artifacts.cache import ArtifactCache
from twostroke.engine.artifacts.records import DamagedArtifact, Provenance
from twostroke.engine.synthetic.gguf_file import (
    GGUF_TYPES,
    GGUFType,
    require_quantizer,
    write_gguf,
)
from twostroke.engine.synthetic.hf import HF_DTYPES, HFDtype, write_hf
from twostroke.engine.synthetic.shapes import shape_named
from twostroke.states.errors import EngineError

__all__ = [
    "GENERATOR",
    "GGUF_FILE",
    "SYNTHETIC_PREFIX",
    "SyntheticCacheUnavailable",
    "synthetic_model",
    "synthetic_named",
]

#: Bumped when the drawing or the writers change what a seed gives.
GENERATOR = 1
#: The file name of a GGUF artifact's model.
GGUF_FILE = "model.gguf"

#: How a model name asks for a synthetic model: ``synthetic:SHAPE[:TYPE]``.
SYNTHETIC_PREFIX = "synthetic:"

_log = logging.getLogger(__name__)


class SyntheticCacheUnavailable(EngineError):
    """A synthetic model was asked of the artifact cache, which is turned off or cannot
    store it; ``twostroke synthesize --out DIR`` writes one anywhere."""


def synthetic_model(
    shape: str,
    format: Literal["hf", "gguf"],
    type: str | None = None,
    *,
    seed: int = 0,
    llamacpp_python: str | os.PathLike[str] | None = None,
    cache: ArtifactCache | None = None,
) -> Path:
    """The synthetic model of ``shape``, made on first use and kept in the artifact cache.

    Args:
        shape: A shape's name (:data:`~twostroke.engine.synthetic.shapes.SHAPES`), or
            ``NAME@N`` for its first ``N`` layers.
        format: ``"hf"`` (a model folder) or ``"gguf"`` (one file).
        type: The weights' dtype for ``hf`` (default ``"bfloat16"``), their GGUF type for
            ``gguf`` (default ``"f16"``).
        seed: The weights' seed.
        llamacpp_python: The Python of a venv with ``llama-cpp-python``, for ``q4_k_m``.
        cache: The cache (default: the environment's,
            :meth:`~twostroke.engine.artifacts.cache.ArtifactCache.from_environment`).

    Returns:
        The model folder (``hf``) or GGUF file, inside the cache.

    Raises:
        UnknownShape: no such shape, or ``NAME@N`` with ``N`` not in ``[1, layers]``.
        ValueError: ``format`` or ``type`` is not one of those named.
        QuantizerUnavailable: ``q4_k_m`` without a working ``llamacpp_python``.
        SyntheticCacheUnavailable: the cache is turned off or could not store the model.
    """
    found = shape_named(shape)
    if format == "hf":
        chosen: str = type or HF_DTYPES[0]
        if chosen not in HF_DTYPES:
            raise ValueError(
                f"an hf model's dtype must be one of {', '.join(HF_DTYPES)}; got {chosen!r}"
            )
    elif format == "gguf":
        chosen = type or GGUF_TYPES[0]
        if chosen not in GGUF_TYPES:
            raise ValueError(f"a GGUF type must be one of {', '.join(GGUF_TYPES)}; got {chosen!r}")
    else:
        raise ValueError(f"format must be 'hf' or 'gguf'; got {format!r}")
    if seed < 0 or seed >= 2**31:
        raise ValueError(f"seed must be in [0, 2**31); got {seed}")
    cache = cache if cache is not None else ArtifactCache.from_environment()
    if cache is None:
        raise SyntheticCacheUnavailable(
            "synthetic models are kept in the artifact cache, which TWOSTROKE_NO_CACHE=1 turns "
            "off; unset it, or write one with `twostroke synthesize SHAPE --out DIR`"
        )
    identity = json.dumps(
        {"config": dict(found.config), "generator": GENERATOR, "seed": seed}, sort_keys=True
    )
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    artifact = cache.root / f"synthetic-{found.name}-seed{seed}-{key}" / f"{format}-{chosen}"
    detail = f"synthetic:{found.name} {format} {chosen}, seed {seed}, generator {GENERATOR}"
    result = artifact / GGUF_FILE if format == "gguf" else artifact
    try:
        record = cache.open(artifact)
    except DamagedArtifact as error:
        _log.warning("twostroke: making the synthetic model again (%s)", error)
        cache.discard(artifact)
        record = None
    if record is not None and record.provenance.detail == detail:
        return result

    if format == "gguf":
        require_quantizer(_gguf_type(chosen), llamacpp_python)
    _log.info("twostroke: making the synthetic model %s (%s, once: it is cached)", shape, chosen)
    if artifact.exists():
        cache.discard(artifact)
    failures: list[Exception] = []

    def write(folder: Path) -> None:
        try:
            if format == "hf":
                write_hf(found, folder, dtype=_hf_dtype(chosen), seed=seed)
            else:
                folder.mkdir()
                write_gguf(
                    found,
                    folder / GGUF_FILE,
                    type=_gguf_type(chosen),
                    seed=seed,
                    llamacpp_python=llamacpp_python,
                )
        except Exception as error:  # store() logs and swallows it; the caller needs it
            failures.append(error)
            raise

    provenance = Provenance(
        what="synthetic model", source=f"synthetic:{found.name}", dtype=chosen, detail=detail
    )
    stored = cache.store(artifact, write, provenance=provenance, checksum="crc32")
    if failures:
        raise failures[0]
    if not stored:
        raise SyntheticCacheUnavailable(
            f"the synthetic model {found.name} ({format}, {chosen}) could not be stored in the "
            f"artifact cache at {cache.root} (the log says why)"
        )
    return result


def _hf_dtype(name: str) -> HFDtype:
    for dtype in HF_DTYPES:
        if dtype == name:
            return dtype
    raise AssertionError(name)  # checked by the caller


def _gguf_type(name: str) -> GGUFType:
    for kind in GGUF_TYPES:
        if kind == name:
            return kind
    raise AssertionError(name)  # checked by the caller


def synthetic_named(
    name: str, *, llamacpp_python: str | os.PathLike[str] | None = None
) -> Path | None:
    """The synthetic model a name such as ``synthetic:qwen3-1.7b:q4_k_m`` asks for (made on
    first use, see :func:`synthetic_model`), or ``None`` for a name without the prefix.

    ``synthetic:SHAPE`` is the shape's GGUF file in F16, the form every peer of the bench
    reads; ``synthetic:SHAPE:TYPE`` picks the type, a GGUF one (``f16``, ``q8_0``,
    ``q4_k_m``) or a Hugging Face folder's dtype (``bfloat16``, ``float16``, ``float32``).
    ``SHAPE@N`` is the shape's first ``N`` layers (``synthetic:qwen3-30b-a3b@12:q4_k_m``), a
    model of its own (its own cache entry).

    Raises:
        ValueError: the name has more than three parts, or a type of neither kind (the
            message lists both).
        UnknownShape, QuantizerUnavailable, SyntheticCacheUnavailable: as
            :func:`synthetic_model` raises them.
    """
    if not name.startswith(SYNTHETIC_PREFIX):
        return None
    parts = name.removeprefix(SYNTHETIC_PREFIX).split(":")
    if len(parts) > 2:
        raise ValueError(f"a synthetic model is named synthetic:SHAPE[:TYPE], got {name!r}")
    shape, type = parts[0], (parts[1] if len(parts) == 2 else GGUF_TYPES[0])
    if type in GGUF_TYPES:
        return synthetic_model(shape, "gguf", type, llamacpp_python=llamacpp_python)
    if type in HF_DTYPES:
        return synthetic_model(shape, "hf", type)
    raise ValueError(
        f"a synthetic model's type must be a GGUF type ({', '.join(GGUF_TYPES)}) or a "
        f"Hugging Face dtype ({', '.join(HF_DTYPES)}), got {type!r} in {name!r}"
    )
