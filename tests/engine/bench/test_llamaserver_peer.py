"""The llama-server peer: its command line, its set-up script, a fake server it starts and
ends however the run ends, and (where ``make bench-peers`` built it) the real server on
SmolLM2's GGUF file.

The fake (``FAKE_SERVER``) is a Python script that takes llama-server's command line, starts a
grandchild that would sleep for ten minutes (to see that the whole group ends), and serves
``/health``, ``/v1/models`` and streamed ``/v1/completions`` on the given port, as
``$FAKE_SERVER_MODE`` says."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import gguf
import pytest

from tests.engine.bench.test_child import _ended
from tests.engine.bench.test_llamacpp_peer import write_gguf
from twostroke.engine.bench import llamaserver_peer, runner
from twostroke.engine.bench.http_peer import EndpointDriver
from twostroke.engine.bench.llamaserver_peer import (
    SETUP_HINT,
    LlamaServerDriver,
    server_command,
)
from twostroke.engine.bench.metrics import metrics
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import BenchRequest, Workload, with_json_schemas

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"

pytestmark = pytest.mark.skipif(
    not hasattr(os, "pidfd_open"), reason="waits for a grandchild through a pidfd (Linux)"
)

FAKE_SERVER = """
import json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

if sys.argv[1:] == ["--version"]:
    print("version: 0.5.0-dev (build 0, commit fake)", file=sys.stderr)
    sys.exit(0)
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode = os.environ.get("FAKE_SERVER_MODE", "serve")
record = Path(os.environ["FAKE_SERVER_RECORD"])
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
(record / "pids").write_text(f"{os.getpid()} {sleeper.pid}")
(record / "argv.json").write_text(json.dumps(args))
if mode == "exit":
    print("error: failed to load model", flush=True)
    sys.exit(3)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(503 if mode == "loading" else 200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"data": [{"id": "fake.gguf"}]})
        else:
            self._json(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with (record / "requests.jsonl").open("a") as log:
            log.write(json.dumps(body) + "\\n")
        if mode == "die":
            os._exit(7)
        if mode == "reject":
            self._json(500, {"error": "no"})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "x"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\\n\\n".encode())
        self.wfile.write(b"data: [DONE]\\n\\n")


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

WORKLOAD = Workload(
    requests=(BenchRequest((1, 2, 3), 5), BenchRequest((4, 5), 2), BenchRequest((6,), 4)),
    arrival_times=None,
    seed=0,
    description="three",
)


@pytest.fixture
def model(tmp_path: Path) -> ModelSpec:
    path = tmp_path / "tiny.Q4_1.gguf"
    write_gguf(path, file_type=gguf.LlamaFileType.MOSTLY_Q4_1)
    return ModelSpec(
        name="tiny", source=path, dtype="float32", threads=2, work_dir=tmp_path / "run", seed=3
    )


@pytest.fixture
def record(tmp_path: Path) -> Iterator[Path]:
    """The fake's folder for what it saw; its sleeper and its group are killed after the
    test, whatever the test found (a failing run leaves them)."""
    folder = tmp_path / "record"
    folder.mkdir()
    yield folder
    with contextlib.suppress(OSError, ValueError):
        server, sleeper = _pids(folder)
        os.kill(sleeper, signal.SIGKILL)
        os.killpg(server, signal.SIGKILL)  # the driver's job; here only if it failed at it


def _fake(tmp_path: Path, record: Path, mode: str = "serve", **options: float) -> LlamaServerDriver:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    env = {"FAKE_SERVER_MODE": mode, "FAKE_SERVER_RECORD": str(record)}
    return LlamaServerDriver(binary=binary, max_num_seqs=2, env=env, **options)


def _pids(record: Path) -> tuple[int, int]:
    pid, grandchild = (record / "pids").read_text().split()
    return int(pid), int(grandchild)


def _assert_all_ended(record: Path) -> None:
    """The server was reaped (nothing left to wait for), and what it started ended."""
    pid, grandchild = _pids(record)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    assert _ended(grandchild)


def test_the_command_line(model: ModelSpec) -> None:
    command = server_command(Path("/opt/llama-server"), WORKLOAD, model=model, slots=2, port=8123)
    assert command == [
        "/opt/llama-server",
        *("-m", str(model.source), "--host", "127.0.0.1", "--port", "8123"),
        # Two slots, each holding the longest request whole (3 prompt + 5 output tokens),
        # rounded up to 256 tokens as the server rounds a slot's context.
        *("-np", "2", "-c", "512", "--threads", "2", "--threads-batch", "2"),
        *("--cont-batching", "--no-webui"),
    ]


def test_a_slot_holds_the_longest_request_rounded_up_to_256(model: ModelSpec) -> None:
    longest = Workload(
        requests=(BenchRequest(tuple(range(200)), 56), BenchRequest((1,), 1)),
        arrival_times=None,
        seed=0,
        description="",
    )
    command = server_command(Path("s"), longest, model=model, slots=3, port=1)
    assert command[command.index("-c") + 1] == "768"  # 256 exactly: 3 x 256
    longer = attrs.evolve(longest, requests=(BenchRequest(tuple(range(200)), 57),))
    command = server_command(Path("s"), longer, model=model, slots=3, port=1)
    assert command[command.index("-c") + 1] == "1536"  # 257: 3 x 512


def test_no_more_slots_than_requests() -> None:
    assert LlamaServerDriver(max_num_seqs=2).slots(WORKLOAD) == 2
    assert LlamaServerDriver(max_num_seqs=64).slots(WORKLOAD) == 3
    with pytest.raises(ValueError, match="max_num_seqs"):
        LlamaServerDriver(max_num_seqs=0)


def test_a_run_drives_the_server_as_an_endpoint_and_ends_it(
    tmp_path: Path, record: Path, model: ModelSpec
) -> None:
    result = _fake(tmp_path, record).run(WORKLOAD, model=model)
    assert result.available, result.reason
    assert [t.output_tokens for t in result.timings] == [5, 2, 4]
    assert [t.prompt_tokens for t in result.timings] == [3, 2, 1]
    assert metrics(result).output_throughput > 0
    assert result.startup_seconds > 0
    argv = json.loads((record / "argv.json").read_text())
    assert argv[argv.index("-np") + 1] == "2"
    assert argv[argv.index("-m") + 1] == str(model.source)
    # The requests are EndpointDriver's: token ids, greedy, EOS ignored, usage asked for.
    sent = [json.loads(line) for line in (record / "requests.jsonl").read_text().splitlines()]
    assert sorted(body["prompt"] for body in sent) == [[1, 2, 3], [4, 5], [6]]
    assert all(
        (body["temperature"], body["ignore_eos"], body["stream"], body["model"])
        == (0, True, True, "fake.gguf")
        for body in sent
    )
    # The report's row is "llama-server (Q4_1)", with how it batched and what it ran.
    assert result.extra["weight_format"] == "Q4_1"
    assert result.extra["weights"].endswith(", computed as stored")
    assert result.extra["batching"] == "continuous, 2 slots (-np 2)"
    assert result.extra["version"] == "version: 0.5.0-dev (build 0, commit fake)"
    assert result.extra["command"].startswith(f"{tmp_path / 'llama-server'} -m ")
    _assert_all_ended(record)


def test_a_server_that_exits_before_it_is_ready(
    tmp_path: Path, record: Path, model: ModelSpec
) -> None:
    result = _fake(tmp_path, record, "exit").run(WORKLOAD, model=model)
    log = model.work_dir / "llamaserver" / "server.log"
    assert result.reason == (
        f"llama-server exited with status 3 before it was ready (error: failed to load model); "
        f"see {log}"
    )
    _assert_all_ended(record)


def test_a_server_that_stays_unhealthy_is_ended_at_the_startup_timeout(
    tmp_path: Path, record: Path, model: ModelSpec
) -> None:
    driver = _fake(tmp_path, record, "loading", startup_timeout=0.3)
    result = driver.run(WORKLOAD, model=model)
    log = model.work_dir / "llamaserver" / "server.log"
    assert result.reason == (
        f"llama-server was not healthy within startup_timeout=0.3 s; see {log}"
    )
    _assert_all_ended(record)


def test_a_server_that_dies_during_the_run(tmp_path: Path, record: Path, model: ModelSpec) -> None:
    result = _fake(tmp_path, record, "die").run(WORKLOAD, model=model)
    assert not result.available
    assert result.reason is not None
    assert result.reason.startswith("llama-server exited with status 7 during the run")
    _assert_all_ended(record)


def test_a_failed_request_is_raised_and_the_server_ended(
    tmp_path: Path, record: Path, model: ModelSpec
) -> None:
    with pytest.raises(ExceptionGroup) as caught:
        _fake(tmp_path, record, "reject").run(WORKLOAD, model=model)
    assert caught.group_contains(RuntimeError, match="the endpoint answered 500")
    _assert_all_ended(record)


class Interrupted(BaseException):
    """A Ctrl-C in the middle of the run, as far as the driver knows."""


def test_an_interrupted_run_ends_and_reaps_the_server(
    tmp_path: Path, record: Path, model: ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(self: EndpointDriver, workload: Workload, *, model: ModelSpec) -> None:
        raise Interrupted

    monkeypatch.setattr(EndpointDriver, "run", interrupt)
    with pytest.raises(Interrupted):
        _fake(tmp_path, record).run(WORKLOAD, model=model)
    _assert_all_ended(record)


def test_not_available_says_how_to_build_it(tmp_path: Path, model: ModelSpec) -> None:
    assert LlamaServerDriver().check() == f"llama-server is not available: {SETUP_HINT}"
    missing = tmp_path / "nowhere" / "llama-server"
    assert LlamaServerDriver(binary=missing).check() == (
        f"--llamaserver-binary {missing} does not exist: {SETUP_HINT}"
    )
    result = LlamaServerDriver().run(WORKLOAD, model=model)
    assert result.reason == f"llama-server is not available: {SETUP_HINT}"
    assert "make bench-peers" in SETUP_HINT
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'illegal instruction' >&2\nexit 4\n")
    broken.chmod(0o755)
    assert LlamaServerDriver(binary=broken).check() == (
        f"{broken} --version failed (4): illegal instruction"
    )


def test_what_it_does_not_run(tmp_path: Path, model: ModelSpec) -> None:
    folder = ModelSpec(name="dir", source=tmp_path, work_dir=tmp_path / "run")
    driver = LlamaServerDriver(binary=tmp_path / "unused")
    assert driver.run(WORKLOAD, model=folder).reason == (
        f"llama-server needs a GGUF file; {tmp_path} is not one"
    )
    assert driver.run(with_json_schemas(WORKLOAD, 1), model=model).reason == (
        "JSON schemas and tools are not run through llama-server's grammar here"
    )


def test_the_bench_runs_it_beside_llamacpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    runner.add_bench_arguments(parser)
    args = parser.parse_args(["--llamaserver-binary", "/z/llama-server"])
    drivers = runner.peer_drivers(args)
    assert [d.name for d in drivers][3:5] == ["llama.cpp", "llama-server"]
    server = drivers[4]
    assert isinstance(server, LlamaServerDriver)
    assert server.binary == Path("/z/llama-server")
    assert server.max_num_seqs == 64  # the engine's, as OpenVINO GenAI's
    # Without the option: make bench-peers' build where it exists, else none.
    monkeypatch.chdir(tmp_path)
    plain = parser.parse_args([])
    assert getattr(runner.peer_drivers(plain)[4], "binary", "") is None
    built = tmp_path / llamaserver_peer.DEFAULT_BINARY
    built.parent.mkdir(parents=True)
    built.touch()
    assert getattr(runner.peer_drivers(plain)[4], "binary", "") == llamaserver_peer.DEFAULT_BINARY


# --- the set-up script ----------------------------------------------------------------------


def _setup(tmp_path: Path, *options: str, says: str | None) -> subprocess.CompletedProcess[str]:
    """``setup_llamaserver_peer.sh --dry-run`` on a venv whose llama-server ``--version``
    says ``says`` (``None``: no binary there)."""
    venv = tmp_path / "venv"
    target = venv / ("avx2/bin" if "--avx2" in options else "bin") / "llama-server"
    target.parent.mkdir(parents=True)
    if says is not None:
        target.write_text(f"#!/bin/sh\necho 'version: 0.5.0-dev ({says})' >&2\n")
        target.chmod(0o755)
    env = {**os.environ, "BUILD_DIR": str(tmp_path / "build")}
    for name in ("CMAKE_ARGS", "CMAKE_BUILD_PARALLEL_LEVEL", "LLAMACPP_VERSION"):
        env.pop(name, None)
    return subprocess.run(
        ["bash", str(SCRIPTS / "setup_llamaserver_peer.sh"), "--dry-run", *options, str(venv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_pinned_llamaserver_built_already_is_not_built_again(tmp_path: Path) -> None:
    done = _setup(tmp_path, says="build 0, commit llama-cpp-python-0.3.36-native")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        "setup_llamaserver_peer: llama-server (llama-cpp-python-0.3.36-native) is built in "
        f"{tmp_path / 'venv' / 'bin' / 'llama-server'}; nothing to do\n"
    )


@pytest.mark.parametrize(
    "says", [None, "build 0, commit llama-cpp-python-0.3.35-native", "build 4110, commit abc"]
)
def test_anything_else_is_built_natively_on_two_cores(tmp_path: Path, says: str | None) -> None:
    done = _setup(tmp_path, says=says)
    assert done.returncode == 0, done.stdout + done.stderr
    build = tmp_path / "build"
    lines = done.stdout.splitlines()
    assert lines[0] == (
        f"setup_llamaserver_peer: would download llama-cpp-python==0.3.36's source into {build}"
    )
    assert lines[1] == (
        f"setup_llamaserver_peer: would build: cmake -S "
        f"{build}/llama_cpp_python-0.3.36/vendor/llama.cpp -B {build}/build-0.3.36-native "
        "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF "
        "-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF "
        "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF "
        "-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_NUMBER=0 "
        "-DLLAMA_BUILD_COMMIT=llama-cpp-python-0.3.36-native && cmake --build "
        f"{build}/build-0.3.36-native --target llama-server -j 2"
    )
    assert lines[2:] == [
        f"setup_llamaserver_peer: would install {tmp_path / 'venv' / 'bin' / 'llama-server'}"
    ]


def test_the_avx2_rung_is_built_apart_without_avx512(tmp_path: Path) -> None:
    # The native build there is not the AVX2 one.
    done = _setup(tmp_path, "--avx2", says="build 0, commit llama-cpp-python-0.3.36-native")
    assert done.returncode == 0, done.stdout + done.stderr
    build_line = done.stdout.splitlines()[1]
    assert f"-B {tmp_path}/build/build-0.3.36-avx2 " in build_line
    assert (
        "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
        "-DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF "
        "-DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
        "-DGGML_AMX_BF16=OFF "
    ) in build_line
    assert "-DLLAMA_BUILD_COMMIT=llama-cpp-python-0.3.36-avx2 " in build_line
    assert done.stdout.splitlines()[2] == (
        "setup_llamaserver_peer: would install "
        f"{tmp_path / 'venv' / 'avx2' / 'bin' / 'llama-server'}"
    )
    unknown = _setup(tmp_path / "other", "--avx512", says=None)
    assert unknown.returncode == 2
    assert unknown.stderr == (
        "setup_llamaserver_peer: unknown option --avx512 (known: --dry-run, --avx2)\n"
    )


# --- the real server ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_real_server_on_smollm2(tmp_path: Path) -> None:
    from twostroke.engine.checkpoints.source import resolve_model

    binary = Path(__file__).resolve().parents[3] / llamaserver_peer.DEFAULT_BINARY
    if not binary.exists():
        pytest.skip(f"{binary} is not built here: {SETUP_HINT}")
    source = resolve_model("smollm2")
    model = ModelSpec(name="smollm2", source=source, dtype="float32", threads=2, work_dir=tmp_path)
    # Token ids of SmolLM2's vocabulary (any below 49152): "The capital of France is".
    workload = Workload(
        requests=(BenchRequest((504, 3575, 282, 4649, 314), 6), BenchRequest((504, 3575), 4)),
        arrival_times=None,
        seed=0,
        description="two",
    )
    result = LlamaServerDriver(binary=binary, max_num_seqs=2).run(workload, model=model)
    assert result.available, result.reason
    assert [t.output_tokens for t in result.timings] == [6, 4]
    assert result.extra["weight_format"] == "Q4_1"
    assert result.extra["version"] == (
        "version: 0.5.0-dev (build 0, commit llama-cpp-python-0.3.36-native)"
    )
