"""Reading a safetensors file straight into tensors that already exist.

``safetensors.torch.load(path.read_bytes())`` copies every byte twice: from the page cache
into one ``bytes`` object, then from it into new tensors (and ``load_state_dict`` would copy
a third time unless it assigns). The artifact cache's weights are written from a module's
``state_dict()`` (:mod:`~twostroke.engine.models.dequantized`), so the next load knows every
tensor's name, dtype and shape before it opens the file: this reads each tensor's bytes
with ``readinto`` into the module's own (uninitialized) parameter, one copy in all. For
SmolLM2's 538 MB of float32 weights that took 0.88 s against 0.88 + 1.2 s for read + load
(AVX2 EPYC, load average 5, one torch thread).

It sums every byte it reads into a CRC-32 as it goes, each tensor just after it was read
(while its bytes are still in the CPU's caches, for all but the largest), which the artifact
cache compares with the one it recorded when it wrote the file
(:mod:`~twostroke.engine.artifacts.records`): a flipped word in the cache is caught
without a second pass over the file.

The format: an 8-byte little-endian header length, a JSON header mapping each name to its
``dtype``, ``shape`` and ``data_offsets`` (relative to the end of the header), and the data.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["read_into"]

#: The dtypes the cache writes, by their safetensors names.
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
#: A header longer than this is damage, not a model (SmolLM2's is 30 kB).
_MAX_HEADER = 100 * 2**20


def read_into(path: Path, tensors: Mapping[str, torch.Tensor]) -> int:
    """Fill ``tensors`` (contiguous, on the CPU) with the file's tensors of the same names.

    Args:
        path: A safetensors file holding exactly these names, dtypes and shapes.
        tensors: Name to destination tensor.

    Returns:
        The CRC-32 of all the file's bytes (header, tensors, and whatever lies between or
        after them), summed as they are read.

    Raises:
        ValueError: the file's tensors differ from ``tensors`` in any name, dtype, shape or
            size, overlap, or the file is truncated or not safetensors; ``tensors`` may then
            be partly filled.
        OSError: the file cannot be read.
    """
    with path.open("rb", buffering=0) as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER:
            raise ValueError(f"{path}: a header of {length} bytes is not a safetensors header")
        text = file.read(length)
        crc = zlib.crc32(text, zlib.crc32(prefix))
        try:
            header = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: the header is not JSON ({error})") from error
        if not isinstance(header, dict):
            raise ValueError(f"{path}: the header is not a JSON object")  # noqa: TRY004
        header.pop("__metadata__", None)
        if header.keys() != tensors.keys():
            missing = sorted(tensors.keys() - header.keys())[:3]
            extra = sorted(header.keys() - tensors.keys())[:3]
            raise ValueError(f"{path}: tensors differ (missing {missing}, unexpected {extra})")
        position = 0  # where the file is, from the end of the header
        for name, entry in sorted(header.items(), key=lambda item: _offsets(path, item[1])[0]):
            target = tensors[name]
            begin, end = _offsets(path, entry)
            dtype = _DTYPES.get(entry.get("dtype"))
            if dtype != target.dtype or entry.get("shape") != list(target.shape):
                raise ValueError(
                    f"{path}: {name} is {entry.get('dtype')} {entry.get('shape')}, "
                    f"expected {target.dtype} {list(target.shape)}"
                )
            size = target.numel() * target.element_size()
            if end - begin != size:
                raise ValueError(f"{path}: {name} holds {end - begin} bytes, expected {size}")
            if target.device.type != "cpu" or not target.is_contiguous():
                raise ValueError(f"{name}: the destination must be contiguous on the CPU")
            if begin < position:
                raise ValueError(f"{path}: {name} overlaps the tensor before it")
            if begin > position:
                crc = zlib.crc32(_read_bytes(file, begin - position, path), crc)
            buffer = target.reshape(-1).view(torch.uint8).numpy().data
            _read_exactly(file, buffer, path)
            crc = zlib.crc32(buffer, crc)
            position = end
        while rest := file.read(2**20):
            crc = zlib.crc32(rest, crc)
    return crc


def _offsets(path: Path, entry: object) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(x, int) for x in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(f"{path}: bad data_offsets {offsets!r}")
    return offsets[0], offsets[1]


def _read_bytes(file: io.FileIO, count: int, path: Path) -> bytes:
    data = bytearray(count)
    _read_exactly(file, memoryview(data), path)
    return bytes(data)


def _read_exactly(file: io.FileIO, buffer: memoryview, path: Path) -> None:
    filled = 0
    while filled < len(buffer):
        count = file.readinto(buffer[filled:])
        if not count:
            raise ValueError(f"{path}: truncated ({filled} of {len(buffer)} bytes of a tensor)")
        filled += count
