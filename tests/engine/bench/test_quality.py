"""Quality beside speed: each system's greedy outputs against the float32 reference."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
from rich.console import Console

from tests.engine.bench.test_runner import FakeDriver, _args, _use_fake_tokenizer
from twostroke.engine.bench.metrics import SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.quality import (
    Agreement,
    QualityReference,
    agreement,
    compared_requests,
)
from twostroke.engine.bench.runner import bench_command
from twostroke.engine.bench.workload import BenchRequest, Workload


def test_agreement_counts_identical_requests_and_tokens_before_the_first_difference() -> None:
    reference = [(1, 2, 3, 4), (5, 6, 7, 8), (9, 9)]
    outputs = [(0,), (1, 2, 3, 4), (0,), (5, 6, 0, 8), (9,)]  # request 4 stopped early
    found = agreement(outputs, reference, [1, 3, 4])
    assert found == Agreement(num_requests=3, identical=1, tokens_agreeing=4 + 2 + 1, tokens=10)
    assert found.fraction == 0.7
    assert found.cell() == "1/3 (70%)"
    assert found.to_json()["fraction"] == 0.7
    assert agreement(outputs, reference[:1], [1]) == Agreement(1, 1, 4, 4)
    assert agreement((), reference, [1, 3, 4]) is None  # the system reported no tokens
    assert agreement(outputs, reference, [1, 3, 9]) is None  # fewer outputs than requests
    assert agreement(outputs, (), ()) is None


def test_the_compared_requests_are_the_first_plain_ones() -> None:
    schema = json.dumps({"type": "object"})
    requests = [
        BenchRequest((1, 2), 3, json_schema=schema),
        BenchRequest((1, 2), 3),
        BenchRequest((1, 2), 3, tools=True),
        BenchRequest((4,), 2),
        BenchRequest((5,), 2),
    ]
    workload = Workload(tuple(requests), None, 0, "test")
    assert compared_requests(workload, 2) == [1, 3]
    assert compared_requests(workload, 10) == [1, 3, 4]
    with pytest.raises(ValueError, match="one output per compared request: 2 requests, 1"):
        QualityReference([1, 3], [(1,)])


class Echo(FakeDriver):
    """A system whose outputs are each prompt's first token, repeated."""

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        result = super().run(workload, model=model)
        outputs = [(r.prompt_token_ids[0],) * r.max_tokens for r in workload.requests]
        return attrs.evolve(result, output_token_ids=outputs)


def test_the_bench_puts_each_systems_agreement_beside_its_speed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_fake_tokenizer(monkeypatch)
    asked: list[Sequence[BenchRequest]] = []

    def reference(
        model: ModelSpec, requests: Sequence[BenchRequest]
    ) -> tuple[tuple[int, ...], ...]:
        asked.append(requests)
        # The first request as the echo computes it; the others differ at their last token.
        return tuple(
            (r.prompt_token_ids[0],) * (r.max_tokens - (i > 0)) + ((0,) if i else ())
            for i, r in enumerate(requests)
        )

    shape = ("--num-requests", "5", "--prompt-len", "4", "8", "--output-len", "2", "3")
    args = _args(tmp_path, *shape, "--systems", "echo,silent", "--no-roof")
    out = io.StringIO()
    engines = [Echo("echo"), FakeDriver("silent")]
    status = bench_command(
        args,
        engine_drivers=engines,
        console=Console(file=out, width=250),
        compute_reference=reference,
    )
    assert status == 0
    (requests,) = asked
    assert len(requests) == 4  # --quality-requests' default
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["quality_reference"]["requests"] == [0, 1, 2, 3]
    echo, silent = document["systems"]
    tokens = sum(r.max_tokens for r in requests)
    assert echo["quality"] == {
        "num_requests": 4,
        "identical": 1,
        "tokens_agreeing": tokens - 3,
        "tokens": tokens,
        "fraction": (tokens - 3) / tokens,
    }
    assert silent["quality"] is None  # it reports no tokens
    text = out.getvalue()
    assert "greedy = ref" in text
    assert f"1/4 ({100 * (tokens - 3) / tokens:.0f}%)" in text
    # Off: no reference generated, no column.
    asked.clear()
    args = _args(tmp_path, *shape, "--systems", "echo", "--no-roof", "--quality-requests", "0")
    out = io.StringIO()
    bench_command(
        args, engine_drivers=[Echo("echo")], console=Console(file=out), compute_reference=reference
    )
    assert not asked
    assert "greedy = ref" not in out.getvalue()


def test_a_model_the_reference_cannot_load_leaves_the_column_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the roof does: the run reports, and says why there is no quality column."""
    _use_fake_tokenizer(monkeypatch)
    args = _args(tmp_path, "--num-requests", "2", "--systems", "echo", "--no-roof")
    out = io.StringIO()
    console = Console(file=out, width=250)
    assert bench_command(args, engine_drivers=[Echo("echo")], console=console) == 0
    assert "quality: not computed: " in out.getvalue()
    assert "config.json: missing" in out.getvalue()
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["quality_reference"] is None


def test_quality_requests_is_a_count() -> None:
    with pytest.raises(SystemExit):
        _args(Path("."), "--quality-requests", "-1")
