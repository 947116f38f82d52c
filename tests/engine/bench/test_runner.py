"""The runner: systems in turn, failures become rows, and the peers' unavailable paths."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from twostroke.engine.bench import peers, runner
from twostroke.engine.bench.llamacpp_peer import LlamaCppDriver
from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.peers import HFContinuousDriver, HFStaticDriver
from twostroke.engine.bench.roof import MachineRoof
from twostroke.engine.bench.runner import (
    SystemDriver,
    add_bench_arguments,
    bench_command,
    run_systems,
    speed_warning,
)
from twostroke.engine.bench.workload import BenchRequest, Workload, with_json_schemas, with_tools

WORKLOAD = Workload(
    requests=(BenchRequest((1, 2), 2),), arrival_times=None, seed=0, description="one"
)
SERVING = Workload(requests=WORKLOAD.requests, arrival_times=(0.0,), seed=0, description="s")


class FakeDriver:
    """A system that reports fixed timings, refuses to run, or crashes, as told."""

    def __init__(
        self, name: str, *, reason: str | None = None, crash: bool | BaseException = False
    ) -> None:
        self.name = name
        self.reason = reason
        self.crash = crash
        self.ran: list[Workload] = []

    def check(self) -> str | None:
        return self.reason

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        self.ran.append(workload)
        if isinstance(self.crash, BaseException):
            raise self.crash
        if self.crash:
            raise RuntimeError("segfault in the kernel")
        timings = [
            RequestTiming(len(r.prompt_token_ids), r.max_tokens, 0.0, 0.5, 1.0, (0.5, 1.0))
            for r in workload.requests
        ]
        return SystemResult(
            name=self.name, available=True, startup_seconds=0.1, wall_seconds=1.0, timings=timings
        )


def _model(tmp_path: Path) -> ModelSpec:
    return ModelSpec(name="tiny", source=tmp_path, work_dir=tmp_path)


def test_systems_run_in_turn_and_failures_become_rows(tmp_path: Path) -> None:
    good = FakeDriver("good")
    missing = FakeDriver("missing", reason="not installed")
    crashing = FakeDriver("crashing", crash=True)
    out = io.StringIO()
    run = run_systems(
        [good, missing, crashing, FakeDriver("after")],
        WORKLOAD,
        model=_model(tmp_path),
        console=Console(file=out, width=200),
        progress=False,
    )
    assert [r.name for r in run.results] == ["good", "missing", "crashing", "after"]
    assert [r.available for r in run.results] == [True, False, False, True]
    assert run.results[1].reason == "not installed"
    assert run.results[2].reason == "failed: RuntimeError: segfault in the kernel"
    assert missing.ran == []
    assert good.ran == [WORKLOAD]
    assert run.workload is WORKLOAD
    assert run.machine["cores"] is not None
    lines = out.getvalue().splitlines()
    assert any(
        line.startswith("good: 2.0 output tok/s, startup 0.1 s, wall 1.0 s") for line in lines
    )
    assert isinstance(run.results[0].extra["load_average"], float)
    assert "missing: not run: not installed" in lines
    assert isinstance(good, SystemDriver)


def test_the_load_average_at_the_start_is_taken_before_the_systems_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = {"now": 0.25}

    class Busy(FakeDriver):
        def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
            load["now"] = 1.75  # the system itself loads the machine
            return super().run(workload, model=model)

    monkeypatch.setattr(runner, "_load_average", lambda: load["now"])
    run = run_systems([Busy("busy")], WORKLOAD, model=_model(tmp_path), progress=False)
    assert run.machine["load_average_at_start"] == 0.25
    assert run.results[0].extra["load_average"] == 1.75


def test_the_machine_is_probed_around_each_system_and_a_moved_speed_is_said(
    tmp_path: Path,
) -> None:
    """Each system that runs gets the probe before and after it (a skipped one none); where
    a later system's probes are more than SPEED_SPREAD from the first one's mean, a warning
    names it."""
    speeds = iter([100.0, 104.0, 110.0, 96.0, 100.0, 130.0])
    out = io.StringIO()
    run = run_systems(
        [
            FakeDriver("a"),
            FakeDriver("missing", reason="not installed"),
            FakeDriver("b"),
            FakeDriver("c"),
        ],
        WORKLOAD,
        model=_model(tmp_path),
        console=Console(file=out, width=300),
        progress=False,
        speed=lambda: next(speeds),
    )
    probes = [result.extra.get("machine_gflops") for result in run.results]
    assert probes == [[100.0, 104.0], None, [110.0, 96.0], [100.0, 130.0]]
    text = out.getvalue()
    assert "machine 100 -> 104 GFLOPS" in text
    assert "the machine's speed moved during the run: around c it was more than 15%" in text
    steady = run_systems(
        [FakeDriver("a"), FakeDriver("b")],
        WORKLOAD,
        model=_model(tmp_path),
        progress=False,
        speed=lambda: 100.0,
    )
    assert speed_warning(steady.results) is None


def test_the_machine_speed_probe_measures_a_product_on_a_thread_that_ends() -> None:
    import threading

    from twostroke.engine.bench.roof import machine_speed

    before = threading.active_count()
    rate = machine_speed(threads=1, seconds=0.01)
    assert rate > 0.0
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="threads must be an int >= 1, got 0"):
        machine_speed(threads=0)
    with pytest.raises(ValueError, match="seconds must be a finite number > 0, got 0"):
        machine_speed(seconds=0)


def test_the_run_records_how_openmp_threads_wait(tmp_path: Path) -> None:
    from twostroke.gpu.openmp import wait_policy

    run = run_systems([FakeDriver("fake")], WORKLOAD, model=_model(tmp_path), progress=False)
    assert run.machine["openmp_wait_policy"] == wait_policy()


def test_driver_names_must_be_distinct(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="driver names must be distinct, got a twice"):
        run_systems([FakeDriver("a"), FakeDriver("a")], WORKLOAD, model=_model(tmp_path))
    with pytest.raises(ValueError, match="run_systems needs at least one driver, got none"):
        run_systems([], WORKLOAD, model=_model(tmp_path))


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(
        ["--model", str(tmp_path), "--out", str(tmp_path / "out"), "--no-progress", *extra]
    )


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


def _use_fake_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench command reads the model's tokenizer: here a word-length stand-in."""
    from twostroke.engine.text import tokenizer

    monkeypatch.setattr(
        tokenizer.HFTokenizer, "from_pretrained", classmethod(lambda cls, path: _Tokenizer())
    )


def test_bench_command_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_fake_tokenizer(monkeypatch)
    engine = FakeDriver("twostroke-depth2")
    out = io.StringIO()
    args = _args(
        tmp_path,
        "--workload",
        "serving",
        "--rate",
        "8",
        "--num-requests",
        "5",
        "--prompt-len",
        "4",
        "8",
        "--output-len",
        "2",
        "3",
        "--systems",
        "twostroke-depth2,vllm-cpu",
    )
    status = bench_command(
        args,
        engine_drivers=[engine],
        console=Console(file=out, width=250),
        measure_roof=_given_rates,
    )
    assert status == 0
    (workload,) = engine.ran
    assert len(workload.requests) == 5
    assert workload.arrival_times is not None
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [s["name"] for s in document["systems"]] == ["twostroke-depth2", "vllm-cpu"]
    assert document["systems"][1]["reason"].startswith("no --vllm-python given")
    assert "serving: 5 requests at 8/s (Poisson)" in out.getvalue()
    # The model directory has no config.json: the roof is skipped, and says why.
    assert document["roof"] is None
    assert f"roof: not computed: {tmp_path / 'config.json'}: missing" in out.getvalue()


def _given_rates(*, dtype: str, threads: int) -> MachineRoof:
    return MachineRoof(bandwidth=1e9, flops=1e9, dtype=dtype, threads=threads, method="given")


def test_bench_command_computes_the_roof(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_fake_tokenizer(monkeypatch)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 4,
        "intermediate_size": 6,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = io.StringIO()
    shape = ("--num-requests", "3", "--prompt-len", "4", "8", "--output-len", "2", "3")
    args = _args(tmp_path, *shape, "--systems", "twostroke-depth2", "--dtype", "float32")
    engine = FakeDriver("twostroke-depth2")
    console = Console(file=out, width=250)
    assert (
        bench_command(args, engine_drivers=[engine], console=console, measure_roof=_given_rates)
        == 0
    )
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    roof = document["roof"]
    assert roof["machine"]["method"] == "given"
    assert roof["schedule"].startswith("the scheduler's plan without a model")
    (workload,) = engine.ran
    assert roof["output_tokens"] == sum(request.max_tokens for request in workload.requests)
    system = document["systems"][0]
    # The fake system takes 1 s for the workload's tokens; the roof, its floor.
    throughput = system["metrics"]["output_throughput"]
    assert system["fraction_of_roof"] == pytest.approx(throughput / roof["output_throughput"])
    assert throughput == roof["output_tokens"] / 1.0
    text = out.getvalue()
    assert "roof: 1.0 GB/s read, 1.0 GFLOPS float32 on " in text
    assert "% roof" in text
    assert f"{100 * system['fraction_of_roof']:.0f}" in text


def test_no_roof_for_a_gpu_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_fake_tokenizer(monkeypatch)
    args = _args(tmp_path, "--num-requests", "1", "--systems", "twostroke-depth2")
    args.device = "cuda"  # `twostroke bench` adds --device
    out = io.StringIO()

    def measure(**options: object) -> MachineRoof:
        raise AssertionError("a GPU run measures no CPU roof")

    engine = FakeDriver("twostroke-depth2")
    console = Console(file=out, width=250)
    assert bench_command(args, engine_drivers=[engine], console=console, measure_roof=measure) == 0
    assert (
        "roof: not computed: it measures the CPU, and --device cuda runs twostroke's systems "
        "on a GPU"
    ) in out.getvalue()
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["roof"] is None


def test_shared_prefix_workload_from_the_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_fake_tokenizer(monkeypatch)
    engine = FakeDriver("twostroke-depth2")
    args = _args(
        tmp_path,
        "--num-requests",
        "4",
        "--prompt-len",
        "4",
        "8",
        "--output-len",
        "2",
        "3",
        "--shared-prefix-len",
        "16",
        "--num-prefixes",
        "2",
        "--systems",
        "twostroke-depth2",
        "--no-roof",
    )
    assert bench_command(args, engine_drivers=[engine], console=Console(file=io.StringIO())) == 0
    (workload,) = engine.ran
    assert workload.shared_prefix_len == 16
    prefixes = {request.prompt_token_ids[:16] for request in workload.requests}
    assert len(prefixes) == 2


def test_engine_drivers_compare_prefix_caching_on_request() -> None:
    from twostroke.engine.bench.twostroke_driver import engine_drivers

    names = [driver.name for driver in engine_drivers(max_num_seqs=4)]
    assert "twostroke-depth2-nocache" not in names
    compared = engine_drivers(max_num_seqs=4, compare_prefix_caching=True)
    assert compared[-1].name == "twostroke-depth2-nocache"
    assert compared[-1].engine_options == {"max_num_seqs": 4, "enable_prefix_caching": False}


@pytest.mark.parametrize(("fast_bf16", "expected"), [(True, "bfloat16"), (False, "float32")])
def test_dtype_auto_is_the_engines_choice_on_this_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_bf16: bool, expected: str
) -> None:
    """Issue 8: the bench forced bfloat16, which AVX2-only CPUs emulate (13.6 tok/s, not 60)."""
    from twostroke.gpu import dtype

    monkeypatch.setattr(dtype, "_cpu_has_fast_bf16", lambda: fast_bf16)
    assert _args(tmp_path).dtype == "auto"
    assert ModelSpec(name="tiny", source=tmp_path).dtype == expected
    assert ModelSpec(name="tiny", source=tmp_path, dtype="auto").dtype == expected
    assert ModelSpec(name="tiny", source=tmp_path, dtype="float16").dtype == "float16"
    with pytest.raises(
        ValueError,
        match=r"^dtype must be 'auto' or one of 'float32', 'bfloat16', 'float16', got 'fp8'$",
    ):
        ModelSpec(name="tiny", source=tmp_path, dtype="fp8")


@pytest.mark.isa
def test_dtype_auto_follows_the_cpu_personality(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench (and so its peers) asks for what this run's personality makes of ``auto``:
    float32 on every rung below ``avx512_bf16`` (``make test`` runs it again under each)."""
    import torch

    from twostroke.gpu.dtype import CPU_BF16_ENV
    from twostroke.gpu.isa import cpu_personality

    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    native = cpu_personality().bf16 and "AVX512" in torch.backends.cpu.get_cpu_capability()
    assert ModelSpec(name="tiny", source=tmp_path).dtype == ("bfloat16" if native else "float32")


def test_unknown_system(tmp_path: Path) -> None:
    out = io.StringIO()
    status = bench_command(
        _args(tmp_path, "--systems", "hf-static,sglang"), console=Console(file=out, width=200)
    )
    assert status == 2
    assert "unknown system(s) sglang; known: hf-static, hf-continuous, vllm-cpu, llama.cpp" in (
        out.getvalue()
    )


def test_peer_drivers_follow_the_arguments(tmp_path: Path) -> None:
    args = _args(
        tmp_path, "--hf-batch", "8", "--vllm-python", "/x/py", "--llamacpp-python", "/y/py"
    )
    drivers = runner.peer_drivers(args)
    assert [d.name for d in drivers] == list(runner.PEER_NAMES)
    assert isinstance(drivers[0], HFStaticDriver)
    assert drivers[0].batch_size == 8
    assert str(getattr(drivers[2], "python", None)) == "/x/py"
    assert str(getattr(drivers[3], "python", None)) == "/y/py"
    # Without the option, llama.cpp runs in this Python if it has llama-cpp-python.
    assert getattr(runner.peer_drivers(_args(tmp_path))[3], "python", "") is None


# The peers' unavailable paths: each says why, and loads nothing.


def test_hf_static_runs_offline_workloads_only(tmp_path: Path) -> None:
    result = HFStaticDriver().run(SERVING, model=_model(tmp_path))
    assert result == SystemResult.unavailable(
        "hf-static", "static batching runs offline workloads only (generate is a batch call)"
    )
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        HFStaticDriver(batch_size=0)


def test_hf_peers_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("transformers", "accelerate") else real(name, *a),
    )
    reason = (
        "transformers, accelerate not installed "
        "(install the bench extra: pip install 'twostroke[bench]')"
    )
    assert HFStaticDriver().check() == reason
    assert HFContinuousDriver().check() == reason


def test_hf_continuous_without_generate_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    # accelerate is a bench dependency, not a test one: pretend the packages are all there.
    monkeypatch.setattr(peers, "_missing_hf_packages", lambda: None)
    assert HFContinuousDriver().check() is None
    monkeypatch.setattr(transformers, "GenerationMixin", type("GenerationMixin", (), {}))
    assert HFContinuousDriver().check() == (
        f"transformers {transformers.__version__} has no continuous batching (generate_batch)"
    )


def test_llamacpp_unavailable(tmp_path: Path) -> None:
    # A directory model: llama.cpp needs a GGUF file (the rest: test_llamacpp_peer.py).
    result = LlamaCppDriver().run(WORKLOAD, model=_model(tmp_path))
    assert result.reason == f"llama.cpp needs a GGUF file; {tmp_path} is a directory"


def test_hf_continuous_with_an_older_manager_api(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(peers, "_missing_hf_packages", lambda: None)

    class OlderMixin:
        def generate_batch(self) -> None: ...

        def continuous_batching_context_manager(self, generation_config: object = None) -> None: ...

    monkeypatch.setattr(transformers, "GenerationMixin", OlderMixin)
    assert HFContinuousDriver().check() == (
        f"transformers {transformers.__version__} has continuous batching without the manager "
        "API this driver uses (workload hints); upgrade transformers"
    )


def test_a_structured_workload_from_the_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_fake_tokenizer(monkeypatch)
    engine = FakeDriver("twostroke-depth2")
    out = io.StringIO()
    args = _args(
        tmp_path,
        *("--num-requests", "8", "--prompt-len", "4", "8", "--output-len", "2", "3"),
        *("--structured-fraction", "0.25", "--systems", "twostroke-depth2,hf-static"),
    )
    status = bench_command(args, engine_drivers=[engine], console=Console(file=out, width=250))
    assert status == 0
    (workload,) = engine.ran
    assert workload.num_constrained == 2
    assert "2 of 8 with a JSON schema (25%)" in out.getvalue()
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["systems"][1]["reason"] == peers.NO_SCHEMAS


def test_the_peers_without_a_json_schema_sampler_say_so(tmp_path: Path) -> None:
    structured = with_json_schemas(WORKLOAD, 1)
    assert HFStaticDriver().run(structured, model=_model(tmp_path)).reason == peers.NO_SCHEMAS
    assert HFContinuousDriver().run(structured, model=_model(tmp_path)).reason == peers.NO_SCHEMAS
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    gguf = ModelSpec(name="tiny", source=tmp_path / "model.gguf", work_dir=tmp_path)
    assert LlamaCppDriver().run(structured, model=gguf).reason == (
        "JSON schemas and tools are not run through llama.cpp's grammar sampler here"
    )
    offering = with_tools(WORKLOAD, 1)  # tools: a constraint these peers cannot run either
    assert HFStaticDriver().run(offering, model=_model(tmp_path)).reason == peers.NO_SCHEMAS
    assert LlamaCppDriver().run(offering, model=gguf).reason.startswith("JSON schemas and tools")


def test_engine_drivers_compare_unconstrained_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from twostroke.engine.bench import twostroke_driver

    drivers = twostroke_driver.engine_drivers(max_num_seqs=4, compare_unconstrained=True)
    assert [driver.name for driver in drivers] == [
        "twostroke-depth2",
        "bare-forward",
        "twostroke-depth1",
        "twostroke-depth2-unconstrained",
        "twostroke-depth1-unconstrained",
    ]
    ran: list[Workload] = []
    monkeypatch.setattr(
        twostroke_driver.TwostrokeDriver, "_run", lambda self, workload, model: ran.append(workload)
    )
    structured = with_json_schemas(WORKLOAD, 1)
    model = ModelSpec(name="tiny", source=Path("m"))
    drivers[0].run(structured, model=model)
    drivers[3].run(structured, model=model)
    assert [workload.num_constrained for workload in ran] == [1, 0]
    assert ran[1].requests == WORKLOAD.requests


def test_a_failed_group_of_requests_is_reported_by_its_first_error(tmp_path: Path) -> None:
    group = ExceptionGroup(
        "unhandled errors in a TaskGroup",
        [ExceptionGroup("inner", [ValueError("bad schema")]), KeyError("x")],
    )
    run = run_systems(
        [FakeDriver("a", crash=group)], WORKLOAD, model=_model(tmp_path), progress=False,
        console=Console(file=io.StringIO()),
    )  # fmt: skip
    assert run.results[0].reason == "failed: ValueError: bad schema (and 1 more)"
