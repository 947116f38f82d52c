"""The llama.cpp peer: the GGUF's weight format, and the real child script over a fake
``llama_cpp`` (the suite never builds llama.cpp)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from twostroke.engine.bench.llamacpp_peer import (
    BATCHED_PROTOCOL,
    PROTOCOL,
    GGUFWeights,
    LlamaCppDriver,
    PromptLookup,
    batched_job_document,
    gguf_weights,
    job_document,
)
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import BenchRequest, Workload

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0

# A stand-in for llama-cpp-python: `generate` yields token 7 forever (as the real one does
# until its caller stops), and the fake logs what it was asked to $FAKE_LLAMA_LOG on close
# (a draft model as its class name and attributes).
FAKE_LLAMA_CPP = """
import json, os, time

__version__ = "0.0-fake"


def llama_print_system_info():
    return b"CPU : AVX2 = 1 | OPENMP = 1 | "


class Llama:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_LLAMA_FAIL"):
            raise ValueError("Failed to load model from file")
        draft = kwargs.pop("draft_model", None)
        self.log = {"kwargs": kwargs, "generate": [], "resets": 0}
        if draft is not None:
            self.log["draft_model"] = [type(draft).__name__, vars(draft)]

    def reset(self):
        self.log["resets"] += 1

    def generate(self, tokens, **kwargs):
        self.log["generate"].append({"tokens": tokens, "at": time.perf_counter(), **kwargs})
        while True:
            yield 7

    def close(self):
        with open(os.environ["FAKE_LLAMA_LOG"], "w") as file:
            json.dump(self.log, file)
"""


# The binding's prompt lookup decoding, as far as the child uses it: its constructor.
FAKE_LLAMA_SPECULATIVE = """
class LlamaPromptLookupDecoding:
    def __init__(self, max_ngram_size=2, num_pred_tokens=10):
        self.max_ngram_size = max_ngram_size
        self.num_pred_tokens = num_pred_tokens
"""


def write_gguf(path: Path, *, file_type: int | None) -> None:
    """A file of 2 x 64 Q4_1 weights, 64 Q8_0 and 5 F32, like a quantized model's mix."""
    writer = gguf.GGUFWriter(path, "llama")
    if file_type is not None:
        writer.add_file_type(file_type)
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((2, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_up.weight", quantize(matrix, Q4_1), raw_dtype=Q4_1)
    writer.add_tensor("token_embd.weight", quantize(matrix[:1], Q8_0), raw_dtype=Q8_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(5).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def model(tmp_path: Path) -> ModelSpec:
    path = tmp_path / "tiny.Q4_1.gguf"
    write_gguf(path, file_type=gguf.LlamaFileType.MOSTLY_Q4_1)
    return ModelSpec(
        name="tiny", source=path, dtype="float32", threads=2, work_dir=tmp_path / "run", seed=3
    )


@pytest.fixture
def fake_llama_cpp(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "fake" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_LLAMA_CPP))
    (package / "llama_speculative.py").write_text(textwrap.dedent(FAKE_LLAMA_SPECULATIVE))
    return {"PYTHONPATH": str(tmp_path / "fake"), "FAKE_LLAMA_LOG": str(tmp_path / "fake.json")}


WORKLOAD = Workload(
    requests=(BenchRequest((1, 2, 3), 5), BenchRequest((4, 5), 1), BenchRequest((6,), 4)),
    arrival_times=None,
    seed=0,
    description="three",
)


def test_the_batched_peers_job_document(model: ModelSpec) -> None:
    """The job OpenVINO GenAI's and mistral.rs's children take (BatchedGGUFPeer)."""
    serving = Workload(WORKLOAD.requests, (0.0, 0.5, 1.0), 0, "s")
    document = batched_job_document(serving, model=model, max_num_seqs=8)
    assert document == {
        "protocol": BATCHED_PROTOCOL,
        "model_path": str(model.source),
        "threads": 2,
        "max_num_seqs": 8,
        "requests": [
            {"prompt_token_ids": [1, 2, 3], "max_tokens": 5},
            {"prompt_token_ids": [4, 5], "max_tokens": 1},
            {"prompt_token_ids": [6], "max_tokens": 4},
        ],
        "arrival_times": [0.0, 0.5, 1.0],
    }
    json.dumps(document)
    assert batched_job_document(WORKLOAD, model=model, max_num_seqs=1)["arrival_times"] is None


def test_the_weight_format_is_read_from_the_file(model: ModelSpec, tmp_path: Path) -> None:
    weights = gguf_weights(model.source)
    assert weights == GGUFWeights(
        file_type="Q4_1", weights=(("Q4_1", 128), ("Q8_0", 64), ("F32", 5))
    )
    assert weights.describe() == "GGUF Q4_1: Q4_1 65 %, Q8_0 32 %, F32 3 % of 197 weights"
    # Without general.file_type, the type holding the most weights names the file.
    bare = tmp_path / "bare.gguf"
    write_gguf(bare, file_type=None)
    assert gguf_weights(bare).file_type == "Q4_1"
    # A file type this gguf package does not know: the same.
    unknown = tmp_path / "unknown.gguf"
    write_gguf(unknown, file_type=9999)
    assert gguf_weights(unknown).file_type == "Q4_1"


def test_shares_under_one_percent_and_whole_files() -> None:
    weights = GGUFWeights(file_type="F16", weights=(("F16", 134_480_000), ("F32", 35_136)))
    assert weights.total == 134_515_136
    assert weights.describe() == "GGUF F16: F16 100 %, F32 <1 % of 134.5 M weights"


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all, but long enough")
    with pytest.raises(ValueError, match="the file does not start with the GGUF magic"):
        gguf_weights(path)


def test_job_document(model: ModelSpec) -> None:
    serving = Workload(WORKLOAD.requests, (0.0, 0.5, 1.0), 0, "s")
    document = job_document(serving, model=model, batch=4)
    assert document == {
        "protocol": PROTOCOL,
        "model_path": str(model.source),
        "threads": 2,
        "seed": 3,
        "n_ctx": 8,  # the longest request: 3 prompt + 5 output tokens
        "n_batch": 4,
        "requests": [
            {"prompt_token_ids": [1, 2, 3], "max_tokens": 5},
            {"prompt_token_ids": [4, 5], "max_tokens": 1},
            {"prompt_token_ids": [6], "max_tokens": 4},
        ],
        "arrival_times": [0.0, 0.5, 1.0],
    }
    # A batch no longer than the context.
    assert job_document(WORKLOAD, model=model, batch=512)["n_batch"] == 8
    json.dumps(document)


def test_offline_run_through_the_real_child(
    fake_llama_cpp: dict[str, str], model: ModelSpec, tmp_path: Path
) -> None:
    driver = LlamaCppDriver(sys.executable, env=fake_llama_cpp)
    assert driver.check() is None
    result = driver.run(WORKLOAD, model=model)
    assert result.available, result.reason
    assert [t.output_tokens for t in result.timings] == [5, 1, 4]
    assert [len(t.chunk_times) for t in result.timings] == [5, 1, 4]
    assert [t.prompt_tokens for t in result.timings] == [3, 2, 1]
    assert all(t.start == 0.0 for t in result.timings)
    # One request after another: each starts after the one before ended.
    assert result.timings[1].first_token >= result.timings[0].end
    assert result.wall_seconds >= max(t.end for t in result.timings)
    assert result.startup_seconds > 0
    assert result.extra["llama-cpp-python"] == "0.0-fake"
    assert result.extra["system_info"] == "CPU : AVX2 = 1 | OPENMP = 1 |"
    assert result.extra["weight_format"] == "Q4_1"
    assert result.extra["weights"] == (
        "GGUF Q4_1: Q4_1 65 %, Q8_0 32 %, F32 3 % of 197 weights, computed as stored"
    )
    assert result.extra["batching"] == "none: one request at a time"
    assert result.extra["threads"] == 2

    log = json.loads((tmp_path / "fake.json").read_text())
    assert log["kwargs"] == {
        "model_path": str(model.source),
        "n_ctx": 8,
        "n_batch": 8,
        "n_threads": 2,
        "n_threads_batch": 2,
        "seed": 3,
        "verbose": False,
    }
    # The warm-up (the first prompt's first 8 tokens), then each request, state reset each time.
    assert [g["tokens"] for g in log["generate"]] == [[1, 2, 3], [1, 2, 3], [4, 5], [6]]
    assert log["resets"] == 4
    assert all(
        (g["temp"], g["repeat_penalty"], g["reset"]) == (0.0, 1.0, True) for g in log["generate"]
    )


def test_prompt_lookup_runs_through_the_real_child(
    fake_llama_cpp: dict[str, str], model: ModelSpec, tmp_path: Path
) -> None:
    lookup = PromptLookup(num_pred_tokens=4, max_ngram_size=3)
    assert job_document(WORKLOAD, model=model, batch=4, prompt_lookup=lookup)["prompt_lookup"] == {
        "num_pred_tokens": 4,
        "max_ngram_size": 3,
    }
    assert "prompt_lookup" not in job_document(WORKLOAD, model=model, batch=4)
    driver = LlamaCppDriver(sys.executable, prompt_lookup=lookup, env=fake_llama_cpp)
    assert driver.name == "llama.cpp-prompt-lookup"
    result = driver.run(WORKLOAD, model=model)
    assert result.available, result.reason
    assert [t.output_tokens for t in result.timings] == [5, 1, 4]
    # The tokens each request generated, for the greedy check against plain llama.cpp.
    assert result.output_token_ids == ((7,) * 5, (7,), (7,) * 4)
    assert result.extra["speculation_off"] == "llama.cpp"
    assert result.extra["prompt_lookup"] == (
        "LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=4)"
    )
    log = json.loads((tmp_path / "fake.json").read_text())
    assert log["draft_model"] == [
        "LlamaPromptLookupDecoding",
        {"max_ngram_size": 3, "num_pred_tokens": 4},
    ]
    assert (model.work_dir / "llamacpp-prompt-lookup" / "child.log").exists()
    # Plain decoding has no draft model, and its outputs are reported as well.
    plain = LlamaCppDriver(sys.executable, env=fake_llama_cpp).run(WORKLOAD, model=model)
    assert "draft_model" not in json.loads((tmp_path / "fake.json").read_text())
    assert plain.output_token_ids == result.output_token_ids
    assert "speculation_off" not in plain.extra
    with pytest.raises(ValueError, match=r"^num_pred_tokens must be >= 1, got 0$"):
        PromptLookup(num_pred_tokens=0)


def test_serving_requests_start_at_their_arrival_times(
    fake_llama_cpp: dict[str, str], model: ModelSpec, tmp_path: Path
) -> None:
    workload = Workload(WORKLOAD.requests, (0.0, 0.0, 0.05), seed=0, description="s")
    result = LlamaCppDriver(sys.executable, env=fake_llama_cpp).run(workload, model=model)
    assert result.available, result.reason
    assert [t.start for t in result.timings] == [0.0, 0.0, 0.05]
    assert result.timings[2].first_token >= 0.05
    generated = json.loads((tmp_path / "fake.json").read_text())["generate"]
    assert generated[3]["at"] - generated[1]["at"] >= 0.05


def test_a_llamacpp_failure_is_reported_with_its_message(
    fake_llama_cpp: dict[str, str], model: ModelSpec
) -> None:
    driver = LlamaCppDriver(sys.executable, env=fake_llama_cpp | {"FAKE_LLAMA_FAIL": "1"})
    result = driver.run(WORKLOAD, model=model)
    assert not result.available
    assert result.reason == (
        "llama.cpp failed: ValueError: Failed to load model from file; see "
        f"{model.work_dir / 'llamacpp' / 'child.log'}"
    )


def test_unavailable_without_llama_cpp(
    model: ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hint = (
        "build it with `make bench-peers` (.venv-llamacpp), then pass "
        "--llamacpp-python .venv-llamacpp/bin/python"
    )
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llama_cpp" else real(name, *a),
    )
    assert LlamaCppDriver().check() == (
        f"llama-cpp-python is not installed here and no --llamacpp-python given; {hint}"
    )
    assert LlamaCppDriver().run(WORKLOAD, model=model).reason == (
        f"no --llamacpp-python given; {hint}"
    )
    missing = tmp_path / "nowhere" / "python"
    assert LlamaCppDriver(missing).check() == f"--llamacpp-python {missing} does not exist; {hint}"
    # Stand-ins for a Python: one whose probe does not find llama_cpp (its status 3), one
    # that fails.
    without = tmp_path / "without-llama-cpp"
    without.write_text("#!/bin/sh\nexit 3\n")
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'libstdc++.so.6: version not found' >&2\nexit 1\n")
    for script in (without, broken):
        script.chmod(0o755)
    assert LlamaCppDriver(without).check() == f"{without} cannot import llama_cpp; {hint}"
    assert LlamaCppDriver(broken).check() == (
        f"{broken} failed (1): libstdc++.so.6: version not found"
    )
