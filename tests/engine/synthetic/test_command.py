"""``twostroke synthesize``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twostroke.engine.cli import main


def test_list_prints_every_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synthesize", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen3-0.6b", "qwen3-4b", "llama-3.2-1b", "gemma-3-1b", "phi-4-mini"):
        assert name in out
    assert "3.76 B parameters" in out  # qwen3-4b, its 151936-token vocabulary cut to 49152
    # The mixtures: every expert counted, and those a token reads.
    assert "6.91 B parameters (1.28 B active, top 8 of 64 experts), 16 layers" in out
    assert "30.11 B parameters (2.93 B active, top 8 of 128 experts), 48 layers" in out


def test_gguf_is_written_into_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synthesize", "test-llama", "--format", "gguf", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "test-llama-f16.gguf")
    assert (tmp_path / "test-llama-f16.gguf").stat().st_size > 0


def test_a_shape_s_first_layers_are_written_under_their_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["synthesize", "test-olmoe@1", "--format", "hf", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert config["num_experts"] == 8
    with pytest.raises(SystemExit) as exited:
        main(["synthesize", "test-olmoe@0", "--format", "hf", "--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "argument SHAPE: a shape's layers NAME@N must be in [1, 2]" in capsys.readouterr().err


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["synthesize", "nope", "--format", "hf", "--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "argument SHAPE: a synthetic model's shape must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["synthesize", "test-llama"])
    assert "required: --format, --out" in capsys.readouterr().err
    code = main(
        ["synthesize", "test-llama", "--format", "gguf", "--type", "q4_k_m", "--out", str(tmp_path)]
    )
    assert code == 2
    assert "needs --llamacpp-python PY" in capsys.readouterr().err
