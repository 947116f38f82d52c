"""The vLLM peer's subprocess protocol, with the real child script over a fake ``vllm``."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.schemas import bench_schema
from twostroke.engine.bench.vllm_peer import (
    NO_TOOLS,
    PROTOCOL,
    ChildError,
    VLLMDriver,
    job_document,
    read_result,
)
from twostroke.engine.bench.workload import BenchRequest, Workload, with_tools
from twostroke.gpu.dtype import CPU_BF16_ENV

# A stand-in for vLLM's offline engine: every step gives each running request up to two new
# tokens (DELTA outputs), so chunks and tokens differ. It logs what it was asked, and the
# environment it ran in, to $FAKE_VLLM_LOG.
FAKE_VLLM = """
import json, os, time

__version__ = "0.0-fake"
_LOG = os.environ["FAKE_VLLM_LOG"]


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, request_id, token_ids, finished):
        self.request_id = request_id
        self.outputs = [_Completion(token_ids)]
        self.finished = finished


class _Engine:
    def __init__(self, log):
        self.log = log
        self.running = {}

    def add_request(self, request_id, prompt, params):
        self.log["added"].append(
            {"id": request_id, "at": time.perf_counter(), "prompt": prompt["prompt_token_ids"],
             "params": params.__dict__ | {"output_kind": str(params.output_kind)}}
        )
        self.running[request_id] = params.max_tokens

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outputs = []
        for request_id, left in list(self.running.items()):
            new = min(2, left)
            self.running[request_id] = left - new
            done = left == new
            if done:
                del self.running[request_id]
            outputs.append(_Output(request_id, [7] * new, done))
        return outputs


class LLM:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("no memory for the KV cache")
        env = {k: os.environ.get(k) for k in (
            "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CACHE_ROOT",
            "TORCHINDUCTOR_CACHE_DIR", "TMPDIR", "HF_HUB_OFFLINE")}
        self.log = {"kwargs": kwargs, "env": env, "added": [], "origin": time.perf_counter()}
        self.llm_engine = _Engine(self.log)

    def __del__(self):
        with open(_LOG, "w") as file:
            json.dump(self.log, file, default=lambda value: {type(value).__name__: value.__dict__})
"""

SAMPLING_PARAMS = """
import enum, os

class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

class GuidedDecodingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

if not os.environ.get("FAKE_VLLM_BEFORE_0_10_2"):
    class StructuredOutputsParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)
"""


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (package / "sampling_params.py").write_text(textwrap.dedent(SAMPLING_PARAMS))
    return {"PYTHONPATH": str(tmp_path / "fake"), "FAKE_VLLM_LOG": str(tmp_path / "fake.json")}


@pytest.fixture
def model(tmp_path: Path) -> ModelSpec:
    # A Hugging Face directory source: the driver passes it to vLLM as it is, no conversion.
    source = tmp_path / "hf-model"
    source.mkdir()
    return ModelSpec(name="tiny", source=source, threads=2, work_dir=tmp_path / "run", seed=3)


WORKLOAD = Workload(
    requests=(BenchRequest((1, 2, 3), 5), BenchRequest((4, 5), 1), BenchRequest((6,), 4)),
    arrival_times=None,
    seed=0,
    description="three",
)


@pytest.mark.parametrize(("cpu_bf16", "dtype"), [("native", "bfloat16"), ("emulated", "float32")])
def test_offline_run_through_the_real_child(
    fake_vllm: dict[str, str],
    model: ModelSpec,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cpu_bf16: str,
    dtype: str,
) -> None:
    # vLLM is asked for the dtype twostroke's rule picks for this CPU ("auto", resolved when
    # the spec is made), on either side of the rule whatever machine runs the test.
    monkeypatch.setenv(CPU_BF16_ENV, cpu_bf16)
    model = attrs.evolve(model, dtype="auto")
    driver = VLLMDriver(sys.executable, env=fake_vllm)
    assert driver.check() is None
    result = driver.run(WORKLOAD, model=model)
    assert result.available, result.reason
    assert [t.output_tokens for t in result.timings] == [5, 1, 4]
    # Two tokens a step: 5 tokens come in 3 chunks, 4 in 2, 1 in 1.
    assert [len(t.chunk_times) for t in result.timings] == [3, 1, 2]
    assert [t.prompt_tokens for t in result.timings] == [3, 2, 1]
    assert all(t.start == 0.0 for t in result.timings)
    assert result.wall_seconds >= max(t.end for t in result.timings)
    assert result.startup_seconds > 0
    assert result.extra["vllm"] == "0.0-fake"
    assert result.extra["threads"] == 2

    log = json.loads((tmp_path / "fake.json").read_text())
    assert log["kwargs"] == {
        "model": str(model.source),
        "dtype": dtype,
        "seed": 3,
        "max_model_len": 8,
        "enable_prefix_caching": False,
    }
    assert [a["prompt"] for a in log["added"]] == [[1, 2, 3], [4, 5], [6]]
    params = log["added"][0]["params"]
    assert params["temperature"] == 0.0
    assert params["ignore_eos"] is True
    assert params["max_tokens"] == 5
    assert params["output_kind"] == "RequestOutputKind.DELTA"
    run = model.work_dir / "vllm"
    assert log["env"] == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(run / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(run / "inductor"),
        "TMPDIR": str(run / "tmp"),
        "HF_HUB_OFFLINE": "1",
    }


@pytest.mark.parametrize(
    ("before_0_10_2", "keyword", "kind"),
    [(False, "structured_outputs", "StructuredOutputsParams"),
     (True, "guided_decoding", "GuidedDecodingParams")],
)  # fmt: skip
def test_a_json_schema_reaches_vllms_structured_outputs(
    fake_vllm: dict[str, str],
    model: ModelSpec,
    tmp_path: Path,
    before_0_10_2: bool,
    keyword: str,
    kind: str,
) -> None:
    schema = bench_schema(5)
    requests = list(WORKLOAD.requests)
    requests[0] = attrs.evolve(requests[0], json_schema=json.dumps(schema))
    workload = attrs.evolve(WORKLOAD, requests=requests)
    env = fake_vllm | ({"FAKE_VLLM_BEFORE_0_10_2": "1"} if before_0_10_2 else {})
    result = VLLMDriver(sys.executable, env=env).run(workload, model=model)
    assert result.available, result.reason
    added = json.loads((tmp_path / "fake.json").read_text())["added"]
    assert added[0]["params"][keyword] == {kind: {"json": schema}}
    assert all(key not in a["params"] for a in added[1:] for key in (keyword, "guided_decoding"))


def test_serving_requests_join_at_their_arrival_times(
    fake_vllm: dict[str, str], model: ModelSpec, tmp_path: Path
) -> None:
    workload = Workload(
        requests=WORKLOAD.requests, arrival_times=(0.0, 0.0, 0.05), seed=0, description="s"
    )
    result = VLLMDriver(sys.executable, env=fake_vllm).run(workload, model=model)
    assert result.available, result.reason
    assert [t.start for t in result.timings] == [0.0, 0.0, 0.05]
    assert result.timings[2].first_token >= 0.05
    log = json.loads((tmp_path / "fake.json").read_text())
    first = log["added"][0]["at"]
    assert log["added"][2]["at"] - first >= 0.05


def test_a_vllm_failure_is_reported_with_its_message(
    fake_vllm: dict[str, str], model: ModelSpec
) -> None:
    driver = VLLMDriver(sys.executable, env=fake_vllm | {"FAKE_VLLM_FAIL": "1"})
    result = driver.run(WORKLOAD, model=model)
    assert not result.available
    assert result.reason is not None
    assert result.reason.startswith("vLLM failed: RuntimeError: no memory for the KV cache; see ")
    assert result.reason.endswith("child.log")


def test_a_child_that_dies_without_a_result(model: ModelSpec, tmp_path: Path) -> None:
    script = tmp_path / "dies.py"
    script.write_text("import sys\nprint('Illegal instruction in oneDNN')\nsys.exit(3)\n")
    result = VLLMDriver(sys.executable, child_script=script).run(WORKLOAD, model=model)
    assert not result.available
    assert result.reason is not None
    assert result.reason.startswith(
        "vLLM exited with status 3 and no result (Illegal instruction in oneDNN); see "
    )


def test_unavailable_without_a_usable_python(tmp_path: Path, model: ModelSpec) -> None:
    assert VLLMDriver(None).check() == (
        "no --vllm-python given; set it up with `make bench-peers`, then pass "
        "--vllm-python .venv-vllm/bin/python"
    )
    missing = tmp_path / "nowhere" / "python"
    reason = VLLMDriver(missing).check()
    assert reason is not None
    assert reason.startswith(f"--vllm-python {missing} does not exist")
    # This venv's Python has no vllm.
    reason = VLLMDriver(sys.executable).check()
    assert reason is not None
    assert reason.startswith(f"{sys.executable} cannot import vllm")
    assert not VLLMDriver(None).run(WORKLOAD, model=model).available
    offering = VLLMDriver(sys.executable).run(with_tools(WORKLOAD, 1), model=model)
    assert offering.reason == NO_TOOLS


def test_job_document(model: ModelSpec) -> None:
    serving = Workload(WORKLOAD.requests, (0.0, 0.5, 1.0), 0, "s")
    document = job_document(serving, model_dir=Path("/m"), model=model)
    assert document["protocol"] == PROTOCOL
    assert document["requests"][0] == {
        "prompt_token_ids": [1, 2, 3],
        "max_tokens": 5,
        "json_schema": None,
    }
    assert document["arrival_times"] == [0.0, 0.5, 1.0]
    assert document["max_model_len"] == 8
    json.dumps(document)


def test_vllm_caches_prefixes_only_when_the_workload_shares_them(model: ModelSpec) -> None:
    plain = job_document(WORKLOAD, model_dir=Path("/m"), model=model)
    shared = Workload(WORKLOAD.requests, None, 0, "s", shared_prefix_len=2)
    document = job_document(shared, model_dir=Path("/m"), model=model)
    assert plain["engine_args"] == {"enable_prefix_caching": False}
    assert document["engine_args"] == {"enable_prefix_caching": True}


def test_vllm_runs_at_most_max_num_seqs_requests_when_it_is_given(model: ModelSpec) -> None:
    bounded = job_document(WORKLOAD, model_dir=Path("/m"), model=model, max_num_seqs=1)
    assert bounded["engine_args"] == {"enable_prefix_caching": False, "max_num_seqs": 1}
    assert VLLMDriver(None, max_num_seqs=1).max_num_seqs == 1


def _timing(tokens: int) -> dict[str, object]:
    return {
        "prompt_tokens": 1,
        "output_tokens": tokens,
        "start": 0.0,
        "first_token": 0.1,
        "end": 0.2,
        "chunk_times": [0.1, 0.2],
    }


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"protocol": 1}, f"the child speaks protocol 1, expected {PROTOCOL}"),
        ({"protocol": PROTOCOL, "error": "OSError: disk full"}, "vLLM failed: OSError: disk full"),
        (
            {"protocol": PROTOCOL, "timings": []},
            "the child's result is malformed: 'startup_seconds'",
        ),
        (
            {
                "protocol": PROTOCOL,
                "startup_seconds": 1,
                "wall_seconds": 1,
                "timings": [_timing(5)],
            },
            "the child returned 1 timings for 3 requests",
        ),
        (
            {
                "protocol": PROTOCOL,
                "startup_seconds": 1,
                "wall_seconds": 1,
                "timings": [_timing(5), _timing(2), _timing(4)],
            },
            "request 1 generated 2 tokens, expected 1",
        ),
    ],
)
def test_bad_results_are_refused(document: dict[str, object], message: str) -> None:
    with pytest.raises(ChildError, match=message):
        read_result(document, name="vllm-cpu", workload=WORKLOAD)
