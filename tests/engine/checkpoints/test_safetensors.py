"""read_into: a safetensors file read straight into existing tensors, or an error saying why not."""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from twostroke.engine.checkpoints.safetensors import read_into


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 3, generator=generator),
        "b.bias": torch.randn(7, generator=generator).to(torch.bfloat16),
        "c.half": torch.randn(2, 2, 2, generator=generator).to(torch.float16),
        "d.empty": torch.empty(0),
    }


def empty_like(source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(tensor, 7) for name, tensor in source.items()}


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path / "model.safetensors"
    source = tensors()
    save_file(source, path)
    return path, source


def test_every_tensor_is_read_into_its_destination(
    written: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, source = written
    destination = empty_like(source)
    storage = {name: tensor.data_ptr() for name, tensor in destination.items()}
    read_into(path, destination)
    for name, tensor in destination.items():
        assert torch.equal(tensor, source[name])
        assert tensor.data_ptr() == storage[name]  # filled in place, not replaced


def error_of(path: Path, destination: dict[str, torch.Tensor]) -> str:
    with pytest.raises(ValueError) as caught:  # noqa: PT011 (the messages are pinned below)
        read_into(path, destination)
    return str(caught.value)


def test_a_missing_or_unexpected_name(written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, source = written
    destination = empty_like(source)
    destination["e.extra"] = destination.pop("a.weight")
    assert error_of(path, destination) == (
        f"{path}: tensors differ (missing ['e.extra'], unexpected ['a.weight'])"
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda t: t.to(torch.float16), "a.weight is F32 [5, 3], expected torch.float16 [5, 3]"),
        (lambda t: t.reshape(3, 5), "a.weight is F32 [5, 3], expected torch.float32 [3, 5]"),
    ],
)
def test_a_different_dtype_or_shape(
    written: tuple[Path, dict[str, torch.Tensor]], change: object, expected: str
) -> None:
    path, source = written
    destination = empty_like(source)
    destination["a.weight"] = change(destination["a.weight"])  # type: ignore[operator]
    assert error_of(path, destination) == f"{path}: {expected}"


def test_a_destination_that_is_not_contiguous(
    written: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, source = written
    destination = empty_like(source)
    destination["a.weight"] = torch.zeros(3, 5).t()
    assert error_of(path, destination) == (
        "a.weight: the destination must be contiguous on the CPU"
    )


def test_a_truncated_file(written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, source = written
    path.write_bytes(path.read_bytes()[:-10])
    assert re.fullmatch(
        rf"{re.escape(str(path))}: truncated \(\d+ of \d+ bytes of a tensor\)",
        error_of(path, empty_like(source)),
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x01\x02", "too short for a safetensors header"),
        (struct.pack("<Q", 2**40), f"a header of {2**40} bytes is not a safetensors header"),
        (struct.pack("<Q", 3) + b"{no", "the header is not JSON (Expecting property name"),
        (struct.pack("<Q", 2) + b"[]", "the header is not a JSON object"),
    ],
)
def test_a_file_that_is_not_safetensors(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    assert error_of(path, {}).startswith(f"{path}: {expected}")


def test_bad_offsets(tmp_path: Path) -> None:
    header = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    assert error_of(path, {"x": torch.zeros(1)}) == f"{path}: bad data_offsets [4, 0]"


def test_it_returns_the_crc32_of_every_byte_it_read(
    written: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """The artifact cache checks the weights with it: one pass over the file."""
    path, source = written
    assert read_into(path, empty_like(source)) == zlib.crc32(path.read_bytes())
    padded = path.with_name("padded.safetensors")
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    body = b""
    for name, entry in entries:  # 5 bytes between tensors, 3 after the last
        begin, end = entry["data_offsets"]
        offset = len(body) + 5
        body += b"\x00" * 5 + data[8 + length + begin : 8 + length + end]
        header[name]["data_offsets"] = [offset, offset + end - begin]
    text = json.dumps(header).encode()
    padded.write_bytes(struct.pack("<Q", len(text)) + text + body + b"end")
    destination = empty_like(source)
    assert read_into(padded, destination) == zlib.crc32(padded.read_bytes())
    assert all(torch.equal(destination[name], source[name]) for name in source)


def test_tensors_that_overlap_are_refused(written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, source = written
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["b.bias"]["data_offsets"] = [0, 14]  # over a.weight's first bytes
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    assert re.search(r"overlaps the tensor before it", error_of(path, empty_like(source)))
