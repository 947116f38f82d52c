"""Reading a GGUF file's key/values and tensors, skipping the vocabulary.

The ``gguf`` package's ``GGUFReader`` parses every value into numpy views, several per
string: SmolLM2's 49 152 tokens and 48 900 merges cost it two seconds, for arrays the model
never reads (the tokenizer is built from the file separately). This reader walks the same
layout with ``struct`` and steps over the ``tokenizer.*`` arrays, keeping only their
lengths, in a few tens of milliseconds. Tensors stay memory-mapped, shaped as ``GGUFReader``
shapes them, so ``gguf.quants.dequantize`` decodes them.

The layout (GGUF v2 and v3, little-endian): magic, version, tensor count, key/value count;
the key/values; one record per tensor (name, dimensions, type, offset); padding to the
``general.alignment``; the tensor data.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np

__all__ = ["GGUFContents", "GGUFTensor", "read_gguf"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
#: Scalar value types: struct format.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
#: Arrays under these keys are skipped; their lengths are kept as ``<key>.count``.
_SKIPPED_PREFIX = "tokenizer."


@attrs.frozen
class GGUFTensor:
    """One tensor of the file.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        tensor_type: The ``gguf.GGMLQuantizationType``.
        data: Memory-mapped, shaped as ``GGUFReader`` shapes it (numpy order; for quantized
            types, bytes per row as the last dimension).
    """

    name: str
    tensor_type: Any
    data: np.ndarray[Any, Any]


@attrs.frozen
class GGUFContents:
    """The key/values and the tensors of a GGUF file.

    Attributes:
        metadata: Key to value (``int``, ``float``, ``bool``, ``str`` or lists of them); a
            skipped ``tokenizer.*`` array appears as ``<key>.count``, its length.
        tensors: Name to tensor, in file order.
    """

    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def read_gguf(path: Path) -> GGUFContents:
    """Read ``path``'s key/values and map its tensors.

    Args:
        path: A GGUF file.

    Returns:
        Its contents.

    Raises:
        ValueError: the file is not a GGUF v2/v3 little-endian file, or it is truncated or
            inconsistent (struct, numpy and decoding errors are reported as ``ValueError``).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    buffer = mapped.data  # struct reads from the map without copying the file
    try:
        reader = _Reader(buffer)
        if bytes(buffer[:4]) != _MAGIC:
            raise ValueError("the file does not start with the GGUF magic")
        reader.offset = 4
        version = reader.scalar("<I")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version must be one of {_VERSIONS}, got {version}")
        tensor_count, kv_count = reader.scalar("<Q"), reader.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = reader.string()
            kind = reader.scalar("<I")
            if kind == _ARRAY and key.startswith(_SKIPPED_PREFIX):
                metadata[f"{key}.count"] = reader.skip_array()
            else:
                metadata[key] = reader.value(kind)
        records = []
        for _ in range(tensor_count):
            name = reader.string()
            dims = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
            records.append((name, dims, reader.scalar("<I"), reader.scalar("<Q")))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
        start = -(-reader.offset // alignment) * alignment
        tensors: dict[str, GGUFTensor] = {}
        for name, dims, raw_type, offset in records:
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears twice")
            tensor_type = GGMLQuantizationType(raw_type)
            shape = tuple(reversed(dims))
            count = int(np.prod(shape, dtype=np.int64))
            block, size = GGML_QUANT_SIZES[tensor_type]
            item = _PLAIN.get(tensor_type.name)
            first = start + offset
            if item is None:
                shape = quant_shape_to_byte_shape(shape, tensor_type)
                raw = mapped[first : first + count * size // block]
            else:
                raw = mapped[first : first + count * np.dtype(item).itemsize].view(item)
            tensors[name] = GGUFTensor(name, tensor_type, raw.reshape(shape))
    except (struct.error, IndexError, KeyError, UnicodeDecodeError, OverflowError) as error:
        raise ValueError(f"{type(error).__name__}: {error}") from error
    return GGUFContents(metadata, tensors)


#: Tensor types stored as plain numbers (GGUFReader gives them their numpy type).
_PLAIN = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class _Reader:
    """A cursor over the file's bytes."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0

    def scalar(self, layout: str) -> Any:
        (value,) = struct.unpack_from(layout, self.buffer, self.offset)
        self.offset += struct.calcsize(layout)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        text = bytes(self.buffer[self.offset : end]).decode("utf-8")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            return [self.value(item) for _ in range(count)]
        layout = _SCALARS.get(kind)
        if layout is None:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(layout)

    def skip_array(self) -> int:
        """Step over an array (its item type and length come next); return its length."""
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item == _STRING:
            for _ in range(count):
                length = self.scalar("<Q")  # (it moves the offset past itself first)
                self.offset += length
        elif item in _SCALARS:
            self.offset += count * struct.calcsize(_SCALARS[item])
        else:
            for _ in range(count):
                self.value(item)
        if self.offset > len(self.buffer):
            raise ValueError("an array runs past the end of the file")
        return int(count)
