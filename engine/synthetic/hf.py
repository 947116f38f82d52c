"""A synthetic model as a Hugging Face folder: ``config.json``, safetensors shards of at most
2 GB with their index, and SmolLM2's tokenizer files.

The shards are written as the safetensors format lays them out (an 8-byte header length, a
JSON header of every tensor's dtype, shape and offsets, then the bytes), one tensor at a
time as it is drawn: the header is known before any tensor is, so no shard is ever held in
memory, and the largest buffer is the largest tensor (the embedding) in float32.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, Literal

import torch

from twostroke.engine.synthetic.shapes import Shape
from twostroke.engine.synthetic.tokenizer import save_tokenizer
from twostroke.engine.synthetic.weights import TensorSpec, draw, tensor_specs

__all__ = ["HF_DTYPES", "MAX_SHARD_BYTES", "HFDtype", "write_hf"]

HFDtype = Literal["bfloat16", "float16", "float32"]
#: The dtypes a Hugging Face folder may hold, the first the default (the real models').
HF_DTYPES: tuple[HFDtype, ...] = ("bfloat16", "float16", "float32")
#: The most bytes of tensors in one shard (as transformers' ``max_shard_size="2GB"``).
MAX_SHARD_BYTES = 2 * 10**9

_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SAFETENSORS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def write_hf(shape: Shape, folder: Path, *, dtype: HFDtype = "bfloat16", seed: int = 0) -> None:
    """Write ``shape``'s model, its weights drawn from ``seed``, into ``folder``.

    Args:
        shape: The shape.
        folder: Where; created if missing (files of the same names are replaced).
        dtype: The weights' dtype.
        seed: The weights' seed.

    Raises:
        ValueError: ``dtype`` is not one of :data:`HF_DTYPES`.
        ModelLoadError, TokenizerLoadError: SmolLM2's tokenizer cannot be had.
        OSError: the folder cannot be written.
    """
    if dtype not in HF_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(HF_DTYPES)}; got {dtype!r}")
    folder.mkdir(parents=True, exist_ok=True)
    bos, eos = save_tokenizer(folder)
    config = shape.hf_config(bos_token_id=bos, eos_token_id=eos, dtype=dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards = _shards(tensor_specs(shape), _ITEM_BYTES[dtype])
    names = _shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for name, specs in zip(names, shards, strict=True):
        with (folder / name).open("wb") as file:
            total += _write_shard(file, specs, dtype, seed)
        weight_map.update(dict.fromkeys((spec.name for spec in specs), name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _shards(specs: Sequence[TensorSpec], item_bytes: int) -> list[list[TensorSpec]]:
    """The tensors in order, cut into shards of at most :data:`MAX_SHARD_BYTES` (a larger
    tensor alone in its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * item_bytes
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def _write_shard(file: BinaryIO, specs: Sequence[TensorSpec], dtype: HFDtype, seed: int) -> int:
    """Write one safetensors file, drawing each tensor as its turn comes; its tensors' bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        nbytes = spec.numel * _ITEM_BYTES[dtype]
        header[spec.name] = {
            "dtype": _SAFETENSORS[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    file.write(struct.pack("<Q", len(encoded)))
    file.write(encoded)
    for spec in specs:
        tensor = draw(spec, seed).to(_TORCH[dtype])
        file.write(tensor.view(torch.uint8).numpy().tobytes())
        del tensor
    return offset
