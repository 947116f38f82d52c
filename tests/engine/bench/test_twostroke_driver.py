"""twostroke's own bench systems on the real model (slow: loads SmolLM2 from its GGUF)."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import torch

from twostroke.engine.bench import twostroke_driver
from twostroke.engine.bench.metrics import metrics
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.twostroke_driver import TwostrokeDriver, engine_drivers
from twostroke.engine.bench.workload import BenchRequest, Workload, with_json_schemas
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.gpu.device import Device
from twostroke.states.plan import StepPlan


@pytest.mark.slow
def test_the_engine_systems_warm_up_once_and_the_bare_loop_replays_their_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(twostroke_driver, "_WARMED", set())
    model = ModelSpec.resolve("smollm2", work_dir=tmp_path, dtype="float32", threads=1)
    workload = Workload(
        requests=(BenchRequest(range(100, 112), 4), BenchRequest(range(200, 205), 3)),
        arrival_times=None,
        seed=0,
        description="two tiny requests",
    )
    drivers = engine_drivers(max_num_seqs=4, compare_attention=True)
    assert [driver.name for driver in drivers][3:] == ["twostroke-depth2-bag"]
    allocated_on: list[threading.Thread] = []
    allocate = TorchModelRunner.allocate_kv_cache

    def recorded(runner: TorchModelRunner, *args: Any, **kwargs: Any) -> None:
        allocated_on.append(threading.current_thread())
        allocate(runner, *args, **kwargs)

    monkeypatch.setattr(TorchModelRunner, "allocate_kv_cache", recorded)
    results = [driver.run(workload, model=model) for driver in drivers]
    # Every system zeroes its cache off the main thread (the engines on their device's
    # thread, the bare loop on its forward thread), so the process keeps one OpenMP team.
    assert len(allocated_on) == len(drivers) + 1  # and the untimed warm-up's engine
    assert threading.main_thread() not in allocated_on
    for result in results:
        assert result.available, result.reason
        assert [t.output_tokens for t in result.timings] == [4, 3]
        assert metrics(result).output_tokens == 7
    first, _, second, bag = results
    # --compare-attention: the runner's own choice (the compiled kernel here) and its fallback.
    assert (first.extra["attention"], bag.extra["attention"]) == ("native", "bag")
    # dtype="float32" asks for transformers' arithmetic: the projections stay F.linear's.
    assert first.extra["projections"] == "dense"
    # The first engine system of the process ran the warm-up pass, untimed; the next did not.
    assert first.extra["warmup_s"] > 0
    assert second.extra["warmup_s"] == 0
    # The bare loop replayed exactly the depth-2 run's steps (the warm-up's are not recorded).
    assert results[1].extra["steps"] == first.extra["steps"]


def test_the_engine_systems_run_on_the_device_they_are_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not always the CPU: ``twostroke bench --device cuda`` must measure the GPU."""
    made: list[str] = []
    real_select = twostroke_driver.select_device

    def select(kind: str) -> Device:
        made.append(kind)
        return real_select("fake" if kind == "cuda" else kind)

    monkeypatch.setattr(twostroke_driver, "select_device", select)
    depth2, bare, depth1 = engine_drivers(max_num_seqs=4, device="cuda")
    assert (depth2.device, depth1.device, bare.source) == ("cuda", "cuda", depth2)
    workload = Workload(
        requests=(BenchRequest(range(100, 112), 4), BenchRequest(range(200, 205), 3)),
        arrival_times=None,
        seed=0,
        description="two tiny requests",
    )
    runner = ToyRunner(eos_rate=0)
    plans: list[StepPlan] = []
    serve = functools.partial(depth2._serve, plans=plans)
    timings, _, stats, _ = anyio.run(
        serve, workload, runner, ByteTokenizer(), time.perf_counter(), [-1, -1]
    )
    assert made == ["cuda"]
    assert [t.output_tokens for t in timings] == [4, 3]
    assert stats.num_steps == len(plans)
    assert engine_drivers()[0].device == "cpu"  # the peers run on the CPU: so does the default


def test_each_weight_precision_is_a_depth_2_row_of_its_own() -> None:
    drivers = engine_drivers(quantizations=("fp16", "int8"), max_num_seqs=8)
    assert [driver.name for driver in drivers] == [
        "twostroke-depth2",
        "bare-forward",
        "twostroke-depth1",
        "twostroke-depth2-fp16",
        "twostroke-depth2-int8",
    ]
    assert [getattr(d, "engine_options", {}).get("quantization") for d in drivers[3:]] == [
        "fp16",
        "int8",
    ]
    assert drivers[0].engine_options == {"max_num_seqs": 8}  # as given: no quantization


@pytest.mark.parametrize(
    ("dtype", "quantization", "computed"),
    [("auto", "q8_0", "float32"), ("auto", "fp16", "bfloat16"), ("bfloat16", "q8_0", None)],
)
def test_a_rows_model_is_the_engines_plan(
    dtype: str,
    quantization: str,
    computed: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bench asks the engine's plan (resolve_run), not a prediction of it: dtype="auto"
    with blocks computes in float32, their activations', also where the run's dtype is
    bfloat16; an explicit dtype is passed on, and refused there."""
    from tests.engine.models.test_llama import make_tiny_model
    from twostroke.engine.kernels.gguf_blocks import block_kernel
    from twostroke.gpu import dtype as dtype_module

    if block_kernel() is None:
        pytest.skip("the block products do not build here")
    monkeypatch.setattr(dtype_module, "_cpu_has_fast_bf16", lambda: True)
    make_tiny_model("llama", tmp_path, seed=5)
    # The row's model by the name it was asked as (a synthetic one's is no path): the plan
    # reads its resolved source.
    model = ModelSpec(
        name="synthetic:tiny", source=tmp_path, dtype="bfloat16", exact=dtype != "auto"
    )
    [driver] = engine_drivers(quantizations=(quantization,))[3:]
    assert isinstance(driver, TwostrokeDriver)
    if computed is None:
        with pytest.raises(ValueError, match="float32 activations; got dtype bfloat16"):
            driver.plan(model, torch.device("cpu"))
        return
    plan = driver.plan(model, torch.device("cpu"))
    assert str(plan.dtype) == f"torch.{computed}"


def test_a_structured_workload_runs_and_its_steps_are_recorded() -> None:
    """The depth-2 system's engine applies the masks of its constrained requests, and the
    steps it launched are recorded for the bare forward's replay."""
    depth2 = engine_drivers(max_num_seqs=4)[0]
    workload = with_json_schemas(
        Workload(
            requests=(BenchRequest(range(100, 112), 6), BenchRequest(range(200, 205), 5)),
            arrival_times=None,
            seed=0,
            description="two tiny requests",
        ),
        0.5,
    )
    runner = ToyRunner(eos_rate=0)
    plans: list[StepPlan] = []
    serve = functools.partial(depth2._serve, plans=plans)
    timings, _, stats, _ = anyio.run(
        serve, workload, runner, ByteTokenizer(), time.perf_counter(), [-1, -1]
    )
    assert [t.output_tokens for t in timings] == [6, 5]
    (constrained,) = [r for r in workload.requests if r.json_schema is not None]
    assert stats.num_masked_rows == constrained.max_tokens
    assert stats.num_steps == len(plans)
    assert twostroke_driver._mask_figures(stats)["masked_tokens"] == constrained.max_tokens


def test_the_governed_row_leaves_the_thread_count_to_the_engine() -> None:
    """``--compare-governed``: one more depth-2 row, whose engine gets ``torch_threads=None``
    (its ThreadGovernor) where every other row gets the bench's fixed count."""
    drivers = engine_drivers(compare_governed=True, max_num_seqs=4)
    assert [driver.name for driver in drivers] == [
        "twostroke-depth2",
        "bare-forward",
        "twostroke-depth1",
        "twostroke-depth2-governed",
    ]
    fixed, governed = drivers[0], drivers[3]
    assert (fixed.governed, governed.governed) == (False, True)
    workload = Workload(
        requests=(BenchRequest(range(100, 112), 4),), arrival_times=None, seed=0, description="1"
    )
    model = ModelSpec(name="tiny", source=Path("m"), threads=2)
    for driver, governor in ((fixed, False), (governed, True)):
        runner = ToyRunner(eos_rate=0)
        _, _, stats, _ = anyio.run(
            driver._serve, workload, runner, ByteTokenizer(), time.perf_counter(), [-1]
        )
        described = driver._threads_described(model, stats)
        if governor:
            assert described == (
                f"governed: {stats.torch_threads} torch at the end, "
                f"{stats.num_torch_thread_changes} changes + 1 event loop"
            )
            assert stats.torch_threads >= 1
        else:
            assert described == "2 torch + 1 event loop"
            assert stats.num_torch_thread_changes == 0


def test_a_recorded_model_is_released_once_no_replay_of_it_is_pending() -> None:
    """The depth-2 run keeps its model for the bare loop's replay, and only while that replay
    is still to run; its plans stay for the roof."""
    depth2, depth1 = TwostrokeDriver(2), TwostrokeDriver(1)
    bare = twostroke_driver.BareForwardDriver(depth2)
    model = cast(twostroke_driver.LoadedModel, object())
    for driver in (depth2, depth1):
        driver.recording = twostroke_driver._Recording(
            loaded=model,
            plans=[],
            num_blocks=1,
            num_windowed_blocks=0,
            block_size=16,
            request_ids=[],
        )
    peer = object()
    # depth 2 and 1 ran, the replay of depth 2 is pending: depth 1's model goes.
    assert twostroke_driver.release_unneeded([depth2, depth1], [bare, peer]) == 1
    assert depth1.recording is not None
    assert depth1.recording.loaded is None
    assert depth2.recording is not None
    assert depth2.recording.loaded is model
    assert bare.check() is None
    # The replay ran: nothing pending replays depth 2, so its model goes, its plans stay.
    assert twostroke_driver.release_unneeded([depth2, depth1, bare], [peer]) == 1
    assert depth2.recording.loaded is None
    assert depth2.recording.plans == []
    assert twostroke_driver.release_unneeded([depth2, depth1, bare], [peer]) == 0
    assert bare.check() == "twostroke-depth2's model was released before this system ran"
