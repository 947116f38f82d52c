"""synthetic_model: made once, kept in the artifact cache, read back checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from twostroke.engine.artifacts.cache import ArtifactCache
from twostroke.engine.synthetic.cached import (
    SyntheticCacheUnavailable,
    synthetic_model,
    synthetic_named,
)
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


def test_a_synthetic_name_is_its_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model synthetic:SHAPE[:TYPE]`` (the bench's): GGUF F16 unless a type says
    otherwise, a Hugging Face folder for a dtype; other names are not synthetic."""
    monkeypatch.setenv("TWOSTROKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TWOSTROKE_NO_CACHE", raising=False)
    cache = ArtifactCache(tmp_path / "cache")
    assert synthetic_named("smollm2") is None
    assert synthetic_named("test-llama") is None
    assert synthetic_named("synthetic:test-llama") == synthetic_model(
        "test-llama", "gguf", "f16", cache=cache
    )
    assert synthetic_named("synthetic:test-llama:q8_0") == synthetic_model(
        "test-llama", "gguf", "q8_0", cache=cache
    )
    folder = synthetic_named("synthetic:test-llama:float32")
    assert folder == synthetic_model("test-llama", "hf", "float32", cache=cache)
    assert folder is not None
    assert (folder / "config.json").is_file()
    with pytest.raises(ValueError, match=r"GGUF type \(f16, q8_0, q4_k_m\) .* got 'int4'"):
        synthetic_named("synthetic:test-llama:int4")
    with pytest.raises(ValueError, match=r"synthetic:SHAPE\[:TYPE\], got 'synthetic:a:b:c'"):
        synthetic_named("synthetic:a:b:c")
    with pytest.raises(UnknownShape, match="got 'gpt-5'"):
        synthetic_named("synthetic:gpt-5")


def test_the_bench_takes_a_synthetic_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from twostroke.engine.bench.model import ModelSpec

    monkeypatch.setenv("TWOSTROKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TWOSTROKE_NO_CACHE", raising=False)
    spec = ModelSpec.resolve("synthetic:test-qwen3:q8_0", work_dir=tmp_path / "run")
    assert spec.is_gguf
    assert spec.source.name == "model.gguf"
    assert spec.source == synthetic_named("synthetic:test-qwen3:q8_0")
    # The engine opens the file (it knows no synthetic: names); other names as they are.
    assert spec.engine_model == str(spec.source)
    assert ModelSpec(name="toy", source=tmp_path).engine_model == "toy"


def test_a_shape_s_first_layers_are_a_model_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``synthetic:SHAPE@N[:TYPE]``: the first N layers, under their own name and cache
    entry, read by the bench as any synthetic name."""
    monkeypatch.setenv("TWOSTROKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TWOSTROKE_NO_CACHE", raising=False)
    cache = ArtifactCache(tmp_path / "cache")
    part = synthetic_named("synthetic:test-qwen3moe@1:q8_0")
    assert part == synthetic_model("test-qwen3moe@1", "gguf", "q8_0", cache=cache)
    assert part is not None
    assert "synthetic-test-qwen3moe@1-" in str(part)
    fields = gguf.GGUFReader(part).fields
    assert fields["qwen3moe.block_count"].contents() == 1
    assert fields["qwen3moe.expert_count"].contents() == 8
    assert fields["general.name"].contents() == "synthetic test-qwen3moe@1"
    whole = synthetic_model("test-qwen3moe", "gguf", "q8_0", cache=cache)
    assert whole.parent.parent != part.parent.parent
    assert len(cache.entries()) == 2
    (record,) = (r for e in cache.entries() for _, r in e.artifacts if "@1" in e.path.name)
    assert record is not None
    assert record.provenance.source == "synthetic:test-qwen3moe@1"
    with pytest.raises(UnknownShape, match=r"in \[1, 2\] for test-qwen3moe, got 3"):
        synthetic_named("synthetic:test-qwen3moe@3")
