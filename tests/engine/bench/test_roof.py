"""The roof: schedules, floors and fractions from given rates (the probe: test_probe.py)."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch

from tests.engine.bench.test_cost import TINY
from twostroke.engine.bench.cost import ModelCost, RowShape
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.probe import MachineRoof
from twostroke.engine.bench.roof import (
    prepare_roof,
    recorded_schedule,
    roof_of_run,
    simulated_plans,
    workload_roof,
)
from twostroke.engine.bench.workload import BenchRequest, Workload
from twostroke.engine.checkpoints.source import ModelLoadError
from twostroke.engine.models.choice import auto_kv_cache_dtype, auto_quantization
from twostroke.states.scheduler_config import SchedulingPolicy

WORKLOAD = Workload(
    requests=(BenchRequest((1, 2, 3), 2), BenchRequest((4, 5), 2)),
    arrival_times=None,
    seed=0,
    description="two",
)
COST = ModelCost.of(TINY)


def _rows(plans: list[object]) -> list[list[tuple[int, int, bool]]]:
    return [
        [(entry.start, entry.num_tokens, entry.sample) for entry in plan.requests]  # type: ignore[attr-defined]
        for plan in plans
    ]


def test_the_simulated_schedule_is_the_schedulers() -> None:
    # Both prompts in one step, each samples its first token; one decode each samples the second.
    assert _rows(simulated_plans(WORKLOAD)) == [
        [(0, 3, True), (0, 2, True)],
        [(3, 1, True), (2, 1, True)],
    ]
    # A budget of 2 tokens a step chunks the prompts and lets the oldest request go first.
    chunked = simulated_plans(WORKLOAD, SchedulingPolicy(max_num_batched_tokens=2))
    assert _rows(chunked) == [
        [(0, 2, False)],
        [(2, 1, True), (0, 1, False)],
        [(3, 1, True), (1, 1, True)],
        [(2, 1, True)],
    ]


def test_the_floor_is_the_slower_side_of_each_step() -> None:
    plans = simulated_plans(WORKLOAD)
    prefill = COST.step([RowShape(0, 3), RowShape(0, 2)])
    decode = COST.step([RowShape(3, 1), RowShape(2, 1)])
    # Rates that make the prefill compute-bound and the decode memory-bound.
    bandwidth = decode.bytes * 1000.0  # the decode's bytes take 1 ms
    flops = prefill.flops * 1000.0 / 2  # the prefill's FLOPs take 2 ms
    assert prefill.bytes / bandwidth < 0.002
    assert decode.flops / flops < 0.001
    machine = MachineRoof(bandwidth=bandwidth, flops=flops, dtype="float32", threads=2)
    roof = workload_roof(machine, COST, plans, schedule="the test's", output_tokens=4)
    assert roof.floor_seconds == pytest.approx(0.002 + 0.001)
    assert roof.steps == 2
    assert roof.memory_bound_steps == 1
    assert roof.bytes == prefill.bytes + decode.bytes
    assert roof.flops == prefill.flops + decode.flops
    assert roof.output_throughput == pytest.approx(4 / 0.003)
    assert roof.fraction(roof.output_throughput / 4) == pytest.approx(0.25)
    assert roof.summary() == (
        f"roof: {bandwidth / 1e9:.1f} GB/s read, {flops / 1e9:.1f} GFLOPS float32 on 2 threads; "
        f"floor 0.00 s over 2 steps (50 % memory-bound) of the test's → "
        f"{4 / 0.003:.1f} output tok/s"
    )
    document = json.loads(json.dumps(roof.to_json()))
    assert document["machine"]["bandwidth"] == bandwidth
    assert document["output_throughput"] == pytest.approx(4 / 0.003)
    with pytest.raises(ValueError, match="a workload's roof needs at least one step, got none"):
        workload_roof(machine, COST, [], schedule="none", output_tokens=4)


class _Recorded:
    def __init__(self, name: str, plans: list[object] | None) -> None:
        self.name = name
        self.recording = None if plans is None else attrs.make_class("R", ["plans"])(plans)


def test_the_recorded_schedule_is_preferred() -> None:
    machine = MachineRoof(bandwidth=1e9, flops=1e9, dtype="float32", threads=1)
    recorded = simulated_plans(WORKLOAD)[:1]
    drivers = [_Recorded("twostroke-depth1", None), _Recorded("twostroke-depth2", recorded)]
    assert recorded_schedule(drivers, "twostroke-depth2") == recorded
    assert recorded_schedule(drivers, "twostroke-depth1") is None
    roof = roof_of_run(machine, COST, WORKLOAD, drivers=drivers)
    assert (roof.steps, roof.schedule) == (1, "the schedule twostroke-depth2 ran")
    assert roof.output_tokens == 4
    simulated = roof_of_run(machine, COST, WORKLOAD, drivers=drivers[:1])
    assert simulated.steps == 2
    assert simulated.schedule == (
        "the scheduler's plan without a model (no twostroke-depth2 run to replay)"
    )
    serving = attrs.evolve(WORKLOAD, arrival_times=(0.0, 1.0))
    assert roof_of_run(machine, COST, serving).schedule.endswith("; every request at t = 0)")


def test_prepare_reads_the_shape_and_measures_at_the_bench_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The roof costs the engine's plan of the run (resolve_run): the bench's dtype where it
    asks for exact arithmetic, else the engine's dtype="auto" (the machine's default)."""
    from twostroke.gpu import dtype as dtype_module

    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 4,
        "intermediate_size": 6,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    asked: list[dict[str, object]] = []

    def measure(**options: object) -> MachineRoof:
        asked.append(options)
        return MachineRoof(bandwidth=1e9, flops=1e9, dtype="bfloat16", threads=3)

    spec = ModelSpec(name="tiny", source=tmp_path, dtype="bfloat16", threads=3)
    machine, cost = prepare_roof(spec, measure=measure)
    assert asked == [{"dtype": "bfloat16", "threads": 3}]
    assert cost == ModelCost.of(TINY, dtype="bfloat16")
    assert machine.threads == 3
    # float32, not exact (a CPU whose default is float32): the projections in what
    # quantization="auto" holds them in (fp16 where fbgemm runs here, the policy says; the
    # dtype where not), the cache in what kv_cache_dtype="auto" holds it in (float16 where
    # F16C runs); exact: the dtype.
    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: False)
    cpu = torch.device("cpu")
    reduced = auto_quantization(dtype=torch.float32, device=cpu, exact=False)
    cache = auto_kv_cache_dtype(dtype=torch.float32, device=cpu, exact=False)
    float32 = attrs.evolve(spec, dtype="float32")
    _, cost = prepare_roof(float32, measure=measure)
    assert cost == ModelCost.of(
        TINY,
        dtype="float32",
        quantization=reduced,
        kv_cache_dtype=str(cache).removeprefix("torch."),
    )
    _, cost = prepare_roof(attrs.evolve(float32, exact=True), measure=measure)
    assert cost == ModelCost.of(TINY, dtype="float32")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing: a model directory needs config\.json"):
        prepare_roof(spec, measure=measure)
    assert len(asked) == 3  # nothing measured when the shape is unknown


def test_the_roof_of_a_gguf_file_computed_as_stored_counts_its_stored_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the engine's defaults compute a Q4_1 file's blocks as stored (here: its
    dequantized copy made too large for the memory; float32 activations, not exact), the
    roof's weights are the file's bytes; transformers'
    exact arithmetic reads the dequantized float32 weights, and the roof says so."""
    from gguf import GGMLQuantizationType

    from tests.engine.checkpoints.test_blocks import write
    from twostroke.engine.models import plan as plan_module
    from twostroke.engine.models.loading import stored_bytes
    from twostroke.engine.models.source import read_config
    from twostroke.gpu import dtype as dtype_module

    monkeypatch.setattr(plan_module, "available_memory", lambda: 1)
    # dtype="auto" is float32 here, as on a CPU without native bfloat16.
    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: False)

    file = write(tmp_path, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)

    def measure(**options: object) -> MachineRoof:
        return MachineRoof(bandwidth=1e9, flops=1e9, dtype="float32", threads=1)

    config = read_config(file)
    spec = ModelSpec(name="tiny", source=file, dtype="float32", threads=1)
    _, cost = prepare_roof(spec, measure=measure)
    cache = auto_kv_cache_dtype(dtype=torch.float32, device=torch.device("cpu"), exact=False)
    assert cost == ModelCost.of(
        config,
        dtype="float32",
        stored=stored_bytes(file),
        kv_cache_dtype=str(cache).removeprefix("torch."),
    )
    dense = ModelCost.of(config, dtype="float32")
    assert cost.weight_bytes < dense.weight_bytes / 4  # Q4_1's 0.625 bytes a weight
    _, exact = prepare_roof(attrs.evolve(spec, exact=True), measure=measure)
    assert exact == dense


def test_the_kv_cache_costs_its_positions_at_its_dtype() -> None:
    full = ModelCost.of(TINY, dtype="float32")
    half = ModelCost.of(TINY, dtype="float32", kv_cache_dtype="float16")
    assert half.kv_bytes_per_token * 2 == full.kv_bytes_per_token
    assert attrs.evolve(half, kv_bytes_per_token=full.kv_bytes_per_token) == full
    assert ModelCost.of(TINY, dtype="bfloat16") == ModelCost.of(
        TINY, dtype="bfloat16", kv_cache_dtype="bfloat16"
    )
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*, got 'int8'"):
        ModelCost.of(TINY, kv_cache_dtype="int8")


def test_each_system_is_costed_with_the_weights_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GGUF file (Q4_1 projections, Q8_0 embedding): twostroke's rows by their plans
    (the defaults dequantize it; gguf_f32 computes its blocks as stored), llama.cpp and
    OpenVINO GenAI by the file's stored bytes (their caches float16 and 8 bits), vLLM by the
    dense bfloat16 weights; an HTTP endpoint's weights are not known, so it gets the roof of
    the run's smallest weights."""
    from gguf import GGMLQuantizationType

    from tests.engine.checkpoints.test_blocks import write
    from twostroke.engine.bench.http_peer import EndpointDriver
    from twostroke.engine.bench.llamacpp_peer import LlamaCppDriver
    from twostroke.engine.bench.openvino_peer import OpenVinoDriver
    from twostroke.engine.bench.roof import plan_cost, system_weights
    from twostroke.engine.bench.twostroke_driver import TwostrokeDriver
    from twostroke.engine.bench.vllm_peer import VLLMDriver
    from twostroke.engine.models.loading import stored_bytes
    from twostroke.engine.models.source import read_config
    from twostroke.gpu import dtype as dtype_module

    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: False)
    file = write(tmp_path, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
    config, stored = read_config(file), stored_bytes(file)
    spec = ModelSpec(name=str(file), source=file, dtype="bfloat16", threads=1, work_dir=tmp_path)
    plain, blocks = TwostrokeDriver(2), TwostrokeDriver(2, quantization="gguf_f32")
    drivers = [
        plain,
        blocks,
        LlamaCppDriver(None),
        OpenVinoDriver(None),
        VLLMDriver(None),
        EndpointDriver(name="served", base_url="http://127.0.0.1:1/v1"),
    ]
    weights = system_weights(drivers, spec)
    assert list(weights) == [
        "twostroke-depth2",
        "twostroke-depth2-gguf_f32",
        "llama.cpp",
        "openvino-genai",
        "vllm-cpu",
    ]
    cpu = torch.device("cpu")
    assert weights["twostroke-depth2"].cost == plan_cost(plain.plan(spec, cpu), file)
    cache = str(blocks.plan(spec, cpu).cache_dtype).removeprefix("torch.")
    assert weights["twostroke-depth2-gguf_f32"].cost == ModelCost.of(
        config, stored=stored, kv_cache_dtype=cache
    )
    assert weights["llama.cpp"].cost == ModelCost.of(
        config, stored=stored, kv_cache_dtype="float16"
    )
    assert weights["llama.cpp"].description == "the GGUF file as stored, float16 KV"
    assert weights["openvino-genai"].cost == ModelCost.of(
        config, stored=stored, kv_cache_dtype="uint8"
    )
    assert weights["vllm-cpu"].cost == ModelCost.of(config, dtype="bfloat16")
    assert weights["vllm-cpu"].description == "dense bfloat16 weights"

    # A memory-bound machine: each roof is its own weights' floor.
    machine = MachineRoof(bandwidth=1e6, flops=1e15, dtype="float32", threads=1)
    roof = roof_of_run(machine, COST, WORKLOAD, weights=weights)
    plans = simulated_plans(WORKLOAD)
    for name, system in weights.items():
        own = workload_roof(
            machine,
            system.cost,
            plans,
            schedule=roof.schedule,
            output_tokens=4,
            weights=system.description,
        )
        assert roof.of_system(name) == own
        assert roof.fraction(own.output_throughput / 2, name) == pytest.approx(0.5)
    # The smallest weights and cache (OpenVINO's) are the fallback of a system not known.
    assert roof.floor_seconds == roof.of_system("openvino-genai").floor_seconds
    assert roof.of_system("served") is roof
    assert roof.of_system("vllm-cpu").floor_seconds > 2 * roof.floor_seconds
    assert roof.weights == "the run's smallest weights (the GGUF file as stored, uint8 KV)"
    lines = roof.summary().splitlines()
    assert lines[0].endswith(
        "reading the run's smallest weights (the GGUF file as stored, uint8 KV)"
    )
    assert any(
        line.startswith("roof of vllm-cpu: floor ") and line.endswith("dense bfloat16 weights")
        for line in lines
    )
    assert lines[-1] == "(a system not named above: the roof of the run's smallest weights)"
    document = json.loads(json.dumps(roof.to_json()))
    assert document["systems"]["llama.cpp"]["weights"] == "the GGUF file as stored, float16 KV"


def test_a_system_faster_than_its_roof_is_marked_not_given_a_fraction(tmp_path: Path) -> None:
    """A roof of 12 tok/s (a probe that read low): twostroke's 18 tok/s is no 150 % of it."""
    from tests.engine.bench.test_report import _console, _result, _roof, _run
    from twostroke.engine.bench.report import write_report

    roof = _roof(0.5)
    assert roof.percent(6.0) == "50"
    assert not roof.exceeded(12.0)
    assert roof.percent(18.0) == ">100 (roof too low)"
    assert roof.exceeded(18.0)
    run = attrs.evolve(
        _run(tmp_path, _result("twostroke-depth2", 1 / 3), _result("hf-static", 2.0)),
        roof=roof,
    )
    console, out = _console()
    files = write_report(run, tmp_path / "out", console=console)
    text = out.getvalue()
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 3}
    assert [c.strip() for c in rows["twostroke-depth2"].split("│")][4:7] == [
        "18.0",
        "1.00",
        ">100 (roof too low)",
    ]
    assert [c.strip() for c in rows["hf-static"].split("│")][6] == "25"
    assert "roof: twostroke-depth2 ran faster than its roof, which no run can" in text
    systems = {s["name"]: s for s in json.loads(files.json.read_text())["systems"]}
    assert systems["twostroke-depth2"]["over_roof"] is True
    assert systems["hf-static"]["over_roof"] is False
