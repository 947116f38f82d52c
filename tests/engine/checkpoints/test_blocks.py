"""A GGUF file's blocks computed as stored (``quantization="gguf"``): what the model holds,
what it computes, and what it refuses."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.engine.checkpoints.test_loader import write_gguf
from tests.engine.models.test_llama import make_tiny_model, random_sequences
from twostroke.engine.artifacts.cache import NATIVE_FOLDER
from twostroke.engine.checkpoints import loader
from twostroke.engine.checkpoints.loader import BlockTypeUnsupported, ModelLoadError, load_model
from twostroke.engine.kernels.gguf_blocks import BlockEmbedding, BlockWeight
from twostroke.engine.models.linear import FullPrecision, Linear

# isa: the block products take the personality's path (AVX2 or portable C).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")
Q = GGMLQuantizationType


def write(tmp_path: Path, matrices: Any, embedding: Any, **overrides: Any) -> Path:
    reference = make_tiny_model("llama", tmp_path / "hf", **overrides)
    file = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(file, reference, "llama", matrices=matrices, embedding=embedding)
    return file


def blocks_and_reference(file: Path) -> tuple[Any, Any]:
    blocks = load_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="gguf")
    reference = load_model(file, dtype=torch.float32, device=CPU, quantization=None)
    return blocks, reference


def quantized(x: torch.Tensor) -> torch.Tensor:
    """The activations the block products multiply by (llama.cpp's rule per block of 32)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale != 0, 1 / torch.where(scale != 0, scale, 1), 0)
    return (torch.round(blocks * inverse) * scale).reshape(x.shape)


@pytest.mark.parametrize(
    ("matrices", "embedding", "tied"),
    [
        pytest.param(Q.Q4_1, Q.Q8_0, True, id="q4_1-q8_0-tied"),
        pytest.param(Q.Q4_0, Q.Q8_0, False, id="q4_0-q8_0"),
        pytest.param(Q.Q8_0, Q.F16, True, id="q8_0-f16-tied"),
    ],
)
def test_each_projection_computes_from_the_files_blocks_as_the_dequantized_weights_do(
    tmp_path: Path, matrices: Any, embedding: Any, tied: bool
) -> None:
    """Layer by layer, each projection (fused, with the rotary rows permuted back by the
    product's columns) equals the dequantized file's projection of the quantized
    activations; the embedding rows and the tied head likewise; the logits stay close."""
    file = write(tmp_path, matrices, embedding, tie_word_embeddings=tied)
    blocks, reference = blocks_and_reference(file)
    assert blocks.quantization == "gguf"
    model, dense = blocks.module, reference.module
    generator = torch.Generator().manual_seed(0)
    for mine, theirs in zip(model.modules(), dense.modules(), strict=True):
        if not isinstance(mine, Linear):
            continue
        assert isinstance(theirs, Linear)
        method = cast(FullPrecision, theirs.method)
        if embedding == Q.F16 and mine is model.lm_head:
            assert isinstance(mine.method, FullPrecision)  # a float head stays dense
            continue
        assert isinstance(mine.method, BlockWeight)
        x = torch.randn(5, mine.in_features, generator=generator)
        expected = F_linear(quantized(x).double(), method.weight.double())
        scale = float((quantized(x).double().abs() @ method.weight.double().abs().T).max())
        assert float((mine(x).double() - expected).abs().max()) <= 1e-5 * scale
    ids = torch.tensor([[0, 255, 3]])
    if embedding == Q.Q8_0:
        assert isinstance(model._embedding, BlockEmbedding)
        assert model.embed_tokens.numel() == 0  # no float copy of the embedding
    torch.testing.assert_close(
        model._embedding(ids) if model._embedding else model.embed_tokens[ids],
        dense.embed_tokens[ids],
        rtol=1e-6,
        atol=1e-7,
    )
    sequences = random_sequences([3, 20])
    for got, want in zip(
        model.forward_logits(sequences, chunk_size=6),
        dense.forward_logits(sequences, chunk_size=6),
        strict=True,
    ):
        # 8-bit activations: the tiny random model's logits move by a few percent.
        assert float((got - want).abs().max()) <= 0.08 * float(want.abs().max())


def F_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


def test_the_blocks_are_the_files_memory_and_nothing_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TWOSTROKE_CACHE_DIR", str(cache))
    file = write(tmp_path, Q.Q4_1, Q.Q8_0, tie_word_embeddings=True)
    loaded = load_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="gguf")
    method = loaded.module.layers[0].mlp.down_proj.method
    assert isinstance(method, BlockWeight)
    [part] = method.parts
    assert isinstance(part.data, np.memmap)
    assert Path(part.data.filename) == file.resolve()
    assert not weight_entries(cache)
    load_model(file, dtype=torch.float32, device=CPU, quantization=None)
    assert weight_entries(cache)  # where the dequantized weights are cached


def weight_entries(cache: Path) -> list[Path]:
    if not cache.exists():
        return []
    return [path for path in cache.iterdir() if path.name != NATIVE_FOLDER]


def test_a_type_not_computed_as_stored_is_an_error_naming_the_tensor(tmp_path: Path) -> None:
    file = write(tmp_path, Q.Q5_0, Q.Q8_0)
    with pytest.raises(BlockTypeUnsupported) as caught:
        load_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="gguf")
    assert caught.value.block_type == "Q5_0"
    assert caught.value.tensor.startswith("blk.0.")
    assert "is Q5_0, which quantization='gguf' does not compute as stored" in str(caught.value)
    # Without quantization='gguf' the file loads dequantized, as before.
    load_model(file, dtype=torch.float32, device=CPU, quantization=None)


def test_gguf_quantization_needs_a_gguf_file_and_float32_on_the_cpu(tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    make_tiny_model("llama", directory)
    with pytest.raises(ModelLoadError, match=r"quantization='gguf' .*: not a GGUF file"):
        load_model(directory, dtype=torch.float32, device=CPU, quantization="gguf")
    file = write(tmp_path, Q.Q4_1, Q.Q8_0)
    with pytest.raises(ValueError, match="float32 activations; got dtype bfloat16 on cpu"):
        load_model(file, dtype=torch.bfloat16, device=CPU, quantization="gguf")


@pytest.mark.parametrize(("matrices", "expected"), [(Q.Q4_1, "gguf"), (Q.Q5_0, "fp16")])
def test_auto_takes_the_blocks_where_every_matrix_is_computed_as_stored(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    matrices: Any,
    expected: str,
) -> None:
    """With AUTO_BLOCKS on (off until the defaults are measured to gain: docs/models.md), a
    file whose matrices are all in computed types loads as stored; another loads as before,
    and the log names the tensor that kept it from the blocks."""
    monkeypatch.setattr(loader, "AUTO_BLOCKS", True)
    file = write(tmp_path, matrices, Q.Q8_0)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        loaded = load_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="auto")
    if expected == "gguf":
        assert loaded.quantization == "gguf"
        assert isinstance(loaded.module.lm_head.method, BlockWeight)
    else:
        assert loaded.quantization != "gguf"
        assert "tensor 'blk.0.attn_q.weight' is Q5_0, which is not computed as stored" in (
            caplog.text
        )
    # transformers' exact arithmetic asked for: never the blocks.
    exact = load_model(file, dtype=torch.float32, device=CPU, exact=True, quantization="auto")
    assert exact.quantization != "gguf"
