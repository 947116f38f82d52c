"""read_gguf against the gguf package's own reader, and the files it refuses."""

from __future__ import annotations

import re
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
        # a count that the bytes left cannot hold, a read past the end, or a tensor's data
        with pytest.raises(ValueError, match=r"are left in the file|requires a buffer|past"):
            read_gguf(truncated)


# --- llama.cpp's rules, on files written byte by byte -------------------------------------

U32, STRING, ARRAY = 4, 8, 9
F32 = 0


def text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<Q", len(raw)) + raw


def key_value(key: str, kind: int, payload: bytes) -> bytes:
    return text(key) + struct.pack("<I", kind) + payload


def array(item: int, count: int, items: bytes = b"") -> bytes:
    return struct.pack("<IQ", item, count) + items


def record(name: str, dims: list[int], offset: int, kind: int = F32) -> bytes:
    return (
        text(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", dim) for dim in dims)
        + struct.pack("<IQ", kind, offset)
    )


def handmade(
    path: Path,
    kvs: list[bytes],
    records: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    *,
    tensor_count: int | None = None,
    kv_count: int | None = None,
) -> Path:
    """A GGUF v3 file of these key/values, tensor records and data (aligned to 32)."""
    head = b"GGUF" + struct.pack(
        "<IQQ",
        3,
        len(records) if tensor_count is None else tensor_count,
        len(kvs) if kv_count is None else kv_count,
    )
    body = head + b"".join(kvs) + b"".join(records)
    body += bytes(-len(body) % 32)
    path.write_bytes(body + data)
    return path


def two_tensors(path: Path, second_offset: int, data_bytes: int = 64) -> Path:
    """``a`` (4 floats, 16 bytes: its aligned end is 32) and ``b`` (4 floats) at
    ``second_offset``."""
    records = [record("a", [4], 0), record("b", [4], second_offset)]
    data = np.arange(data_bytes // 4, dtype=np.float32).tobytes()
    return handmade(path, [], records, data)


def test_a_handmade_file_reads(tmp_path: Path) -> None:
    """The builder's files are valid: what the rules below refuse is the one change each."""
    path = two_tensors(tmp_path / "ok.gguf", 32)
    kvs = [key_value("test.words", ARRAY, array(STRING, 2, text("a") + text("bc")))]
    contents = read_gguf(handmade(tmp_path / "kv.gguf", kvs))
    assert contents.metadata == {"test.words": ["a", "bc"]}
    tensors = read_gguf(path).tensors
    assert [(t.name, t.shape) for t in tensors.values()] == [("a", (4,)), ("b", (4,))]
    assert tensors["b"].data.tolist() == [8.0, 9.0, 10.0, 11.0]
    assert np.array_equal(gguf.GGUFReader(path).tensors[1].data, tensors["b"].data)


@pytest.mark.parametrize(
    ("key", "item", "item_bytes"),
    [
        ("test.ints", U32, 4),
        ("test.words", STRING, 8),
        ("tokenizer.ggml.tokens", STRING, 8),  # stepped over, not read
        ("tokenizer.ggml.token_type", U32, 4),
    ],
)
def test_an_array_longer_than_the_file_is_refused_before_it_is_read(
    tmp_path: Path, key: str, item: int, item_bytes: int
) -> None:
    """A count of 2**40 once made the reader parse the rest of the file item by item (15 s
    and 500 MiB for SmolLM2's file); the count must fit in the bytes left."""
    count = 2**40
    path = handmade(tmp_path / "lying.gguf", [key_value(key, ARRAY, array(item, count))])
    left = len(path.read_bytes()) - (24 + len(key_value(key, ARRAY, array(item, count))))
    with pytest.raises(
        ValueError,
        match=rf"^key '{re.escape(key)}''s array length is {count}: {count} items of at least "
        rf"{item_bytes} bytes need {count * item_bytes} bytes, and {left} are left in the file$",
    ):
        read_gguf(path)


def test_an_array_of_arrays_is_refused(tmp_path: Path) -> None:
    """Nested arrays recursed once per level (a RecursionError); GGUF has none."""
    nested = array(ARRAY, 1, array(ARRAY, 1, array(U32, 0)))
    path = handmade(tmp_path / "nested.gguf", [key_value("test.nested", ARRAY, nested)])
    with pytest.raises(
        ValueError, match=r"^key 'test\.nested' is an array of arrays, which GGUF does not allow$"
    ):
        read_gguf(path)
    deep = b"".join(array(ARRAY, 1) for _ in range(100_000)) + array(U32, 0)
    path = handmade(tmp_path / "deep.gguf", [key_value("test.deep", ARRAY, deep)])
    with pytest.raises(ValueError, match=r"^key 'test\.deep' is an array of arrays"):
        read_gguf(path)


def test_a_key_twice_is_refused(tmp_path: Path) -> None:
    twice = [key_value("general.name", STRING, text(name)) for name in ("a", "b")]
    with pytest.raises(ValueError, match=r"^key 'general\.name' appears twice$"):
        read_gguf(handmade(tmp_path / "twice.gguf", twice))


def test_counts_the_file_cannot_hold_are_refused(tmp_path: Path) -> None:
    path = handmade(tmp_path / "kvs.gguf", [], kv_count=2**50)
    with pytest.raises(ValueError, match=r"^the key/value count is 1125899906842624: "):
        read_gguf(path)
    path = handmade(tmp_path / "tensors.gguf", [], tensor_count=2**50)
    with pytest.raises(ValueError, match=r"^the tensor count is 1125899906842624: "):
        read_gguf(path)


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        # A record of 2**32 - 1 dimensions once read 2.7 s and 684 MiB of them.
        ([5] * 5, r"^tensor 'x' has 5 dimensions: a tensor has 1 to 4$"),
        ([], r"^tensor 'x' has 0 dimensions: a tensor has 1 to 4$"),
        ([4, 0], r"^tensor 'x' has a dimension of 0: \[4, 0\]$"),
    ],
)
def test_tensor_dimensions_are_bounded(tmp_path: Path, dims: list[int], message: str) -> None:
    path = handmade(tmp_path / "dims.gguf", [], [record("x", dims, 0)], bytes(64))
    with pytest.raises(ValueError, match=message):
        read_gguf(path)


def test_a_huge_dimension_count_is_refused_before_its_dimensions_are_read(
    tmp_path: Path,
) -> None:
    raw = text("x") + struct.pack("<I", 2**32 - 1)  # and no dimensions after it
    path = handmade(tmp_path / "huge.gguf", [], [raw])
    with pytest.raises(ValueError, match=r"^tensor 'x' has 4294967295 dimensions: "):
        read_gguf(path)


@pytest.mark.parametrize(
    ("offset", "message"),
    [
        # b over a (it began inside a's 16 bytes): loaded silently before.
        (0, r"^tensor 'b' starts at offset 0, expected 32 \(each tensor starts at the end of "),
        (16, r"^tensor 'b' starts at offset 16, expected 32 "),
        (64, r"^tensor 'b' starts at offset 64, expected 32 "),  # a gap
    ],
)
def test_each_tensor_starts_at_the_aligned_end_of_the_one_before(
    tmp_path: Path, offset: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        read_gguf(two_tensors(tmp_path / "overlap.gguf", offset))


def test_the_last_tensor_ends_inside_the_file(tmp_path: Path) -> None:
    path = two_tensors(tmp_path / "short.gguf", 32, data_bytes=40)
    with pytest.raises(
        ValueError,
        match=r"^tensor 'b' ends at offset 48 of the data, past its end \(40 bytes\): the "
        r"file is truncated or the tensor too large$",
    ):
        read_gguf(path)
    huge = handmade(tmp_path / "huge.gguf", [], [record("x", [2**20, 2**20, 2**20], 0)])
    with pytest.raises(ValueError, match=r"^tensor 'x' ends at offset 4611686018427387904 "):
        read_gguf(huge)


def test_a_tensor_twice_is_refused(tmp_path: Path) -> None:
    path = handmade(
        tmp_path / "twice.gguf", [], [record("a", [4], 0), record("a", [4], 32)], bytes(64)
    )
    with pytest.raises(ValueError, match=r"^tensor 'a' appears twice$"):
        read_gguf(path)


def test_unknown_types_and_partial_blocks_are_refused(tmp_path: Path) -> None:
    path = handmade(tmp_path / "type.gguf", [], [record("a", [4], 0, kind=99)], bytes(32))
    with pytest.raises(ValueError, match=r"^tensor 'a' has unknown type 99$"):
        read_gguf(path)
    path = handmade(tmp_path / "q8.gguf", [], [record("q", [40], 0, kind=Q8_0)], bytes(64))
    with pytest.raises(
        ValueError,
        match=r"^tensor 'q' \(Q8_0\) has rows of 40 weights, not a multiple of its block of 32$",
    ):
        read_gguf(path)


def test_mmap_false_reads_the_same_tensors_into_memory(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    write(path)
    mapped, read = read_gguf(path), read_gguf(path, mmap=False)
    assert read.metadata == mapped.metadata
    expected = {name: np.array(tensor.data) for name, tensor in mapped.tensors.items()}
    for name, tensor in read.tensors.items():
        assert tensor.shape == mapped.tensors[name].shape
        assert not isinstance(tensor.data.base, np.memmap)
        assert not tensor.data.flags.writeable
    del mapped  # (a mapped page read past the new end would be SIGBUS)
    path.write_bytes(b"")  # truncated in place: what was read stays
    for name, tensor in read.tensors.items():
        assert np.array_equal(tensor.data, expected[name])


def test_a_key_that_is_not_utf8_is_named_by_its_place(tmp_path: Path) -> None:
    value = struct.pack("<Q", 2) + b"\xff\xfe"
    path = handmade(tmp_path / "bytes.gguf", [key_value("test.text", STRING, value)])
    with pytest.raises(ValueError, match=r"^key 'test\.text': UnicodeDecodeError: "):
        read_gguf(path)
