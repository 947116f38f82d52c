"""The OpenVINO GenAI peer: the real child script over a fake ``openvino_genai`` (the suite
never installs OpenVINO), its admission of requests, and its refusals."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import gguf
import pytest

from tests.engine.bench.test_llamacpp_peer import write_gguf
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.openvino_peer import OpenVinoDriver
from twostroke.engine.bench.workload import BenchRequest, Workload

# Stand-ins for openvino and openvino_genai, as far as the child uses them. The pipeline
# generates token 7 for every running request each step (a request's first step only once
# its whole prompt is in, as a real one's), logs what it was asked to $FAKE_OV_LOG, and its
# scheduler config prints as the real one does, on several lines.
FAKE_OPENVINO = """
class Tensor:
    def __init__(self, array):
        self.array = array
"""

FAKE_OPENVINO_GENAI = """
import json, os, time


def get_version():
    return "0.0-fake"


class SchedulerConfig:
    max_num_seqs = 256

    def to_string(self):
        return "SchedulerConfig {\\n  max_num_seqs: %d\\n }" % self.max_num_seqs


class GenerationConfig:
    pass


class _Output:
    def __init__(self, ids):
        self.generated_ids = ids


class _Handle:
    def __init__(self, config):
        self.left = config.max_new_tokens
        self.fresh = []

    def can_read(self):
        return bool(self.fresh)

    def read(self):
        fresh, self.fresh = self.fresh, []
        return {0: _Output(fresh)}

    def read_all(self):
        return [_Output(self.read()[0].generated_ids)]


class ContinuousBatchingPipeline:
    def __init__(self, path, scheduler, device, properties):
        if os.environ.get("FAKE_OV_FAIL"):
            raise RuntimeError("Exception from src/core: cannot read the GGUF file")
        self.log = {
            "path": path, "device": device, "properties": properties,
            "max_num_seqs": scheduler.max_num_seqs, "added": [], "most_running": 0,
        }
        self.handles = []

    def add_request(self, request_id, input_ids, config):
        assert request_id >= 0
        handle = _Handle(config)
        self.handles.append(handle)
        self.log["added"].append({
            "id": request_id, "ids": input_ids.array.tolist(), "at": time.perf_counter(),
            "max_new_tokens": config.max_new_tokens, "ignore_eos": config.ignore_eos,
            "do_sample": config.do_sample,
        })
        return handle

    def has_non_finished_requests(self):
        return any(handle.left for handle in self.handles)

    def step(self):
        running = [handle for handle in self.handles if handle.left]
        self.log["most_running"] = max(self.log["most_running"], len(running))
        for handle in running:
            handle.fresh.append(7)
            handle.left -= 1
        with open(os.environ["FAKE_OV_LOG"], "w") as file:
            json.dump(self.log, file)
"""


@pytest.fixture
def model(tmp_path: Path) -> ModelSpec:
    path = tmp_path / "tiny.Q4_1.gguf"
    write_gguf(path, file_type=gguf.LlamaFileType.MOSTLY_Q4_1)
    return ModelSpec(
        name="tiny", source=path, dtype="float32", threads=2, work_dir=tmp_path / "run", seed=3
    )


@pytest.fixture
def fake_openvino(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "fake"
    for name, source in (("openvino", FAKE_OPENVINO), ("openvino_genai", FAKE_OPENVINO_GENAI)):
        package = root / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": str(root), "FAKE_OV_LOG": str(tmp_path / "fake.json")}


WORKLOAD = Workload(
    requests=(BenchRequest((1, 2, 3), 5), BenchRequest((4, 5), 1), BenchRequest((6,), 4)),
    arrival_times=None,
    seed=0,
    description="three",
)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 64])
def test_offline_run_through_the_real_child(
    fake_openvino: dict[str, str], model: ModelSpec, tmp_path: Path, max_num_seqs: int
) -> None:
    driver = OpenVinoDriver(sys.executable, max_num_seqs=max_num_seqs, env=fake_openvino)
    assert driver.check() is None
    result = driver.run(WORKLOAD, model=model)
    assert result.available, result.reason
    assert [t.output_tokens for t in result.timings] == [5, 1, 4]
    assert [len(t.chunk_times) for t in result.timings] == [5, 1, 4]
    assert [t.prompt_tokens for t in result.timings] == [3, 2, 1]
    assert result.output_token_ids == ((7,) * 5, (7,), (7,) * 4)
    assert result.wall_seconds >= max(t.end for t in result.timings)
    assert result.startup_seconds > 0
    assert result.extra["openvino-genai"] == "0.0-fake"
    assert result.extra["scheduler"] == f"SchedulerConfig {{ max_num_seqs: {max_num_seqs} }}"
    assert result.extra["weights"] == (
        "GGUF Q4_1: Q4_1 65 %, Q8_0 32 %, F32 3 % of 197 weights, converted by OpenVINO "
        "GenAI at load"
    )
    assert result.extra["batching"] == f"continuous, up to {max_num_seqs} requests"
    log = json.loads((tmp_path / "fake.json").read_text())
    assert (log["path"], log["device"]) == (str(model.source), "CPU")
    assert log["properties"] == {"INFERENCE_NUM_THREADS": 2}
    # The warm-up (the first prompt's first 8 tokens, an id after the workload's), then each
    # request as token ids, greedy, to exactly its length.
    assert [(a["id"], a["ids"]) for a in log["added"]] == [
        (3, [[1, 2, 3]]),
        (0, [[1, 2, 3]]),
        (1, [[4, 5]]),
        (2, [[6]]),
    ]
    assert [a["max_new_tokens"] for a in log["added"]] == [2, 5, 1, 4]
    assert all(a["ignore_eos"] and not a["do_sample"] for a in log["added"])
    # Never more requests running than max_num_seqs (the child admits them itself).
    assert log["most_running"] == min(max_num_seqs, 3)
    if max_num_seqs == 1:  # one after another
        assert result.timings[1].first_token >= result.timings[0].end


def test_serving_requests_start_at_their_arrival_times(
    fake_openvino: dict[str, str], model: ModelSpec, tmp_path: Path
) -> None:
    workload = Workload(WORKLOAD.requests, (0.0, 0.0, 0.05), seed=0, description="s")
    result = OpenVinoDriver(sys.executable, env=fake_openvino).run(workload, model=model)
    assert result.available, result.reason
    assert [t.start for t in result.timings] == [0.0, 0.0, 0.05]
    assert result.timings[2].first_token >= 0.05
    added = json.loads((tmp_path / "fake.json").read_text())["added"]
    # The child's clock starts after the warm-up is added (added[0]) and before the first
    # requests are (added[1], added[2], maybe milliseconds later on a loaded machine): the
    # last request, arriving at 0.05, is added at least that long after the warm-up.
    assert added[3]["at"] - added[0]["at"] >= 0.05
    assert added[3]["at"] > max(added[1]["at"], added[2]["at"])


def test_a_failure_is_reported_with_its_message(
    fake_openvino: dict[str, str], model: ModelSpec
) -> None:
    driver = OpenVinoDriver(sys.executable, env=fake_openvino | {"FAKE_OV_FAIL": "1"})
    result = driver.run(WORKLOAD, model=model)
    assert not result.available
    assert result.reason == (
        "OpenVINO GenAI failed: RuntimeError: Exception from src/core: cannot read the GGUF "
        f"file; see {model.work_dir / 'openvino' / 'child.log'}"
    )


def test_what_it_does_not_run(
    fake_openvino: dict[str, str], model: ModelSpec, tmp_path: Path
) -> None:
    driver = OpenVinoDriver(sys.executable, env=fake_openvino)
    folder = ModelSpec(name="hf", source=tmp_path, dtype="float32", work_dir=tmp_path / "r")
    assert driver.run(WORKLOAD, model=folder).reason == (
        f"OpenVINO GenAI is run on a GGUF file here; {tmp_path} is not one"
    )
    with pytest.raises(ValueError, match=r"^max_num_seqs must be >= 1, got 0$"):
        OpenVinoDriver(sys.executable, max_num_seqs=0)


def test_unavailable_without_openvino(
    model: ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hint = (
        "install it with `make bench-peers` (.venv-openvino), then pass "
        "--openvino-python .venv-openvino/bin/python"
    )
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "openvino_genai" else real(name, *a),
    )
    assert OpenVinoDriver().check() == (
        f"openvino-genai is not installed here and no --openvino-python given; {hint}"
    )
    assert OpenVinoDriver().run(WORKLOAD, model=model).reason == (
        f"no --openvino-python given; {hint}"
    )
    missing = tmp_path / "nowhere" / "python"
    assert OpenVinoDriver(missing).check() == f"--openvino-python {missing} does not exist; {hint}"
