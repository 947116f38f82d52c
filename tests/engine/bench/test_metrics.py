"""Metric definitions (vLLM's), on hand-made timings with the figures worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.engine.bench.metrics import (
    RequestTiming,
    SystemResult,
    metrics,
    percentile,
)

# Three requests over a 4-second run:
#   A arrives at 0.0; chunks at 1.0, 1.5, 2.0, 3.0, one token each (4 tokens).
#   B arrives at 0.5; one chunk at 2.5 holding its only token.
#   C arrives at 1.0; chunks at 1.5 (1 token) and 2.5 (2 tokens): 3 tokens.
A = RequestTiming(10, 4, 0.0, 1.0, 3.0, (1.0, 1.5, 2.0, 3.0))
B = RequestTiming(20, 1, 0.5, 2.5, 2.5, (2.5,))
C = RequestTiming(30, 3, 1.0, 1.5, 2.5, (1.5, 2.5))
RESULT = SystemResult(name="hand", available=True, wall_seconds=4.0, timings=(A, B, C))


def test_throughputs() -> None:
    figures = metrics(RESULT)
    assert figures.completed == 3
    assert figures.output_tokens == 8
    assert figures.prompt_tokens == 60
    assert figures.output_throughput == 8 / 4
    assert figures.total_throughput == 68 / 4
    assert figures.request_throughput == 3 / 4
    assert figures.goodput is None


def test_ttft_counts_queueing_from_arrival() -> None:
    # TTFTs 1.0, 2.0, 0.5 -> sorted 0.5, 1.0, 2.0.
    ttft = metrics(RESULT).ttft
    assert ttft is not None
    assert ttft.count == 3
    assert ttft.mean == pytest.approx(3.5 / 3)
    assert ttft.p50 == 1.0
    assert ttft.p90 == pytest.approx(1.8)  # rank 0.9 * 2 = 1.8: 1.0 + 0.8 * (2.0 - 1.0)
    assert ttft.p99 == pytest.approx(1.98)


def test_tpot_excludes_one_token_requests() -> None:
    # A: (3.0 - 1.0) / 3 = 2/3; C: (2.5 - 1.5) / 2 = 0.5; B has one token.
    tpot = metrics(RESULT).tpot
    assert tpot is not None
    assert tpot.count == 2
    assert tpot.mean == pytest.approx((2 / 3 + 0.5) / 2)
    assert tpot.p50 == pytest.approx((2 / 3 + 0.5) / 2)
    assert B.tpot is None


def test_itl_pools_gaps_between_chunks() -> None:
    # A: 0.5, 0.5, 1.0; B: none; C: 1.0 (a two-token chunk is one gap, not two).
    itl = metrics(RESULT).itl
    assert itl is not None
    assert itl.count == 4
    assert itl.mean == pytest.approx(0.75)
    assert itl.p50 == pytest.approx(0.75)  # rank 1.5 between 0.5 and 1.0
    assert itl.p99 == pytest.approx(1.0)


def test_e2e() -> None:
    # 3.0, 2.0, 1.5
    e2e = metrics(RESULT).e2e
    assert e2e is not None
    assert e2e.mean == pytest.approx(6.5 / 3)
    assert e2e.p50 == 2.0


def test_goodput_counts_requests_meeting_every_target() -> None:
    # TTFT <= 1.0 and TPOT <= 0.6: A fails TPOT (0.667), B fails TTFT (2.0), C meets both.
    both = metrics(RESULT, ttft_slo=1.0, tpot_slo=0.6)
    assert both.goodput == pytest.approx(1 / 4)
    # TPOT alone: a one-token request's TPOT counts as 0 (vLLM), so B and C meet it.
    assert metrics(RESULT, tpot_slo=0.6).goodput == pytest.approx(2 / 4)
    assert metrics(RESULT, ttft_slo=2.0).goodput == pytest.approx(3 / 4)


def test_no_streaming_means_no_itl() -> None:
    timing = RequestTiming(5, 4, 0.0, 1.0, 2.0)
    figures = metrics(
        SystemResult(name="batch", available=True, wall_seconds=2.0, timings=[timing])
    )
    assert figures.itl is None
    assert figures.tpot is not None
    assert figures.tpot.mean == pytest.approx(1 / 3)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_is_numpys_linear_percentile(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_json_round_trip() -> None:
    assert RequestTiming.from_json(A.to_json()) == A
    document = RESULT.to_json()
    assert document["timings"][2]["chunk_times"] == [1.5, 2.5]
    assert metrics(RESULT).to_json()["ttft"]["p50"] == 1.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: RequestTiming(1, 0, 0.0, 0.0, 0.0), "output_tokens must be >= 1, got 0"),
        (
            lambda: RequestTiming(1, 1, 1.0, 0.5, 2.0),
            "times must satisfy start <= first_token <= end, got 1.0 <= 0.5 <= 2.0",
        ),
        (
            lambda: RequestTiming(1, 2, 0.0, 1.0, 2.0, (0.9, 1.5)),
            "chunk_times must start at first_token and end by end",
        ),
        (
            lambda: RequestTiming(1, 3, 0.0, 1.0, 2.0, (1.0, 1.8, 1.5)),
            "chunk_times must be non-decreasing",
        ),
        (
            lambda: RequestTiming(1, 1, 0.0, 1.0, 2.0, (1.0, 2.0)),
            r"chunk_times must hold at most output_tokens \(1\) chunks, got 2",
        ),
        (
            lambda: RequestTiming.from_json({"prompt_tokens": 1}),
            "must have the key 'output_tokens'",
        ),
        (
            lambda: SystemResult(name="x", available=False),
            r"an unavailable result must say why \(x\)",
        ),
        (
            lambda: SystemResult(name="x", available=True, reason="why"),
            "an available result has no reason, got 'why'",
        ),
        (
            lambda: metrics(SystemResult.unavailable("x", "not installed")),
            r"x did not run \(not installed\); it has no metrics",
        ),
        (lambda: metrics(RESULT, ttft_slo=0.0), "ttft_slo must be > 0 seconds, got 0.0"),
        (lambda: percentile([], 50), "percentile of no values"),
        (lambda: percentile([1.0], 101), r"q must be in \[0, 100\], got 101"),
    ],
)
def test_bad_values_name_the_rule_and_the_value(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
