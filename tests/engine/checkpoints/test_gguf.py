"""read_gguf against the gguf package's own reader, and the files it refuses."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from twostroke.engine.checkpoints.gguf import read_gguf

Q8_0 = gguf.GGMLQuantizationType.Q8_0
BF16 = gguf.GGMLQuantizationType.BF16


def write(path: Path, *, alignment: int | None = None) -> None:
    """A file with every kind of value, a vocabulary, and tensors of several types."""
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -5)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_uint32("test.u32", 4_000_000_000)
    writer.add_int32("test.i32", -2_000_000_000)
    writer.add_float32("test.f32", 0.25)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**40))
    writer.add_float64("test.f64", 1e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.text", "héllo ✓")
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.floats", [0.5, 1.5])
    writer.add_array("test.words", ["a", "bc", ""])
    writer.add_token_list(["<s>", "</s>", "héllo", "▁world"] * 50)
    writer.add_token_types([1, 3, 1, 1] * 50)
    writer.add_token_merges(["h é", "l l"])
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("half.weight", rng.standard_normal((4, 6)).astype(np.float16))
    matrix = rng.standard_normal((2, 64)).astype(np.float32)
    writer.add_tensor("q8.weight", quantize(matrix, Q8_0), raw_dtype=Q8_0)
    writer.add_tensor("bf16.weight", quantize(matrix, BF16), raw_dtype=BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What gguf.GGUFReader reads, in read_gguf's terms."""
    reader = gguf.GGUFReader(path)
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if name.startswith("tokenizer.") and field.types[0] == gguf.GGUFValueType.ARRAY:
            metadata[f"{name}.count"] = len(field.data)
        else:
            metadata[name] = field.contents()
    return metadata, {tensor.name: tensor for tensor in reader.tensors}


@pytest.mark.parametrize("alignment", [None, 64])
def test_values_and_tensors_equal_the_gguf_reader(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "all.gguf"
    write(path, alignment=alignment)
    contents = read_gguf(path)
    metadata, tensors = reference(path)
    assert contents.metadata == metadata
    assert contents.metadata["tokenizer.ggml.tokens.count"] == 200
    assert contents.metadata["test.words"] == ["a", "bc", ""]
    assert contents.metadata["test.text"] == "héllo ✓"
    assert list(contents.tensors) == list(tensors)
    for name, tensor in contents.tensors.items():
        theirs = tensors[name]
        assert tensor.tensor_type == theirs.tensor_type
        assert tensor.data.dtype == theirs.data.dtype
        assert tensor.data.shape == theirs.data.shape
        assert np.array_equal(tensor.data, theirs.data)


def test_tensors_stay_memory_mapped(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    write(path)
    tensor = read_gguf(path).tensors["plain.weight"].data
    assert isinstance(tensor.base, np.memmap) or isinstance(tensor, np.memmap)


def corrupt(path: Path, tmp_path: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    bad = tmp_path / f"bad-{offset}.gguf"
    bad.write_bytes(bytes(raw))
    return bad


def test_what_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    write(path)
    raw = path.read_bytes()
    cases = [
        (corrupt(path, tmp_path, 0, b"GGML"), "does not start with the GGUF magic"),
        (
            corrupt(path, tmp_path, 4, struct.pack("<I", 1)),
            r"version must be one of \(2, 3\), got 1",
        ),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            read_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    for length in (30, 200, 2000, len(raw) - 40):
        truncated.write_bytes(raw[:length])
        # struct's "unpack_from requires a buffer", or numpy's "cannot reshape" for the data
        with pytest.raises(ValueError, match=r"requires a buffer|cannot reshape|past the end"):
            read_gguf(truncated)
