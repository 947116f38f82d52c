"""Speculative decoding in the bench: the -spec systems, their figures, and the greedy check."""

from __future__ import annotations

import argparse
import functools
import io
import json
import time
from pathlib import Path

import anyio
import attrs
import pytest
from rich.console import Console

from twostroke.engine.bench.llamacpp_peer import LlamaCppDriver, PromptLookup
from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.record import BenchRun
from twostroke.engine.bench.report import compute_metrics, report_document, write_report
from twostroke.engine.bench.roof import MachineRoof, WorkloadRoof
from twostroke.engine.bench.runner import (
    PEER_NAMES,
    add_bench_arguments,
    bench_command,
    peer_drivers,
)
from twostroke.engine.bench.speculation import compare_speculation, greedy_check, mismatched
from twostroke.engine.bench.twostroke_driver import (
    TwostrokeDriver,
    engine_drivers,
    speculative_drivers,
)
from twostroke.engine.bench.workload import BenchRequest, Workload
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.states.speculation import SpeculativeConfig

WORKLOAD = Workload(
    requests=(BenchRequest((1, 2), 3), BenchRequest((3,), 3)),
    arrival_times=None,
    seed=0,
    description="offline: two requests",
)

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)


def _result(
    name: str, wall: float, outputs: tuple[tuple[int, ...], ...] = (), **extra: object
) -> SystemResult:
    timings = [
        RequestTiming(2, 3, 0.0, wall / 3, wall, (wall / 3, wall)),
        RequestTiming(1, 3, 0.0, wall / 3, wall, (wall / 3, wall)),
    ]
    return SystemResult(
        name=name,
        available=True,
        startup_seconds=1.0,
        wall_seconds=wall,
        timings=timings,
        extra=extra,
        output_token_ids=outputs,
    )


def _spec_extra(baseline: str) -> dict[str, object]:
    return {
        "speculation_off": baseline,
        "spec_decode_drafts": 4,
        "spec_decode_draft_tokens": 16,
        "spec_decode_accepted_tokens": 10,
        "spec_decode_mean_acceptance_length": 3.5,
    }


def _run(tmp_path: Path, *results: SystemResult) -> BenchRun:
    return BenchRun(
        workload=WORKLOAD,
        model=ModelSpec(name="tiny", source=tmp_path, work_dir=tmp_path),
        results=results,
        started_at="2026-12-05T05:00:00+00:00",
        machine={"cpu": "test", "cores": 2},
    )


SAME = ((5, 6, 7), (8, 9, 10))
DIFFERENT = ((5, 6, 7), (8, 9, 1))


def test_the_greedy_check_finds_the_first_difference() -> None:
    base = _result("a", 2.0, SAME)
    assert greedy_check(_result("b", 1.0, SAME), base).identical  # type: ignore[union-attr]
    check = greedy_check(_result("b", 1.0, ((5, 6, 7), (8, 11, 10))), base)
    assert check is not None
    assert (check.differing, check.first_difference) == ((1,), (1, 1, 11, 9))
    assert check.describe() == (
        "GREEDY OUTPUTS DIFFER from a's in 1 of 2 requests (request 1 first at output token 1: "
        "11 against 9)"
    )
    # One output a prefix of the other: they differ where the shorter ends.
    short = greedy_check(_result("b", 1.0, ((5, 6), (8, 9, 10))), base)
    assert short is not None
    assert short.first_difference == (0, 2, None, 7)
    # A system that does not report its tokens is not compared.
    assert greedy_check(_result("b", 1.0), base) is None


def test_each_spec_system_against_itself_without_speculation(tmp_path: Path) -> None:
    run = _run(
        tmp_path,
        _result("twostroke-depth2", 2.0, SAME),
        _result("twostroke-depth1", 3.0, SAME),
        _result("twostroke-depth2-spec", 1.0, SAME, **_spec_extra("twostroke-depth2")),
        _result("twostroke-depth1-spec", 1.5, DIFFERENT, **_spec_extra("twostroke-depth1")),
        _result("llama.cpp-prompt-lookup", 1.0, SAME, speculation_off="llama.cpp"),  # no baseline
    )  # fmt: skip
    figures = compute_metrics(run)
    depth2, depth1 = compare_speculation(run, figures)
    assert (depth2.system, depth2.baseline) == ("twostroke-depth2-spec", "twostroke-depth2")
    assert depth2.tpot_ratio == pytest.approx(0.5)
    assert depth2.throughput_ratio == pytest.approx(2.0)
    assert depth2.mean_acceptance_length == 3.5
    assert not depth2.outputs_differ
    assert depth2.describe() == (
        "twostroke-depth2-spec against twostroke-depth2: TPOT 0.50x, throughput 2.00x; mean "
        "acceptance length 3.50 (10 of 16 draft tokens accepted in 4 drafts); greedy outputs "
        "identical to twostroke-depth2's (2 of 2 requests)"
    )
    assert depth1.outputs_differ
    assert mismatched([depth2, depth1]) == ["twostroke-depth1-spec"]

    console = Console(file=(out := io.StringIO()), width=250, color_system=None)
    files = write_report(run, tmp_path / "out", console=console)
    text = " ".join(out.getvalue().split())  # the lines as printed, unfolded
    assert "accept len (drafts)" in text
    assert "3.50 (4)" in text
    assert depth2.describe() in text
    assert (
        "twostroke-depth1-spec against twostroke-depth1: TPOT 0.50x, throughput 2.00x; mean "
        "acceptance length 3.50 (10 of 16 draft tokens accepted in 4 drafts); GREEDY OUTPUTS "
        "DIFFER from twostroke-depth1's in 1 of 2 requests (request 1 first at output token 2: "
        "1 against 10)"
    ) in text
    assert [c.system for c in files.speculation] == [depth2.system, depth1.system]
    document = json.loads(files.json.read_text())
    assert [entry["system"] for entry in document["speculation"]] == [
        "twostroke-depth2-spec",
        "twostroke-depth1-spec",
    ]
    assert document["speculation"][1]["greedy"] == {
        "baseline": "twostroke-depth1",
        "identical": False,
        "num_requests": 2,
        "differing": [1],
        "first_difference": {"request": 1, "position": 2, "token": 1, "baseline_token": 10},
    }
    by_name = {entry["name"]: entry for entry in document["systems"]}
    assert by_name["twostroke-depth2-spec"]["extra"]["spec_decode_drafts"] == 4


def test_a_speculating_row_may_pass_the_roof_and_the_report_says_why(tmp_path: Path) -> None:
    machine = MachineRoof(bandwidth=16e9, flops=157e9, dtype="float32", threads=2)
    roof = WorkloadRoof(
        machine=machine,
        schedule="the schedule twostroke-depth2 ran",
        steps=4,
        floor_seconds=1.5,
        memory_bound_steps=4,
        bytes=10,
        flops=20,
        output_tokens=6,
    )
    note = (
        "(a speculating row verifies several tokens a step: the roof is the floor of a "
        "schedule without drafts, which it can pass)"
    )
    plain = _result("twostroke-depth2", 2.0, SAME)
    speculating = _result("twostroke-depth2-spec", 1.0, SAME, **_spec_extra("twostroke-depth2"))
    for results, said in (((plain, speculating), True), ((plain,), False)):
        run = attrs.evolve(_run(tmp_path, *results), roof=roof)
        console = Console(file=(out := io.StringIO()), width=250, color_system=None)
        write_report(run, tmp_path / "out", console=console)
        assert (note in " ".join(out.getvalue().split())) == said


def test_without_speculation_the_table_has_no_acceptance_column(tmp_path: Path) -> None:
    run = _run(tmp_path, _result("twostroke-depth2", 2.0, SAME))
    console = Console(file=(out := io.StringIO()), width=250, color_system=None)
    files = write_report(run, tmp_path / "out", console=console)
    assert "accept len" not in out.getvalue()
    assert files.speculation == ()
    assert report_document(run, compute_metrics(run), None)["speculation"] == []


def test_spec_systems_sit_beside_the_plain_ones_at_both_depths() -> None:
    drivers = speculative_drivers(engine_drivers(max_num_seqs=1, compare_attention=True), NGRAM)
    assert [driver.name for driver in drivers] == [
        "twostroke-depth2",
        "bare-forward",
        "twostroke-depth1",
        "twostroke-depth2-spec",
        "twostroke-depth1-spec",
        "twostroke-depth2-bag",
    ]
    depth2, spec = drivers[0], drivers[3]
    assert isinstance(depth2, TwostrokeDriver)
    assert isinstance(spec, TwostrokeDriver)
    assert spec.engine_options == {"max_num_seqs": 1, "speculative_config": NGRAM}
    assert (spec.depth, depth2.speculative_config) == (2, None)
    # A mapping is checked as the engine checks it.
    assert TwostrokeDriver(1, speculative_config={"method": "suffix"}).speculative_config == (
        SpeculativeConfig(method="suffix")
    )
    with pytest.raises(ValueError, match=r"^method must be one of 'ngram', 'suffix', got 'eagle'$"):
        TwostrokeDriver(1, speculative_config={"method": "eagle"})
    # Already speculating, or nothing plain to copy: as given.
    assert [d.name for d in speculative_drivers(drivers[3:], NGRAM)] == [
        d.name for d in drivers[3:]
    ]


def test_on_the_toy_the_spec_row_counts_drafts_and_generates_the_same_tokens() -> None:
    repetitive = tuple(b"the cat sat on the mat and the cat sat on the mat and the cat")
    workload = Workload(
        requests=(BenchRequest(repetitive, 24), BenchRequest(range(97, 110), 12)),
        arrival_times=None,
        seed=0,
        description="two requests",
    )
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    outputs = {}
    plain = TwostrokeDriver(2, max_num_seqs=2)
    for driver in (plain, plain.with_speculation(config)):
        runner = ToyRunner(eos_rate=0)
        produced: list[tuple[int, ...]] = []
        serve = functools.partial(
            driver._serve,
            workload,
            runner,
            ByteTokenizer(),
            time.perf_counter(),
            [-1, -1],
            outputs=produced,
        )
        timings, _, stats, _ = anyio.run(serve)
        assert [t.output_tokens for t in timings] == [24, 12]
        assert [len(tokens) for tokens in produced] == [24, 12]
        outputs[driver.name] = produced
        figures = driver._speculation_figures(stats)
    assert outputs["twostroke-depth2-spec"] == outputs["twostroke-depth2"]
    assert figures["speculation_off"] == "twostroke-depth2"
    assert figures["speculative_config"]["num_speculative_tokens"] == 3
    assert figures["spec_decode_drafts"] > 0
    assert figures["spec_decode_draft_tokens"] >= figures["spec_decode_drafts"]
    assert figures["spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + figures["spec_decode_accepted_tokens"] / figures["spec_decode_drafts"], abs=1e-3
    )
    assert len(figures["spec_decode_accepted_per_pos"]) == 3
    assert TwostrokeDriver(2)._speculation_figures(stats) == {}


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(
        ["--model", str(tmp_path), "--out", str(tmp_path / "out"), "--no-progress", *extra]
    )


def test_the_option_parses_as_the_engine_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args(
        tmp_path, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'
    )
    assert args.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert _args(tmp_path).speculative_config is None
    for text, message in (
        ("{method: ngram}", 'must be a JSON object such as \'{"method": "ngram"}\': '),
        ("null", "must be a JSON object, got null"),
        ('{"method": "ngram", "k": 3}', "speculative_config has no field 'k'; its fields are"),
    ):
        with pytest.raises(SystemExit):
            _args(tmp_path, "--speculative-config", text)
        assert message in capsys.readouterr().err


def test_llama_cpp_runs_its_prompt_lookup_beside_plain_decoding(tmp_path: Path) -> None:
    args = _args(
        tmp_path,
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3}',
    )
    plain, *_, lookup = peer_drivers(args)[3:]
    assert isinstance(lookup, LlamaCppDriver)
    assert (plain.name, lookup.name) == ("llama.cpp", "llama.cpp-prompt-lookup")
    assert lookup.prompt_lookup == PromptLookup(num_pred_tokens=7, max_ngram_size=3)
    assert [driver.name for driver in peer_drivers(_args(tmp_path))] == list(PEER_NAMES)


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


class _Speculating:
    """A system that reports the given output tokens, speculating against ``baseline``."""

    def __init__(
        self, name: str, outputs: tuple[tuple[int, ...], ...], baseline: str | None = None
    ) -> None:
        self.name = name
        self.outputs = outputs
        self.baseline = baseline

    def check(self) -> str | None:
        return None

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        timings = [
            RequestTiming(len(r.prompt_token_ids), r.max_tokens, 0.0, 0.5, 1.0)
            for r in workload.requests
        ]
        extra = {} if self.baseline is None else {"speculation_off": self.baseline}
        return SystemResult(
            name=self.name,
            available=True,
            wall_seconds=1.0,
            timings=timings,
            extra=extra,
            output_token_ids=self.outputs[: len(timings)],
        )


@pytest.mark.parametrize(("spec_outputs", "status"), [(((1, 2),), 0), (((1, 3),), 1)])
def test_different_greedy_outputs_fail_the_bench(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    spec_outputs: tuple[tuple[int, ...], ...],
    status: int,
) -> None:
    from twostroke.engine.text import tokenizer

    monkeypatch.setattr(
        tokenizer.HFTokenizer, "from_pretrained", classmethod(lambda cls, path: _Tokenizer())
    )
    args = _args(
        tmp_path,
        *("--num-requests", "1", "--prompt-len", "4", "4", "--output-len", "2", "2"),
        *("--systems", "plain,plain-spec", "--no-roof"),
    )
    engines = [_Speculating("plain", ((1, 2),)), _Speculating("plain-spec", spec_outputs, "plain")]
    out = io.StringIO()
    console = Console(file=out, width=250, color_system=None)
    assert bench_command(args, engine_drivers=engines, console=console) == status
    assert ("GREEDY OUTPUTS DIFFER from plain's" in out.getvalue()) == bool(status)
