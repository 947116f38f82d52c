"""synthetic_model: made once, kept in the artifact cache, read back checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from twostroke.engine.artifacts.cache import ArtifactCache
from twostroke.engine.synthetic.cached import SyntheticCacheUnavailable, synthetic_model
from twostroke.engine.synthetic.gguf_file import QuantizerUnavailable
from twostroke.engine.synthetic.shapes import UnknownShape

gguf = pytest.importorskip("gguf")


def test_made_once_then_read_back(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    path = synthetic_model("test-qwen3", "gguf", "q8_0", cache=cache)
    assert path.name == "model.gguf"
    assert path.is_relative_to(cache.root)
    made = path.stat().st_mtime_ns
    assert synthetic_model("test-qwen3", "gguf", "q8_0", cache=cache) == path
    assert path.stat().st_mtime_ns == made  # not written again
    (entry,) = cache.entries()
    ((artifact, record),) = entry.artifacts
    assert artifact == "gguf-q8_0"
    assert record is not None
    assert record.provenance.source == "synthetic:test-qwen3"
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "qwen3"


def test_a_damaged_model_is_made_again(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    folder = synthetic_model("test-llama", "hf", cache=cache)
    assert folder.name == "hf-bfloat16"
    assert (folder / "config.json").is_file()
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert synthetic_model("test-llama", "hf", cache=cache) == folder
    assert weights.read_bytes() != bytes(data)


def test_errors_name_the_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    with pytest.raises(UnknownShape, match="got 'gpt-5'"):
        synthetic_model("gpt-5", "hf", cache=cache)
    with pytest.raises(ValueError, match="format must be 'hf' or 'gguf'; got 'onnx'"):
        synthetic_model("test-llama", "onnx", cache=cache)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype must be one of bfloat16, .*; got 'q8_0'"):
        synthetic_model("test-llama", "hf", "q8_0", cache=cache)
    with pytest.raises(QuantizerUnavailable, match="needs --llamacpp-python"):
        synthetic_model("test-llama", "gguf", "q4_k_m", cache=cache)
    monkeypatch.setenv("TWOSTROKE_NO_CACHE", "1")
    with pytest.raises(SyntheticCacheUnavailable, match="TWOSTROKE_NO_CACHE=1 turns off"):
        synthetic_model("test-llama", "hf")
    assert not cache.root.exists() or not cache.entries()
