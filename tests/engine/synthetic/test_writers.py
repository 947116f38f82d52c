"""The writers: an hf folder transformers loads with its own class, and GGUF files with
llama.cpp's names, keys and types (read back by gguf's reader; llama.cpp itself where its
venv is built)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from twostroke.engine.synthetic import hf as hf_module
from twostroke.engine.synthetic.gguf_file import QuantizerUnavailable, write_gguf
from twostroke.engine.synthetic.hf import write_hf
from twostroke.engine.synthetic.shapes import SMOLLM2_VOCAB_SIZE, TEST_SHAPES, shape_named
from twostroke.engine.synthetic.weights import draw, tensor_specs

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[3]
IDS = [1, 100, 2000, 30000, 49151, 7]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synthetic-hf")
    folders = {}
    for name in TEST_SHAPES:
        write_hf(TEST_SHAPES[name], root / name, dtype="float32", seed=3)
        folders[name] = root / name
    return folders


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("synthetic-gguf")
    files = {}
    for name in TEST_SHAPES:
        for kind in ("f16", "q8_0"):
            path = root / f"{name}-{kind}.gguf"
            write_gguf(TEST_SHAPES[name], path, type=kind, seed=3)  # type: ignore[arg-type]
            files[name, kind] = path
    return files


@pytest.mark.parametrize("name", list(TEST_SHAPES))
def test_transformers_loads_the_folder_with_its_own_class(
    name: str, hf_folders: dict[str, Path]
) -> None:
    shape = TEST_SHAPES[name]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_folders[name], dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == shape.config["architectures"][0]
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits
    assert logits.shape == (1, len(IDS), SMOLLM2_VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    # Scaled like an initializer: unit-scale logits, not a blow-up nor a flat line.
    assert 0.3 < float(logits.std()) < 3.0


def test_the_folder_holds_smollm2_s_tokenizer(hf_folders: dict[str, Path]) -> None:
    folder = hf_folders["test-llama"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == SMOLLM2_VOCAB_SIZE
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert config["vocab_size"] == SMOLLM2_VOCAB_SIZE


def test_shards_are_cut_at_the_limit_with_an_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_module, "MAX_SHARD_BYTES", 2**20)
    write_hf(TEST_SHAPES["test-qwen3"], tmp_path, dtype="bfloat16")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    assert set(index["weight_map"].values()) == {shard.name for shard in shards}
    specs = tensor_specs(TEST_SHAPES["test-qwen3"])
    assert set(index["weight_map"]) == {spec.name for spec in specs}
    assert index["metadata"]["total_size"] == 2 * sum(spec.numel for spec in specs)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.dtype == torch.bfloat16


def test_an_unknown_dtype_names_the_rule(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"dtype must be one of bfloat16, float16, float32; got .int8."
    ):
        write_hf(TEST_SHAPES["test-llama"], tmp_path, dtype="int8")  # type: ignore[arg-type]


ARCHITECTURES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "qwen3moe": "qwen3moe",
    "olmoe": "olmoe",
}
MIXTURES = ["test-qwen3moe", "test-olmoe"]


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("name", list(TEST_SHAPES))
def test_gguf_keys_names_and_types(
    name: str, kind: str, gguf_files: dict[tuple[str, str], Path]
) -> None:
    shape = TEST_SHAPES[name]
    reader = gguf.GGUFReader(gguf_files[name, kind])
    fields = {key: field.contents() for key, field in reader.fields.items()}
    arch = ARCHITECTURES[shape.family]
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.block_count"] == shape.num_layers
    assert fields[f"{arch}.embedding_length"] == shape.hidden_size
    assert fields[f"{arch}.feed_forward_length"] == shape.intermediate_size
    assert fields[f"{arch}.attention.head_count"] == shape.num_heads
    assert fields[f"{arch}.attention.head_count_kv"] == shape.num_kv_heads
    assert fields[f"{arch}.context_length"] == shape.config["max_position_embeddings"]
    assert fields[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(
        shape.config["rms_norm_eps"]
    )
    assert fields[f"{arch}.rope.freq_base"] == pytest.approx(shape.config["rope_theta"])
    if shape.family == "phi3":
        assert fields["phi3.rope.dimension_count"] == 48  # 0.75 of 64 per head
    elif "head_dim" in shape.config:
        assert fields[f"{arch}.attention.key_length"] == shape.head_dim
    else:  # OLMoE's config.json has none, so the converter writes none
        assert f"{arch}.attention.key_length" not in fields
    assert fields["tokenizer.ggml.pre"] == "smollm"
    assert len(fields["tokenizer.ggml.tokens"]) == SMOLLM2_VOCAB_SIZE
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    assert "token_embd.weight" in tensors
    assert "output_norm.weight" in tensors
    # Tied as the real dense models are; the mixtures' real models are not.
    assert ("output.weight" in tensors) is not shape.tied
    matrix = "F16" if kind == "f16" else "Q8_0"
    for tensor in reader.tensors:
        router = tensor.name.endswith("ffn_gate_inp.weight")  # the converter keeps it in F32
        expected = "F32" if len(tensor.shape) == 1 or router else matrix
        assert tensor.tensor_type.name == expected, tensor.name
    q = "blk.0.attn_qkv.weight" if shape.family == "phi3" else "blk.0.attn_q.weight"
    assert next(iter(tensors[q].shape)) == shape.hidden_size  # ggml order: input features first
    extra = {"llama": {"rope_freqs.weight"}, "phi3": {"rope_factors_long.weight"}}
    assert extra.get(shape.family, set()) <= set(tensors)


def test_llama_q_and_k_are_permuted_as_llama_cpp_s_converter_does(
    gguf_files: dict[tuple[str, str], Path],
) -> None:
    shape = TEST_SHAPES["test-llama"]
    reader = gguf.GGUFReader(gguf_files["test-llama", "f16"])
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    specs = {spec.name: spec for spec in tensor_specs(shape)}
    for suffix, heads in (("q", shape.num_heads), ("k", shape.num_kv_heads)):
        hf = draw(specs[f"model.layers.1.self_attn.{suffix}_proj.weight"], seed=3)
        # Each head's rows: first halves and second halves interleaved (pairs rotate).
        rows = hf.reshape(heads, 2, -1, shape.hidden_size).swapaxes(1, 2).reshape(hf.shape)
        stored = np.asarray(tensors[f"blk.1.attn_{suffix}.weight"].data, dtype=np.float32)
        np.testing.assert_allclose(stored, rows.half().float().numpy())
        assert not np.allclose(stored, hf.half().float().numpy())
    v = np.asarray(tensors["blk.1.attn_v.weight"].data, dtype=np.float32)
    expected_v = draw(specs["model.layers.1.self_attn.v_proj.weight"], seed=3)
    np.testing.assert_allclose(v, expected_v.half().float().numpy())


def test_qwen3_is_not_permuted_and_gemma_norms_are_shifted(
    gguf_files: dict[tuple[str, str], Path],
) -> None:
    qwen = {t.name: t for t in gguf.GGUFReader(gguf_files["test-qwen3", "f16"]).tensors}
    specs = {spec.name: spec for spec in tensor_specs(TEST_SHAPES["test-qwen3"])}
    expected = draw(specs["model.layers.0.self_attn.q_proj.weight"], seed=3).half().float()
    np.testing.assert_allclose(
        np.asarray(qwen["blk.0.attn_q.weight"].data, dtype=np.float32), expected.numpy()
    )
    gemma = {t.name: t for t in gguf.GGUFReader(gguf_files["test-gemma3", "f16"]).tensors}
    for name in ("blk.0.attn_norm.weight", "blk.0.attn_q_norm.weight", "output_norm.weight"):
        assert np.all(np.asarray(gemma[name].data) == 1.0), name


def test_q4_k_m_without_a_quantizer_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(QuantizerUnavailable, match="needs --llamacpp-python PY"):
        write_gguf(TEST_SHAPES["test-llama"], tmp_path / "m.gguf", type="q4_k_m")
    assert not list(tmp_path.iterdir())


def test_an_unknown_gguf_type_names_the_rule(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be one of f16, q8_0, q4_k_m; got 'q2_k'"):
        write_gguf(TEST_SHAPES["test-llama"], tmp_path / "m.gguf", type="q2_k")  # type: ignore[arg-type]


def llamacpp_python() -> Path:
    """The Python of the venv llama-cpp-python is built in, or a skip saying how to build it."""
    python = REPO / ".venv-llamacpp" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no {python}: build it with `make bench-peers` to test q4_k_m")
    found = subprocess.run(
        [str(python), "-c", "import llama_cpp"], capture_output=True, text=True, check=False
    )
    if found.returncode != 0:
        pytest.skip(f"llama_cpp is not importable by {python}: {found.stderr.strip()[-200:]}")
    return python


_RUN_IN_LLAMACPP = """
import sys, llama_cpp, numpy
model = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=32, logits_all=True, verbose=False)
model.eval([1, 100, 2000, 30000])
scores = numpy.array(model.scores[:4])
print(bool(numpy.isfinite(scores).all()), float(scores.std()))
"""


@pytest.mark.parametrize(
    "name", ["test-llama", "test-qwen3", "test-gemma3", "test-qwen3moe", "test-olmoe"]
)
def test_q4_k_m_is_llama_cpp_s_own_and_llama_cpp_runs_it(name: str, tmp_path: Path) -> None:
    python = llamacpp_python()
    path = tmp_path / "model.gguf"
    write_gguf(TEST_SHAPES[name], path, type="q4_k_m", llamacpp_python=python)
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    kinds = {tensor.tensor_type.name for tensor in reader.tensors}
    assert "Q4_K" in kinds
    assert "Q6_K" in kinds
    ran = subprocess.run(
        [str(python), "-c", _RUN_IN_LLAMACPP, str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    finite, std = ran.stdout.split()
    assert finite == "True"
    assert 0.3 < float(std) < 3.0


def test_a_failing_quantizer_is_reported_with_its_reason(tmp_path: Path) -> None:
    with pytest.raises(QuantizerUnavailable, match=r"could not quantize to q4_k_m .*llama_cpp"):
        write_gguf(
            TEST_SHAPES["test-llama"],
            tmp_path / "m.gguf",
            type="q4_k_m",
            llamacpp_python=os.environ.get("PYTHON_WITHOUT_LLAMA_CPP", "python3"),
        )
    assert not list(tmp_path.iterdir())


def test_twostroke_loads_the_llama_shape_in_both_formats(
    hf_folders: dict[str, Path], gguf_files: dict[tuple[str, str], Path]
) -> None:
    """Both formats hold the same model: twostroke's logits of each agree (the GGUF's q and
    k come back unpermuted), and transformers' of the folder too."""
    loading = pytest.importorskip("twostroke.engine.models.loading")
    cpu = torch.device("cpu")
    folder = loading.open_model(hf_folders["test-llama"], device=cpu, dtype=torch.float32)
    file = loading.open_model(
        gguf_files["test-llama", "f16"], device=cpu, dtype=torch.float32, quantization=None
    )
    (ours_hf,) = folder.module.forward_logits([IDS])
    (ours_gguf,) = file.module.forward_logits([IDS])
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        hf_folders["test-llama"], dtype=torch.float32
    )
    with torch.no_grad():
        theirs = reference(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(ours_hf.float(), theirs, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(ours_gguf.float(), theirs, atol=2e-2, rtol=1e-2)  # weights in f16


@pytest.mark.parametrize("name", MIXTURES)
def test_gguf_experts_are_stacked_under_llama_cpp_s_names_and_keys(
    name: str, gguf_files: dict[tuple[str, str], Path]
) -> None:
    """The converter's keys of a mixture, and each layer's experts one 3-D tensor per
    projection holding the folder's experts in order."""
    shape = TEST_SHAPES[name]
    arch = ARCHITECTURES[shape.family]
    reader = gguf.GGUFReader(gguf_files[name, "f16"])
    fields = {key: field.contents() for key, field in reader.fields.items()}
    assert fields[f"{arch}.expert_count"] == shape.num_experts == 8
    assert fields[f"{arch}.expert_used_count"] == shape.experts_per_token == 2
    if shape.family == "qwen3moe":
        assert fields["qwen3moe.expert_feed_forward_length"] == 256
    else:  # OlmoeModel writes none: llama.cpp's olmoe takes feed_forward_length
        assert "olmoe.expert_feed_forward_length" not in fields
        assert fields["olmoe.feed_forward_length"] == shape.expert_intermediate_size
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hidden, width, experts = shape.hidden_size, shape.expert_intermediate_size, 8
    # ggml order: input features first, the experts last.
    assert list(tensors["blk.1.ffn_gate_inp.weight"].shape) == [hidden, experts]
    assert list(tensors["blk.1.ffn_gate_exps.weight"].shape) == [hidden, width, experts]
    assert list(tensors["blk.1.ffn_up_exps.weight"].shape) == [hidden, width, experts]
    assert list(tensors["blk.1.ffn_down_exps.weight"].shape) == [width, hidden, experts]
    assert not any(".ffn_gate.weight" in key or "experts" in key for key in tensors)
    specs = {spec.name: spec for spec in tensor_specs(shape)}
    stored = np.asarray(tensors["blk.1.ffn_down_exps.weight"].data, dtype=np.float32)
    for expert in (0, 5):
        expected = draw(specs[f"model.layers.1.mlp.experts.{expert}.down_proj.weight"], seed=3)
        np.testing.assert_allclose(stored[expert], expected.half().float().numpy())
    norm_width = shape.num_heads * shape.head_dim if shape.family == "olmoe" else shape.head_dim
    assert list(tensors["blk.0.attn_q_norm.weight"].shape) == [norm_width]


@pytest.mark.parametrize("name", MIXTURES)
def test_twostroke_loads_each_mixture_in_both_formats(
    name: str, hf_folders: dict[str, Path], gguf_files: dict[tuple[str, str], Path]
) -> None:
    """twostroke reads the mixture's experts, top k and normalization from either format,
    and the formats are one model: the folder's logits are transformers' (float32, 2e-4),
    the F16 file's within 2e-2 of them (measured: 4e-3 and 3e-3 of unit-scale logits), the
    Q8_0 file's within 0.25 (measured: 0.11 and 0.07)."""
    loading = pytest.importorskip("twostroke.engine.models.loading")
    shape = TEST_SHAPES[name]
    cpu = torch.device("cpu")
    opened = {
        "hf": loading.open_model(hf_folders[name], device=cpu, dtype=torch.float32),
        "f16": loading.open_model(
            gguf_files[name, "f16"], device=cpu, dtype=torch.float32, quantization=None
        ),
        "q8_0": loading.open_model(gguf_files[name, "q8_0"], device=cpu, dtype=torch.float32),
    }
    for model in opened.values():
        config = model.module.config
        assert config.architecture == shape.config["architectures"][0]
        assert (config.num_experts, config.experts_per_token) == (8, 2)
        assert config.expert_intermediate_size == shape.expert_intermediate_size
        assert config.normalize_expert_weights is (shape.family == "qwen3moe")
        assert all(config.sparse(layer) for layer in range(shape.num_layers))
    logits = {kind: model.module.forward_logits([IDS])[0].float() for kind, model in opened.items()}
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        hf_folders[name], dtype=torch.float32
    )
    with torch.no_grad():
        theirs = reference(torch.tensor([IDS])).logits[0]
    assert 0.3 < float(theirs.std()) < 3.0
    torch.testing.assert_close(logits["hf"], theirs, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(logits["f16"], logits["hf"], atol=2e-2, rtol=1e-2)
    assert float((logits["q8_0"] - logits["hf"]).abs().max()) < 0.25


@pytest.mark.parametrize("name", ["olmoe-1b-7b", "qwen3-30b-a3b", "test-qwen3moe"])
def test_routing_is_not_degenerate(name: str) -> None:
    """The router of a unit-scale stream (the normed input it reads) spreads the tokens
    over every expert, none picked more than twice its fair share, and no pick is near
    one-hot: the top expert's probability is far from 1."""
    shape = shape_named(name).with_layers(1)
    router = next(spec for spec in tensor_specs(shape) if spec.name.endswith("mlp.gate.weight"))
    stream = torch.randn(512, shape.hidden_size, generator=torch.Generator().manual_seed(1))
    top, picked = (stream @ draw(router, seed=0).T).softmax(-1).topk(shape.experts_per_token)
    share = torch.bincount(picked.flatten(), minlength=shape.num_experts) / (
        picked.numel() / shape.num_experts
    )
    assert float(share.min()) > 0.25
    assert float(share.max()) < 2.0
    assert float(top[:, 0].mean()) < 0.5


def test_shape_named_reaches_the_tiny_shapes() -> None:
    assert shape_named("test-phi3").family == "phi3"
