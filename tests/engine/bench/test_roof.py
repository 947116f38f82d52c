"""The roof: schedules, floors and fractions from given rates; the measurement on a fake clock."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import attrs
import pytest
import torch

from tests.engine.bench.test_cost import TINY
from twostroke.engine.bench.cost import ModelCost, RowShape
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.roof import (
    MachineRoof,
    measure_machine,
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


def test_the_measurement_on_a_fake_clock() -> None:
    ticks = itertools.count()

    def clock() -> float:
        return next(ticks) / 1000  # every timed call takes exactly 1 ms

    machine = measure_machine(
        threads=1, seconds=1.0, buffer_bytes=2**20, matmul_sizes=(8, 16), clock=clock
    )
    assert machine.bandwidth == pytest.approx(2**20 / 0.001)
    assert machine.flops == pytest.approx(2 * 16**3 / 0.001)  # the larger size, same time
    assert (machine.dtype, machine.threads) == ("float32", 1)
    assert machine.method.startswith("read: best of ")
    assert "torch.sum passes over 1 MiB of float32" in machine.method
    assert machine.method.endswith("float32 square products of sizes 8, 16")
    assert machine.seconds == pytest.approx(1.0, abs=0.01)  # the budget, spent


def test_a_size_is_skipped_once_the_budget_is_short() -> None:
    ticks = itertools.count()
    machine = measure_machine(
        seconds=0.005,
        buffer_bytes=2**20,
        matmul_sizes=(4, 8),
        clock=lambda: next(ticks) / 1000,
    )
    assert machine.method.endswith("square products of sizes 4")
    assert machine.flops == pytest.approx(2 * 4**3 / 0.001)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "int8"}, "dtype must be one of float32, bfloat16, float16, got 'int8'"),
        ({"threads": 0}, "threads must be an int >= 1, got 0"),
        ({"seconds": 0.0}, "seconds must be a finite number > 0, got 0.0"),
        ({"buffer_bytes": 4096}, r"buffer_bytes must be >= 1 MiB \(1048576\), got 4096"),
        ({"matmul_sizes": ()}, r"matmul_sizes must be sizes >= 1, got \(\)"),
    ],
)
def test_bad_measurement_arguments(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        measure_machine(**options)  # type: ignore[arg-type]


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
    """Where the engine's defaults compute a Q4_1 file's blocks as stored (AUTO_BLOCKS on,
    float32 activations, not exact), the roof's weights are the file's bytes; transformers'
    exact arithmetic reads the dequantized float32 weights, and the roof says so."""
    from gguf import GGMLQuantizationType

    from tests.engine.checkpoints.test_blocks import write
    from twostroke.engine.models import plan as plan_module
    from twostroke.engine.models.loading import stored_bytes
    from twostroke.engine.models.source import read_config
    from twostroke.gpu import dtype as dtype_module

    monkeypatch.setattr(plan_module, "AUTO_BLOCKS", True)
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


def test_machine_rates_are_checked() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        MachineRoof(bandwidth=0.0, flops=1.0, dtype="float32", threads=1)
    with pytest.raises(ValueError, match="dtype"):
        MachineRoof(bandwidth=1.0, flops=1.0, dtype="int8", threads=1)
