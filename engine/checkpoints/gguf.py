"""Reading a GGUF file's key/values and tensors, skipping the vocabulary.

The ``gguf`` package's ``GGUFReader`` parses every value into numpy views, several per
string: SmolLM2's 49 152 tokens and 48 900 merges cost it two seconds, for arrays the model
never reads (the tokenizer is built from the file separately). This reader walks the same
layout with ``struct`` and steps over the ``tokenizer.*`` arrays, keeping only their
lengths, in a few tens of milliseconds. Tensors stay memory-mapped, shaped as ``GGUFReader``
shapes them, so ``gguf.quants.dequantize`` decodes them.

A file is input from anywhere: every count and size in it is checked against the bytes it
has before it is acted on (see :func:`read_gguf`), so that a lying header is refused in
microseconds instead of driving a parse through the rest of the file or a large allocation.

The layout (GGUF v2 and v3, little-endian): magic, version, tensor count, key/value count;
the key/values; one record per tensor (name, dimensions, type, offset); padding to the
``general.alignment``; the tensor data.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from twostroke.engine.kernels.gguf_blocks import BLOCK_BYTES, block_weights

__all__ = ["BLOCK_TYPES", "BlockTensor", "GGUFContents", "GGUFTensor", "read_gguf"]

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


#: The block types twostroke computes as stored (the types its block products compute,
#: :data:`~twostroke.engine.kernels.gguf_blocks.BLOCK_BYTES`): a file's name for each, to
#: GGML's type number (``gguf.GGMLQuantizationType``).
BLOCK_TYPES: Mapping[str, int] = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
}


@attrs.frozen
class BlockTensor:
    """One weight matrix in GGUF blocks, as the file stores it (not copied).

    Attributes:
        name: The file's name for it (``blk.0.attn_q.weight``).
        block_type: GGML's type number (one of :data:`BLOCK_TYPES`).
        data: ``uint8 [out_features, row bytes]``: each weight row's blocks, in order (a
            view of the file's memory map; read only).
        columns: Where each stored row's product goes among the output columns
            (``int32 [out_features]``, a permutation), or ``None`` for the stored order:
            GGUF's rotary order of the q/k rows is undone this way, the blocks untouched.
    """

    name: str
    block_type: int
    data: np.ndarray[Any, Any] = attrs.field(repr=False)
    columns: torch.Tensor | None = attrs.field(default=None, repr=False)
    #: The stored rows in output order (``int64``, the inverse of ``columns``): the rows the
    #: dense path dequantizes, so that its weight is in the output's order.
    order: torch.Tensor = attrs.field(init=False, repr=False, eq=False)

    @order.default
    def _order(self) -> torch.Tensor:
        rows = int(self.data.shape[0])
        if self.columns is None:
            return torch.arange(rows, dtype=torch.int64)
        return torch.argsort(self.columns.to(torch.int64))

    def __attrs_post_init__(self) -> None:
        size = BLOCK_BYTES.get(self.block_type)
        if size is None:
            raise ValueError(
                f"{self.name}: block type {self.block_type} is not one of {dict(BLOCK_TYPES)}"
            )
        if self.data.dtype != np.uint8 or self.data.ndim != 2 or self.data.shape[1] % size:
            raise ValueError(
                f"{self.name}: blocks must be uint8 [rows, a multiple of {size} bytes], got "
                f"{self.data.dtype} {self.data.shape}"
            )
        if not self.data.flags.c_contiguous:
            raise ValueError(f"{self.name}: blocks must be contiguous")
        columns = self.columns
        if columns is not None and (
            columns.dtype != torch.int32 or tuple(columns.shape) != (self.out_features,)
        ):
            raise ValueError(
                f"{self.name}: columns must be int32 [{self.out_features}], got "
                f"{columns.dtype} {tuple(columns.shape)}"
            )

    @property
    def type_name(self) -> str:
        """``"Q4_1"``, ...."""
        return next(name for name, number in BLOCK_TYPES.items() if number == self.block_type)

    @property
    def out_features(self) -> int:
        """Stored weight rows."""
        return int(self.data.shape[0])

    @property
    def in_features(self) -> int:
        """Weights a row."""
        return (
            int(self.data.shape[1]) // BLOCK_BYTES[self.block_type] * block_weights(self.block_type)
        )

    @property
    def address(self) -> int:
        """Where the blocks are."""
        return int(self.data.__array_interface__["data"][0])

    @property
    def nbytes(self) -> int:
        """Bytes the blocks take."""
        return int(self.data.nbytes)


@attrs.frozen
class GGUFTensor:
    """One tensor of the file.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        tensor_type: The ``gguf.GGMLQuantizationType``.
        data: Memory-mapped (or in memory, read with ``mmap=False``), shaped as
            ``GGUFReader`` shapes it (numpy order; for quantized types, bytes per row as the
            last dimension).
        shape: The tensor's own shape, numpy order (the weights per row last), whatever its
            type.
    """

    name: str
    tensor_type: Any
    data: np.ndarray[Any, Any]
    shape: tuple[int, ...]


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


def read_gguf(path: Path, *, mmap: bool = True) -> GGUFContents:
    """Read ``path``'s key/values and map its tensors.

    Every size the file states is checked against the bytes it has before anything is
    read or allocated by it, by llama.cpp's rules (``gguf_init_from_file``): an array's
    items must fit in the bytes left (a string takes at least its 8-byte length), arrays
    hold no arrays, a tensor has 1 to :data:`MAX_DIMS` dimensions, each at least 1, each
    tensor starts at the aligned end of the one before it in the file's order (the first
    at 0) and the last ends inside the file, and no key or tensor name appears twice.

    Args:
        path: A GGUF file.
        mmap: Map the file (its tensors are views of the map, read as they are used);
            ``False`` reads the whole file into memory, so that the tensors outlive a later
            change to the file (a file truncated while mapped kills the process with
            SIGBUS when a page past its new end is read).

    Returns:
        Its contents.

    Raises:
        ValueError: the file is not a GGUF v2/v3 little-endian file, or it is truncated or
            inconsistent; the message names the key or tensor at fault (struct, numpy and
            decoding errors are reported as ``ValueError`` too).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    if mmap:
        raw_file: np.ndarray[Any, Any] = np.memmap(path, mode="r", dtype=np.uint8)
    else:
        raw_file = np.fromfile(path, dtype=np.uint8)
        raw_file.flags.writeable = False  # as the map's views are
    buffer = raw_file.data  # struct reads from the bytes without copying the file
    reader = _Reader(buffer)
    try:
        if bytes(buffer[:4]) != _MAGIC:
            raise ValueError("the file does not start with the GGUF magic")
        reader.offset = 4
        version = reader.scalar("<I")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version must be one of {_VERSIONS}, got {version}")
        tensor_count, kv_count = reader.scalar("<Q"), reader.scalar("<Q")
        # The smallest key/value and tensor record, so that a count that lies is refused
        # here rather than after reading up to the end of the file.
        reader.fits("the key/value count", kv_count, _MIN_KV_BYTES)
        reader.fits("the tensor count", tensor_count, _MIN_TENSOR_BYTES)
        metadata = _read_metadata(reader, kv_count)
        records = [_read_record(reader) for _ in range(tensor_count)]
    except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as error:
        # (The reader's own ValueErrors name what they are about already.)
        raise ValueError(f"{reader.where}: {type(error).__name__}: {error}") from error
    alignment = metadata.get("general.alignment", 32)
    if (
        not isinstance(alignment, int)
        or isinstance(alignment, bool)
        or alignment < 1
        or alignment & (alignment - 1)
    ):
        raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
    start = _aligned(reader.offset, alignment)
    data_bytes = len(buffer) - start
    tensors: dict[str, GGUFTensor] = {}
    expected = 0  # llama.cpp's running sum: each tensor at the aligned end of the one before
    for name, dims, raw_type, offset in records:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
            block, size = GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
        if dims[0] % block:
            raise ValueError(
                f"tensor {name!r} ({tensor_type.name}) has rows of {dims[0]} weights, not a "
                f"multiple of its block of {block}"
            )
        shape = tuple(reversed(dims))
        nbytes = math.prod(dims) // block * size
        if offset != expected:
            raise ValueError(
                f"tensor {name!r} starts at offset {offset}, expected {expected} (each "
                f"tensor starts at the end of the one before it, aligned to {alignment})"
            )
        if offset + nbytes > data_bytes:
            raise ValueError(
                f"tensor {name!r} ends at offset {offset + nbytes} of the data, past its end "
                f"({max(data_bytes, 0)} bytes): the file is truncated or the tensor too large"
            )
        expected = _aligned(offset + nbytes, alignment)
        item = _PLAIN.get(tensor_type.name)
        first = start + offset
        if item is None:
            stored = quant_shape_to_byte_shape(shape, tensor_type)
            data = raw_file[first : first + nbytes]
        else:
            stored = shape
            data = raw_file[first : first + nbytes].view(item)
        tensors[name] = GGUFTensor(name, tensor_type, data.reshape(stored), shape)
    return GGUFContents(metadata, tensors)


#: The most dimensions a tensor has (llama.cpp's ``GGML_MAX_DIMS``).
MAX_DIMS = 4
#: The fewest bytes a key/value takes (an empty key's length, the type, a one-byte value)
#: and a tensor record (an empty name's length, one dimension, the type, the offset).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8


def _aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _read_metadata(reader: _Reader, count: int) -> dict[str, Any]:
    """``count`` key/values; a ``tokenizer.*`` array as its length (``<key>.count``)."""
    metadata: dict[str, Any] = {}
    seen: set[str] = set()
    for _ in range(count):
        reader.where = "a key"
        key = reader.string()
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen.add(key)
        reader.where = f"key {key!r}"
        kind = reader.scalar("<I")
        if kind == _ARRAY and key.startswith(_SKIPPED_PREFIX):
            metadata[f"{key}.count"] = reader.skip_array()
        else:
            metadata[key] = reader.value(kind)
    return metadata


def _read_record(reader: _Reader) -> tuple[str, list[int], int, int]:
    """One tensor's name, dimensions (GGUF order: the row first), type and offset."""
    reader.where = "a tensor name"
    name = reader.string()
    reader.where = f"tensor {name!r}"
    n_dims = reader.scalar("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions: a tensor has 1 to {MAX_DIMS}")
    dims = [reader.scalar("<Q") for _ in range(n_dims)]
    if min(dims) < 1:
        raise ValueError(f"tensor {name!r} has a dimension of 0: {dims}")
    return name, dims, reader.scalar("<I"), reader.scalar("<Q")


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
    """A cursor over the file's bytes.

    Attributes:
        where: What is being read (``"key 'general.name'"``), for the messages of errors
            that do not say it themselves (a struct error at the end of the file).
    """

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0
        self.where = "the header"

    def fits(self, what: str, count: int, item_bytes: int) -> None:
        """Refuse ``count`` items of at least ``item_bytes`` each where fewer bytes are left."""
        left = len(self.buffer) - self.offset
        if count * item_bytes > left:
            raise ValueError(
                f"{what} is {count}: {count} items of at least {item_bytes} bytes need "
                f"{count * item_bytes} bytes, and {max(left, 0)} are left in the file"
            )

    def scalar(self, layout: str) -> Any:
        (value,) = struct.unpack_from(layout, self.buffer, self.offset)
        self.offset += struct.calcsize(layout)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(
                f"{self.where}: a string of {length} bytes runs past the end of the file"
            )
        text = bytes(self.buffer[self.offset : end]).decode("utf-8")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.array_header()
            if item == _STRING:
                return [self.string() for _ in range(count)]
            # One numpy read, not an unpack an item: as fast as the bytes allow.
            values = np.frombuffer(self.buffer, np.dtype(_SCALARS[item]), count, self.offset)
            self.offset += count * values.itemsize
            return values.tolist()
        scalar = _SCALARS.get(kind)
        if scalar is None:
            raise ValueError(f"{self.where} has unknown GGUF value type {kind}")
        return self.scalar(scalar)

    def array_header(self) -> tuple[int, int]:
        """An array's item type and length, checked: scalars or strings (llama.cpp nests no
        arrays), as many as the bytes left can hold."""
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item == _ARRAY:
            raise ValueError(f"{self.where} is an array of arrays, which GGUF does not allow")
        if item == _STRING:
            self.fits(f"{self.where}'s array length", count, 8)  # each string's length
        elif item in _SCALARS:
            self.fits(f"{self.where}'s array length", count, struct.calcsize(_SCALARS[item]))
        else:
            raise ValueError(f"{self.where} is an array of unknown GGUF value type {item}")
        return item, count

    def skip_array(self) -> int:
        """Step over an array (its item type and length come next); return its length."""
        item, count = self.array_header()
        if item == _STRING:
            for _ in range(count):
                length = self.scalar("<Q")  # (it moves the offset past itself first)
                self.offset += length
                if self.offset > len(self.buffer):
                    raise ValueError(f"{self.where}: an array runs past the end of the file")
        else:
            self.offset += count * struct.calcsize(_SCALARS[item])
        return int(count)
