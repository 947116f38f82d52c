"""The mistral.rs peer: the real child script over a fake ``mistralrs`` (the suite never
installs mistral.rs), its admission of requests, its refusals and its set-up script; and the
real peer on SmolLM2's GGUF where ``.venv-mistralrs`` is set up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest

from tests.engine.bench.test_llamacpp_peer import write_gguf
from twostroke.engine.bench.mistralrs_peer import MistralRsDriver
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import BenchRequest, Workload

REPO = Path(__file__).resolve().parents[3]
MISTRALRS_PYTHON_ENV = "TWOSTROKE_MISTRALRS_PYTHON"
SETUP_HINT = (
    "install it with `make bench-peers` (.venv-mistralrs), then pass "
    "--mistralrs-python .venv-mistralrs/bin/python"
)

# A stand-in for mistralrs, as far as the child uses it. Its tokenizer writes token i as
# "<i>" (tokens above 99 as the two tokens of their halves' text, so their text tokenizes to
# other ids); a stream yields one chunk of token 7 a token, and a last chunk ending it. As the
# real Runner, it refuses a request sent before the one sent last has its first token (its
# prompt takes 20 ms, a window a child that does not wait would send into). With
# $FAKE_MRS_GATHER (the workload's requests), a request past the first (the warm-up) waits,
# after its first token, for as many streams to run as the child may run at once, so that how
# many ran together does not hang on the machine's timing, then 20 ms more, a window a child
# that sends more than that would send into. It logs to $FAKE_MRS_LOG.
FAKE_MISTRALRS = """
import json, os, re, threading, time
from types import SimpleNamespace as _Object

_LOCK = threading.Condition()


class Which:
    @staticmethod
    def GGUF(quantized_model_id, quantized_filename):
        return ("gguf", quantized_model_id, quantized_filename)


class ChatCompletionRequest:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class Runner:
    def __init__(self, which, max_seqs, prefix_cache_n, jinja_explicit):
        if os.environ.get("FAKE_MRS_FAIL"):
            raise ValueError("cannot read the GGUF file")
        with open(jinja_explicit) as file:
            template = file.read()
        self.log = {
            "which": which, "max_seqs": max_seqs, "prefix_cache_n": prefix_cache_n,
            "template": template, "rayon": os.environ.get("RAYON_NUM_THREADS"),
            "requests": [], "most_running": 0,
        }
        self.running = self.finished = 0
        self.prefilling = False

    def detokenize_text(self, tokens, skip_special_tokens):
        return "".join(f"<{t}>" if t < 100 else f"<{t // 100}><{t % 100}>" for t in tokens)

    def tokenize_text(self, text, add_special_tokens, enable_thinking):
        return [int(t) for t in re.findall(r"<(\\d+)>", text)]

    def _save(self):
        with open(os.environ["FAKE_MRS_LOG"], "w") as file:
            json.dump(self.log, file)

    def send_chat_completion_request(self, request):
        with _LOCK:
            if self.prefilling:
                raise RuntimeError("Already borrowed")
            self.prefilling = True
        self.log["requests"].append({
            key: getattr(request, key)
            for key in ("messages", "max_tokens", "temperature", "top_k", "stream",
                        "ignore_eos", "logprobs", "top_logprobs")
        })
        return self._stream(request, len(self.log["requests"]) > 1)

    def _stream(self, request, gather):
        with _LOCK:
            self.running += 1
            self.log["most_running"] = max(self.log["most_running"], self.running)
            _LOCK.notify_all()
        total = int(os.environ.get("FAKE_MRS_GATHER", "0"))
        time.sleep(0.02)
        for made in range(request.max_tokens):
            self.prefilling = False
            top = _Object(token=7, logprob=0.0, bytes=None)
            logprob = _Object(token="<7>", logprob=0.0, bytes=None, top_logprobs=[top])
            delta = _Object(content="<7>", role="assistant")
            yield _Object(choices=[_Object(finish_reason=None, index=0, delta=delta,
                                           logprobs=logprob)], usage=None)
            if made == 0 and gather and total:
                with _LOCK:
                    _LOCK.wait_for(
                        lambda: self.running >= min(self.log["max_seqs"], total - self.finished),
                        timeout=10,
                    )
                    _LOCK.wait_for(lambda: self.running > self.log["max_seqs"], timeout=0.02)
        with _LOCK:
            self.running -= 1
            self.finished += gather
            _LOCK.notify_all()
            self._save()
        delta = _Object(content="", role="assistant")
        yield _Object(choices=[_Object(finish_reason="length", index=0, delta=delta,
                                       logprobs=None)], usage=None)
"""


@pytest.fixture
def model(tmp_path: Path) -> ModelSpec:
    path = tmp_path / "tiny.Q4_1.gguf"
    write_gguf(path, file_type=gguf.LlamaFileType.MOSTLY_Q4_1)
    return ModelSpec(
        name="tiny", source=path, dtype="float32", threads=2, work_dir=tmp_path / "run", seed=3
    )


@pytest.fixture
def fake_mistralrs(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "fake"
    package = root / "mistralrs"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_MISTRALRS))
    # importlib.metadata finds the version here, as in a venv where pip installed it.
    metadata = root / "mistralrs-0.0+fake.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mistralrs\nVersion: 0.0+fake\n"
    )
    return {"PYTHONPATH": str(root), "FAKE_MRS_LOG": str(tmp_path / "fake.json")}


WORKLOAD = Workload(
    requests=(BenchRequest((1, 2, 3), 5), BenchRequest((4, 205), 1), BenchRequest((6,), 4)),
    arrival_times=None,
    seed=0,
    description="three",
)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 64])
def test_offline_run_through_the_real_child(
    fake_mistralrs: dict[str, str], model: ModelSpec, tmp_path: Path, max_num_seqs: int
) -> None:
    env = fake_mistralrs | {"FAKE_MRS_GATHER": "3"}
    driver = MistralRsDriver(sys.executable, max_num_seqs=max_num_seqs, env=env)
    assert driver.check() is None
    result = driver.run(WORKLOAD, model=model)
    assert result.available, result.reason
    assert result.name == "mistral.rs"
    assert [t.output_tokens for t in result.timings] == [5, 1, 4]
    assert [len(t.chunk_times) for t in result.timings] == [5, 1, 4]
    assert [t.prompt_tokens for t in result.timings] == [3, 2, 1]
    assert result.output_token_ids == ((7,) * 5, (7,), (7,) * 4)
    assert result.wall_seconds >= max(t.end for t in result.timings)
    assert result.startup_seconds > 0
    assert result.extra["mistralrs"] == "0.0+fake"
    assert result.extra["scheduler"] == (
        f"max_seqs={max_num_seqs}, prefix cache off, KV cache unpaged, one prompt at a time"
    )
    # Token 205's text is "<2><5>": that prompt's text tokenizes to other ids.
    assert result.extra["prompts_retokenized"] == "1 of 3"
    assert result.extra["weight_format"] == "Q4_1"
    assert result.extra["weights"] == (
        "GGUF Q4_1: Q4_1 65 %, Q8_0 32 %, F32 3 % of 197 weights, computed as stored"
    )
    assert result.extra["batching"] == f"continuous, up to {max_num_seqs} requests"
    log = json.loads((tmp_path / "fake.json").read_text())
    assert log["which"] == ["gguf", str(model.source.parent), model.source.name]
    assert (log["max_seqs"], log["prefix_cache_n"]) == (max_num_seqs, 0)
    assert log["template"] == "{{ messages[0]['content'] }}"
    assert log["rayon"] == "2"  # the bench's threads
    # The warm-up (the first prompt's first 8 tokens), then each request as its text, greedy,
    # streamed with its tokens' ids, to exactly its length.
    assert [(r["messages"], r["max_tokens"]) for r in log["requests"]] == [
        ("<1><2><3>", 2),
        ("<1><2><3>", 5),
        ("<4><2><5>", 1),
        ("<6>", 4),
    ]
    assert all(
        (r["temperature"], r["top_k"], r["stream"], r["ignore_eos"], r["logprobs"])
        == (0.0, 1, True, True, True)
        and r["top_logprobs"] == 1
        for r in log["requests"]
    )
    # As many requests ran at once as max_num_seqs allows, never more (the child admits
    # them itself).
    assert log["most_running"] == min(max_num_seqs, 3)
    if max_num_seqs == 1:  # one after another
        assert result.timings[1].first_token >= result.timings[0].end
        assert result.timings[2].first_token >= result.timings[1].end


def test_serving_requests_start_at_their_arrival_times(
    fake_mistralrs: dict[str, str], model: ModelSpec
) -> None:
    workload = Workload(WORKLOAD.requests, (0.0, 0.0, 0.05), seed=0, description="s")
    result = MistralRsDriver(sys.executable, env=fake_mistralrs).run(workload, model=model)
    assert result.available, result.reason
    assert [t.start for t in result.timings] == [0.0, 0.0, 0.05]
    assert result.timings[2].first_token >= 0.05


def test_a_failure_is_reported_with_its_message(
    fake_mistralrs: dict[str, str], model: ModelSpec
) -> None:
    driver = MistralRsDriver(sys.executable, env=fake_mistralrs | {"FAKE_MRS_FAIL": "1"})
    result = driver.run(WORKLOAD, model=model)
    assert not result.available
    assert result.reason == (
        "mistral.rs failed: ValueError: cannot read the GGUF file; "
        f"see {model.work_dir / 'mistralrs' / 'child.log'}"
    )


def test_what_it_does_not_run(
    fake_mistralrs: dict[str, str], model: ModelSpec, tmp_path: Path
) -> None:
    driver = MistralRsDriver(sys.executable, env=fake_mistralrs)
    folder = ModelSpec(name="hf", source=tmp_path, dtype="float32", work_dir=tmp_path / "r")
    assert driver.run(WORKLOAD, model=folder).reason == (
        f"mistral.rs is run on a GGUF file here; {tmp_path} is not one"
    )
    constrained = Workload(
        (BenchRequest((1, 2), 4, json_schema='{"type": "string"}'),), None, 0, "schema"
    )
    assert driver.run(constrained, model=model).reason == (
        "JSON schemas and tools are not run through mistral.rs here"
    )
    with pytest.raises(ValueError, match=r"^max_num_seqs must be >= 1, got 0$"):
        MistralRsDriver(sys.executable, max_num_seqs=0)


def test_unavailable_without_mistralrs(
    model: ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "mistralrs" else real(name, *a),
    )
    assert MistralRsDriver().check() == (
        f"mistralrs is not installed here and no --mistralrs-python given; {SETUP_HINT}"
    )
    assert MistralRsDriver().run(WORKLOAD, model=model).reason == (
        f"no --mistralrs-python given; {SETUP_HINT}"
    )
    missing = tmp_path / "nowhere" / "python"
    assert MistralRsDriver(missing).check() == (
        f"--mistralrs-python {missing} does not exist; {SETUP_HINT}"
    )


# --- the set-up script ----------------------------------------------------------------------


def _setup(tmp_path: Path, installed: str | None, spec: str) -> subprocess.CompletedProcess[str]:
    """``setup_mistralrs_peer.sh --dry-run`` on a stand-in venv (this Python) that sees a
    ``mistralrs`` distribution of version ``installed`` (``None``: none)."""
    site = tmp_path / "site"
    site.mkdir()
    if installed is not None:
        metadata = site / f"mistralrs-{installed}.dist-info"
        metadata.mkdir()
        (metadata / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: mistralrs\nVersion: {installed}\n"
        )
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "setup_mistralrs_peer.sh"), "--dry-run", str(venv)],
        env={**os.environ, "PYTHONPATH": str(site), "MISTRALRS_SPEC": spec},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_pinned_mistralrs_installed_already_is_not_installed_again(tmp_path: Path) -> None:
    done = _setup(tmp_path, "0.9.5", "mistralrs==0.9.5")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        f"setup_mistralrs_peer: mistralrs==0.9.5 is installed in {tmp_path / 'venv'}; "
        "nothing to do\n"
    )


@pytest.mark.parametrize(
    ("installed", "spec"),
    [
        ("0.9.4", "mistralrs==0.9.5"),  # another version
        (None, "mistralrs==0.9.5"),  # none
        ("0.9.5", "mistralrs>=0.9"),  # not a pin: pip decides
    ],
)
def test_anything_else_installs_mistralrs(tmp_path: Path, installed: str | None, spec: str) -> None:
    done = _setup(tmp_path, installed, spec)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        f"setup_mistralrs_peer: would install: {tmp_path / 'venv' / 'bin' / 'python'} -m pip "
        f"install {spec}\n"
    )


# --- the real peer --------------------------------------------------------------------------


def mistralrs_python() -> Path:
    """The Python of the venv mistralrs is installed in, or a skip saying how to set it up."""
    configured = os.environ.get(MISTRALRS_PYTHON_ENV)
    python = Path(configured) if configured else REPO / ".venv-mistralrs" / "bin" / "python"
    if not python.is_file():
        pytest.skip(
            f"mistralrs is not importable: no {python} (set it up with "
            f"scripts/setup_mistralrs_peer.sh, or set ${MISTRALRS_PYTHON_ENV})"
        )
    return python


@pytest.mark.slow
def test_the_real_peer_on_smollm2(tmp_path: Path) -> None:
    from twostroke.engine.checkpoints.source import resolve_model

    python = mistralrs_python()
    source = resolve_model("smollm2")
    model = ModelSpec(name="smollm2", source=source, dtype="float32", threads=2, work_dir=tmp_path)
    # Token ids of SmolLM2's vocabulary: "The capital of France is", and its first two.
    workload = Workload(
        requests=(BenchRequest((504, 3575, 282, 4649, 314), 6), BenchRequest((504, 3575), 4)),
        arrival_times=None,
        seed=0,
        description="two",
    )
    result = MistralRsDriver(python, max_num_seqs=2).run(workload, model=model)
    assert result.available, result.reason
    assert [t.output_tokens for t in result.timings] == [6, 4]
    assert [len(tokens) for tokens in result.output_token_ids] == [6, 4]
    assert all(0 <= token < 49152 for tokens in result.output_token_ids for token in tokens)
    assert result.extra["weight_format"] == "Q4_1"
    assert result.extra["mistralrs"] == "0.9.5"
    assert result.extra["prompts_retokenized"] == "0 of 2"
    assert result.extra["threads"] == 2
