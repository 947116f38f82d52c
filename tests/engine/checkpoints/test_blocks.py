"""A GGUF file's blocks computed as stored (``quantization="gguf"``): what the model holds,
what it computes, and what it refuses."""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Any, cast

import attrs
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.engine.checkpoints.test_loader import write_gguf
from tests.engine.models.test_llama import make_tiny_model, random_sequences
from twostroke.engine.artifacts.cache import MARKER, NATIVE_FOLDER
from twostroke.engine.checkpoints.source import BlockTypeUnsupported, ModelLoadError
from twostroke.engine.config import EngineConfig
from twostroke.engine.kernels.gguf_blocks import offset_magnitudes, random_blocks, rounding_bound
from twostroke.engine.models import plan as plan_module
from twostroke.engine.models.architectures import checkpoint_names
from twostroke.engine.models.forms import (
    BlockEmbedding,
    BlockWeight,
    FullPrecision,
    OneDNNWeight,
    QuantizedWeight,
)
from twostroke.engine.models.linear import Linear
from twostroke.engine.models.loading import open_model
from twostroke.engine.models.source import read_source
from twostroke.gpu.dtype import default_dtype

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


def blocks_and_reference(file: Path, asked: str = "gguf") -> tuple[Any, Any]:
    blocks = open_model(file, dtype=torch.float32, device=CPU, exact=False, quantization=asked)
    reference = open_model(file, dtype=torch.float32, device=CPU, quantization=None)
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
        pytest.param(Q.Q5_0, Q.Q8_0, False, id="q5_0-q8_0"),
        pytest.param(Q.Q5_1, Q.Q5_1, True, id="q5_1-q5_1-tied"),
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
    if embedding != Q.F16:
        assert isinstance(model._embedding, BlockEmbedding)
        assert model.embed_tokens.numel() == 0  # no float copy of the embedding
    torch.testing.assert_close(
        model._embedding(ids) if model._embedding else model.embed_tokens[ids],
        dense.embed_tokens[ids],
        rtol=1e-6,
        atol=1e-7,
    )
    assert_logits_close(model, dense)


@pytest.mark.parametrize(
    ("matrices", "embedding", "tied"),
    [
        pytest.param(Q.Q4_1, Q.Q8_0, True, id="q4_1-q8_0-tied"),
        pytest.param(Q.Q5_0, Q.Q4_0, False, id="q5_0-q4_0"),
        pytest.param(Q.Q5_1, Q.Q5_1, True, id="q5_1-q5_1-tied"),
    ],
)
def test_gguf_f32_computes_the_files_blocks_by_the_activations_themselves(
    tmp_path: Path, matrices: Any, embedding: Any, tied: bool
) -> None:
    """``quantization="gguf_f32"``: each projection is the dequantized file's projection of
    the activations themselves, to float32 rounding (the 8-bit rounding of ``"gguf"`` would
    be 1e3 times the tolerance); so the logits are the dequantized model's to 1e-4."""
    file = write(tmp_path, matrices, embedding, tie_word_embeddings=tied)
    blocks, reference = blocks_and_reference(file, "gguf_f32")
    assert blocks.quantization == "gguf_f32"
    model, dense = blocks.module, reference.module
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for mine, theirs in zip(model.modules(), dense.modules(), strict=True):
        if not isinstance(mine, Linear):
            continue
        assert isinstance(mine.method, BlockWeight)
        assert mine.method.kernel.activations == "float32"
        weight = cast(FullPrecision, theirs.method).weight.double()
        x = torch.randn(5, mine.in_features, generator=generator)
        expected = F_linear(x.double(), weight)
        scale = float((x.double().abs() @ weight.abs().T).max())
        assert float((mine(x).double() - expected).abs().max()) <= 1e-6 * scale
        checked += 1
    assert checked
    ids = random_sequences([9, 4], seed=2)
    for mine, theirs in zip(model.forward_logits(ids), dense.forward_logits(ids), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def sixteen_bits(kind: Any) -> Any:
    """q/k/v and down in ``kind`` (16 bits), o and gate/up in Q4_1 blocks."""

    def chosen(hf_name: str) -> Any:
        return (
            kind
            if hf_name.endswith(
                ("q_proj.weight", "k_proj.weight", "v_proj.weight", "down_proj.weight")
            )
            else Q.Q4_1
        )

    return chosen


@pytest.mark.parametrize("kind", [Q.F16, Q.BF16])
def test_a_sixteen_bit_matrix_beside_the_blocks_computes_from_its_exact_float16_values(
    tmp_path: Path, kind: Any
) -> None:
    """F16 and BF16 projections load (BF16 is no longer refused), q/k with their rotary
    rows permuted back, and compute in the chosen 16-bit form where every value is a float16
    (fbgemm's fp16 where it runs: TWOSTROKE_CPU_ISA=portable keeps them dense; with
    deterministic=True where fbgemm's kernels are AVX2's, their values in float32 packed for
    oneDNN), from the unquantized activations: each equals the dequantized file's projection
    to float32 rounding; the blocks beside them as before."""
    file = write(tmp_path, sixteen_bits(kind), Q.Q8_0)
    blocks, reference = blocks_and_reference(file)
    assert blocks.quantization == "gguf"
    sixteen = blocks.module.kernels.projection.sixteen
    model, dense = blocks.module, reference.module
    generator = torch.Generator().manual_seed(0)
    held = 0
    for name, mine in model.named_modules():
        if not isinstance(mine, Linear) or mine is model.lm_head:
            continue
        theirs = cast(FullPrecision, cast(Linear, dense.get_submodule(name)).method)
        x = torch.randn(5, mine.in_features, generator=generator)
        if name.endswith(("o_proj", "gate_up_proj")):
            assert isinstance(mine.method, BlockWeight)
            continue
        exact = bool(torch.equal(theirs.weight.half().float(), theirs.weight))
        if sixteen == "dense" or not exact:
            assert isinstance(mine.method, FullPrecision)
        else:
            form = QuantizedWeight if sixteen == "fp16" else OneDNNWeight
            assert isinstance(mine.method, form)
            held += 1
        expected = F_linear(x.double(), theirs.weight.double())
        scale = float((x.double().abs() @ theirs.weight.double().abs().T).max())
        assert float((mine(x).double() - expected).abs().max()) <= 1e-5 * scale
    if sixteen != "dense" and kind == Q.F16:
        assert held == 2 * model.config.num_layers  # the fused q/k/v and down, each layer
    assert_logits_close(model, dense)


@pytest.mark.parametrize("asked", ["q8_0", "q4_0"])
def test_q8_0_and_q4_0_quantize_a_checkpoints_projections_into_blocks_at_load(
    tmp_path: Path, asked: str
) -> None:
    """A safetensors checkpoint's decoder projections become the blocks llama.cpp's
    quantizer writes (the gguf package's), computed as a GGUF file's are: each equals the
    product of the quantized activations by those blocks dequantized, and the logits stay
    close to those of the model with those weights; the embedding and the output projection
    stay float32; a GGUF file loads the same way (its dequantized weights
    quantized again); another dtype or a width that is not whole blocks is refused."""
    from gguf.quants import dequantize, quantize

    kind = Q.Q8_0 if asked == "q8_0" else Q.Q4_0
    directory = tmp_path / "hf"
    make_tiny_model("llama", directory)
    loaded = open_model(directory, dtype=torch.float32, device=CPU, exact=False, quantization=asked)
    reference = open_model(directory, dtype=torch.float32, device=CPU, quantization=None)
    assert loaded.quantization == asked
    model, dense = loaded.module, reference.module
    assert isinstance(model.lm_head.method, FullPrecision)
    assert model._embedding is None
    generator = torch.Generator().manual_seed(0)
    for name, mine in model.named_modules():
        if not isinstance(mine, Linear) or mine is model.lm_head:
            continue
        assert isinstance(mine.method, BlockWeight)
        theirs = cast(FullPrecision, cast(Linear, dense.get_submodule(name)).method).weight
        weight = torch.from_numpy(dequantize(quantize(theirs.numpy(), kind), kind)).double()
        x = torch.randn(5, mine.in_features, generator=generator)
        expected = F_linear(quantized(x).double(), weight)
        scale = float((quantized(x).double().abs() @ weight.abs().T).max())
        assert float((mine(x).double() - expected).abs().max()) <= 1e-5 * scale
        with torch.no_grad():
            theirs.copy_(weight.float())  # the reference: the blocks' own weights
    assert_logits_close(model, dense)
    file = write(tmp_path, Q.Q4_1, Q.Q8_0)
    again = open_model(file, dtype=torch.float32, device=CPU, exact=False, quantization=asked)
    assert again.quantization == asked
    assert isinstance(again.module.layers[0].mlp.down_proj.method, BlockWeight)
    with pytest.raises(ValueError, match=f"quantization='{asked}' computes on the CPU"):
        open_model(directory, dtype=torch.bfloat16, device=CPU, quantization=asked)
    narrow = tmp_path / "narrow"
    make_tiny_model("llama", narrow, hidden_size=48, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ModelLoadError, match=r"quantizes projections in blocks of 32 weights: "):
        open_model(narrow, dtype=torch.float32, device=CPU, quantization=asked)


def assert_logits_close(model: Any, dense: Any) -> None:
    """Two sequences' logits through both models, chunked: with 8-bit activations the tiny
    random model's logits move by a few percent of the largest."""
    sequences = random_sequences([3, 20])
    for got, want in zip(
        model.forward_logits(sequences, chunk_size=6),
        dense.forward_logits(sequences, chunk_size=6),
        strict=True,
    ):
        assert float((got - want).abs().max()) <= 0.08 * float(want.abs().max())


def F_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_loading_leaves_the_calling_thread_without_an_openmp_team(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block products' check (run the first time a process loads blocks) multiplies on
    the loading thread; a team of two there would outlive the load, and with the engine's
    forward thread's team beside it GNU OpenMP stops spinning at barriers (one stream's
    decode took 17-35 ms a token against 9-14). A fresh thread with two torch threads loads
    a file's blocks, the check made to run again: the process has no more threads after."""
    import os
    import threading

    from twostroke.engine.kernels import gguf_blocks
    from twostroke.gpu.threads import torch_threads

    file = write(tmp_path, Q.Q4_1, Q.Q8_0)
    monkeypatch.setattr(gguf_blocks, "_kernel", functools.cache(gguf_blocks._kernel.__wrapped__))
    # The threads by id: other tests' threads may end meanwhile, so a count could fall while a
    # team was left behind (a fresh-clone run counted 20 threads before and 17 after).
    tasks: list[set[str]] = []
    failures: list[BaseException] = []

    def load() -> None:
        try:
            with torch_threads(2):
                tasks.append(set(os.listdir("/proc/self/task")))
                open_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="gguf")
                tasks.append(set(os.listdir("/proc/self/task")))
        except BaseException as error:  # (raised again on the test's thread)
            failures.append(error)

    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]
    before, after = tasks
    assert after <= before, f"threads left by the load: {sorted(after - before)}"


def test_the_blocks_are_the_files_memory_and_nothing_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TWOSTROKE_CACHE_DIR", str(cache))
    file = write(tmp_path, Q.Q4_1, Q.Q8_0, tie_word_embeddings=True)
    loaded = open_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="gguf")
    method = loaded.module.layers[0].mlp.down_proj.method
    assert isinstance(method, BlockWeight)
    [part] = method.parts
    assert isinstance(part.data, np.memmap)
    assert Path(part.data.filename) == file.resolve()
    assert not weight_entries(cache)
    open_model(file, dtype=torch.float32, device=CPU, quantization=None)
    assert weight_entries(cache)  # where the dequantized weights are cached


def weight_entries(cache: Path) -> list[Path]:
    """The cache's entries of weights: not its compiled kernels (built into it when this test
    runs first in its process) nor its tag."""
    if not cache.exists():
        return []
    return [path for path in cache.iterdir() if path.name not in (NATIVE_FOLDER, MARKER)]


def test_a_type_not_computed_as_stored_is_an_error_naming_the_tensor(tmp_path: Path) -> None:
    file = write(tmp_path, Q.MXFP4, Q.Q8_0)
    with pytest.raises(BlockTypeUnsupported) as caught:
        open_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="gguf")
    assert caught.value.block_type == "MXFP4"
    assert caught.value.tensor.startswith("blk.0.")
    assert "is MXFP4, which quantization='gguf' does not compute as stored" in str(caught.value)
    with pytest.raises(BlockTypeUnsupported, match="which quantization='gguf_f32' does not"):
        open_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="gguf_f32")
    # Without quantization='gguf' the file loads dequantized, as before.
    open_model(file, dtype=torch.float32, device=CPU, quantization=None)


def test_gguf_quantization_needs_a_gguf_file_and_float32_on_the_cpu(tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    make_tiny_model("llama", directory)
    for asked in ("gguf", "gguf_f32"):
        with pytest.raises(ModelLoadError, match=rf"quantization='{asked}' .*: not a GGUF file"):
            open_model(directory, dtype=torch.float32, device=CPU, quantization=asked)
    file = write(tmp_path, Q.Q4_1, Q.Q8_0)
    with pytest.raises(ValueError, match="float32 activations; got dtype bfloat16 on cpu"):
        open_model(file, dtype=torch.bfloat16, device=CPU, quantization="gguf")


@pytest.mark.parametrize(("matrices", "expected"), [(Q.Q4_1, "gguf"), (Q.MXFP4, "fp16")])
def test_auto_takes_the_blocks_where_every_matrix_is_computed_as_stored(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    matrices: Any,
    expected: str,
) -> None:
    """Where the blocks win (here: the dequantized copy would not fit the memory, made one
    byte small), a file whose matrices are all in computed types loads as stored, by 8-bit
    activations (``"gguf"``); another loads as before, and the log names the tensor that
    kept it from the blocks."""
    monkeypatch.setattr(plan_module, "available_memory", lambda: 1)
    file = write(tmp_path, matrices, Q.Q8_0)
    with caplog.at_level(logging.INFO, logger=plan_module.__name__):
        loaded = open_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="auto")
    if expected == "gguf":
        assert loaded.quantization == "gguf"
        head = loaded.module.lm_head.method
        assert isinstance(head, BlockWeight)
        assert head.kernel.activations == "int8"
    else:
        assert loaded.quantization not in ("gguf", "gguf_f32")
        assert "tensor 'blk.0.attn_q.weight' is MXFP4, which is not computed as stored" in (
            caplog.text
        )
    # transformers' exact arithmetic asked for: never the blocks.
    exact = open_model(file, dtype=torch.float32, device=CPU, exact=True, quantization="auto")
    assert exact.quantization not in ("gguf", "gguf_f32")


def test_auto_takes_the_blocks_for_few_sequences_or_a_file_too_large_to_dequantize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's defaults compute a GGUF file's blocks where they win: at most
    AUTO_BLOCKS_MAX_SEQS sequences on a model of at least AUTO_BLOCKS_MIN_WEIGHTS projection
    weights (lowered here to this tiny file's), or a dequantized copy larger than
    AUTO_BLOCKS_MEMORY_SHARE of the memory available. Then ``dtype="auto"`` is float32 (the
    blocks' activations) whatever the CPU's default; else the file is dequantized."""
    file = write(tmp_path, Q.Q4_1, Q.Q8_0)
    source = read_source(file)
    config = source.config
    # The tiny model's decoder projections, counted from its configuration.
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = (q_width + 2 * kv_width) * config.hidden_size + config.hidden_size * q_width
    per_layer += 3 * config.intermediate_size * config.hidden_size
    weights = config.num_layers * per_layer
    assert plan_module.projection_weights(source, checkpoint_names(config)) == weights
    dense = sum(math.prod(t.shape) for t in source.tensors.values())
    dense *= default_dtype(CPU).itemsize
    roomy = math.ceil(dense / plan_module.AUTO_BLOCKS_MEMORY_SHARE)
    monkeypatch.setattr(plan_module, "available_memory", lambda: roomy)
    few = plan_module.AUTO_BLOCKS_MAX_SEQS

    def plan(max_num_seqs: int) -> tuple[str | None, torch.dtype]:
        run = plan_module.resolve_run(EngineConfig(max_num_seqs=max_num_seqs), source, CPU)
        return run.weights, run.dtype

    monkeypatch.setattr(plan_module, "AUTO_BLOCKS_MIN_WEIGHTS", weights)
    assert plan(few) == ("gguf", torch.float32)
    assert plan(1) == ("gguf", torch.float32)
    many = plan(few + 1)
    assert many[0] not in ("gguf", "gguf_f32")
    assert many[1] == default_dtype(CPU)
    # One weight short of the size: few sequences keep the file dequantized too.
    monkeypatch.setattr(plan_module, "AUTO_BLOCKS_MIN_WEIGHTS", weights + 1)
    assert plan(1)[0] not in ("gguf", "gguf_f32")
    # Memory one byte short of the share: the blocks, for any number of sequences.
    monkeypatch.setattr(plan_module, "available_memory", lambda: roomy - 1)
    assert plan(few + 1) == ("gguf", torch.float32)


def test_the_memory_the_blocks_weigh_is_read_once_a_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dtype and the weights are decided on one reading of the memory available: a
    second reading that crossed the bar would give float32 activations to a dequantized
    copy (twice bfloat16's bytes), or the blocks to bfloat16 activations."""
    file = write(tmp_path, Q.Q4_1, Q.Q8_0)
    source = read_source(file)
    readings = iter([10**15, 1])  # roomy, then one byte: the dense copy would not fit
    read: list[int] = []

    def available() -> int:
        read.append(next(readings))
        return read[-1]

    monkeypatch.setattr(plan_module, "available_memory", available)
    run = plan_module.resolve_run(EngineConfig(), source, CPU)
    assert read == [10**15]
    assert run.weights not in ("gguf", "gguf_f32")
    assert run.dtype == default_dtype(CPU)


def k_type(gguf_tensor: str, *, embedding: Any) -> Any:
    """A Q4_K_M-like mix, as llama.cpp's quantizer chooses: Q4_K matrices, Q6_K for the
    value and down projections of every other layer (its "more bits" layers) and the
    output projection; here Q5_K for the other layers' down projection, so that one file
    holds every K type (Q4_K and Q6_K side by side in each fused q/k/v)."""
    if gguf_tensor == "token_embd.weight":
        return embedding
    if gguf_tensor == "output.weight":
        return Q.Q6_K
    layer = int(gguf_tensor.split(".")[1])
    if ".attn_v." in gguf_tensor and layer % 2 == 0:
        return Q.Q6_K
    if ".ffn_down." in gguf_tensor:
        return Q.Q6_K if layer % 2 == 0 else Q.Q5_K
    return Q.Q4_K


def write_k_file(tmp_path: Path, *, embedding: Any, tied: bool) -> Path:
    """A tiny llama GGUF (widths multiples of 256, as K blocks need) whose matrices are
    random, valid K blocks (the gguf package dequantizes K types but does not quantize to
    them), its norms the model's own."""
    from tests.engine.checkpoints.test_loader import gguf_name

    reference = make_tiny_model(
        "llama",
        tmp_path / "hf",
        hidden_size=256,
        intermediate_size=512,
        tie_word_embeddings=tied,
    )
    config = reference.config
    file = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(file, "llama")
    writer.add_name("tiny-k")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(7)
    generator = np.random.default_rng(0)
    for hf_name, parameter in reference.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        target = gguf_name(hf_name)
        if parameter.dim() == 2:
            kind = k_type(target, embedding=embedding)
            out_features, in_features = parameter.shape
            stored = random_blocks(generator, int(kind), out_features, in_features)
            writer.add_tensor(target, shrunk(stored, kind, 0.25), raw_dtype=kind)
        else:
            writer.add_tensor(target, parameter.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


def shrunk(data: np.ndarray[Any, Any], kind: Any, factor: float) -> np.ndarray[Any, Any]:
    """K blocks whose weights are ``factor`` times ``data``'s (d and dmin scaled): random
    blocks' weights are about 0.2, a random network of them at width 256 amplifies each
    layer's differences, and a trained model's are nearer 1 / sqrt(width)."""
    size = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}[kind]
    blocks = data.reshape(-1, size).copy()
    at = slice(size - 2, size) if kind == Q.Q6_K else slice(0, 4)
    halves = np.ascontiguousarray(blocks[:, at]).view(np.float16)
    blocks[:, at] = (halves * np.float16(factor)).view(np.uint8)
    return blocks.reshape(data.shape)


@attrs.frozen
class QuantizedInput:
    """The dequantized weight's product of the activations the block products multiply by
    (rounded to 8 bits per block of 32), in float32: the blocks' arithmetic but for
    rounding."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(quantized(x), self.weight, self.bias)


@pytest.mark.parametrize(
    ("embedding", "tied"),
    [pytest.param(Q.Q6_K, True, id="q6_k-tied"), pytest.param(Q.Q4_K, False, id="q4_k")],
)
def test_a_q4_k_m_like_file_loads_as_stored_and_computes_its_dequantized_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embedding: Any, tied: bool
) -> None:
    """Every matrix of a file that mixes Q4_K, Q5_K and Q6_K is computed from its blocks;
    each projection equals the file's dequantized float32 weights' product of the same
    8-bit activations within the rounding bound (gguf_blocks.rounding_bound); the logits
    equal those of the dequantized model whose projections take the same 8-bit activations
    to float32 rounding (a rounding step an activation may take differently), and stay
    within the 8-bit activations' effect of the dequantized model's own (8 % here)."""
    # The block products alone compiled: the glue and attention for a new width would
    # compile for seconds, and the comparison is of the projections.
    monkeypatch.setenv("TWOSTROKE_NATIVE", "0")
    file = write_k_file(tmp_path, embedding=embedding, tied=tied)
    blocks, reference = blocks_and_reference(file)
    model, dense = blocks.module, reference.module
    types = set()
    generator = torch.Generator().manual_seed(0)
    for mine, theirs in zip(model.modules(), dense.modules(), strict=True):
        if not isinstance(mine, Linear):
            continue
        assert isinstance(theirs, Linear)
        method = mine.method
        assert isinstance(method, BlockWeight)
        weight = cast(FullPrecision, theirs.method).weight.double()
        offsets = []
        for part in method.parts:
            types.add(part.type_name)
            offset = torch.from_numpy(offset_magnitudes(part.data, part.block_type))
            if part.columns is not None:  # stored row o is output column columns[o]
                offset = offset[torch.argsort(part.columns.long())]
            offsets.append(offset)
        x = quantized(torch.randn(5, mine.in_features, generator=generator)).double()
        expected = x @ weight.T
        allowed = rounding_bound(method.parts[0].block_type, mine.in_features) * (
            x.abs() @ (weight.abs() + 2 * torch.cat(offsets)).T
        )
        assert bool(((mine(x.float()).double() - expected).abs() <= allowed).all())
    assert types == {"Q4_K", "Q5_K", "Q6_K"}
    assert isinstance(model._embedding, BlockEmbedding)
    ids = torch.tensor([[0, 255, 3]])
    torch.testing.assert_close(model._embedding(ids), dense.embed_tokens[ids], rtol=0, atol=0)
    sequences = random_sequences([3, 20])
    got = model.forward_logits(sequences, chunk_size=6)
    plain = dense.forward_logits(sequences, chunk_size=6)
    for linear in dense.modules():
        if isinstance(linear, Linear):
            full = cast(FullPrecision, linear.method)
            linear.use(QuantizedInput(full.weight, full.bias))
    same_activations = dense.forward_logits(sequences, chunk_size=6)
    closes = []
    for mine, theirs, exact in zip(got, plain, same_activations, strict=True):
        scale = float(theirs.abs().max())
        # float32 rounding through three layers (under 1e-6 of the largest logit), but for
        # the positions after an activation fell on the other side of a rounding step than
        # the reference's (the two sum a product in other orders, and which activation
        # lands within an ulp of a step depends on the machine's float32 kernels: portable
        # C on an AVX2 EPYC, 3 of 20 positions by 0.25 %; every rung on an AVX-512 Xeon,
        # the 3-token sequence's 3 by 1.75 %). A flipped step moves a logit by far less
        # than a wrong weight or row order would.
        closes.append(((mine - exact).abs() <= 1e-5 * scale).all(-1))
        assert float((mine - exact).abs().max()) <= 3e-2 * scale
        # 8-bit activations: the tiny random model's logits move by a few percent.
        assert float((mine - theirs).abs().max()) <= 0.1 * scale
    assert float(torch.cat(closes).float().mean()) >= 0.5


def test_mmap_false_computes_the_same_logits_and_survives_the_file_truncated(
    tmp_path: Path,
) -> None:
    """A served GGUF file truncated in place killed the process (SIGBUS: its blocks are
    read from the map as they are used); ``mmap=False`` reads them into memory at load, and
    the model computes the mapped model's logits bit for bit after the file is emptied."""
    file = write(tmp_path, Q.Q4_0, Q.Q8_0)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(file.read_bytes())
    options: dict[str, Any] = {"dtype": torch.float32, "device": CPU, "quantization": "gguf"}
    mapped = open_model(file, **options)
    read = open_model(copy, **options, mmap=False)
    assert read.quantization == "gguf"
    sequences = random_sequences([3, 20])
    expected = mapped.module.forward_logits(sequences, chunk_size=6)
    with copy.open("r+b") as handle:
        handle.truncate(0)  # in place: a mapped model would die reading its next block
    for logits, theirs in zip(
        read.module.forward_logits(sequences, chunk_size=6), expected, strict=True
    ):
        assert torch.equal(logits, theirs)
