"""Workloads: fixed by their seed, lengths in range, prompts cut from real text, arrivals."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.engine.bench.schemas import bench_schema
from twostroke.engine.bench.workload import (
    CORPUS,
    BenchRequest,
    Workload,
    offline_workload,
    serving_workload,
    with_json_schemas,
    with_tools,
    without_json_schemas,
    without_tools,
)


def encode(text: str) -> list[int]:
    """A deterministic word-level stand-in for a tokenizer."""
    return [sum(map(ord, word)) % 5000 for word in text.split()]


def test_same_seed_same_workload_other_seed_other_workload() -> None:
    first = offline_workload(encode, n=32, seed=7)
    again = offline_workload(encode, n=32, seed=7)
    other = offline_workload(encode, n=32, seed=8)
    assert first == again
    assert first.requests != other.requests
    assert first.arrival_times is None
    assert first.is_offline
    assert first.description == (
        "offline: 32 requests at once, prompts 16-512 tokens, outputs 16-256 tokens, seed 7"
    )


@given(
    seed=st.integers(0, 2**32),
    n=st.integers(1, 40),
    prompt=st.tuples(st.integers(1, 600), st.integers(0, 600)),
    output=st.tuples(st.integers(1, 300), st.integers(0, 300)),
)
def test_lengths_in_range_and_prompts_are_windows_of_the_text(
    seed: int, n: int, prompt: tuple[int, int], output: tuple[int, int]
) -> None:
    prompt_len = (prompt[0], prompt[0] + prompt[1])
    output_len = (output[0], output[0] + output[1])
    workload = offline_workload(
        encode, n=n, prompt_len=prompt_len, output_len=output_len, seed=seed
    )
    base = encode(CORPUS)
    stream = base * (prompt_len[1] // len(base) + 2)
    assert len(workload.requests) == n
    for request in workload.requests:
        assert prompt_len[0] <= len(request.prompt_token_ids) <= prompt_len[1]
        assert output_len[0] <= request.max_tokens <= output_len[1]
        ids = list(request.prompt_token_ids)
        # Some offset of the repeated text starts this window.
        assert any(stream[o : o + len(ids)] == ids for o in range(len(base)))


def test_prompts_start_at_distinct_offsets() -> None:
    workload = offline_workload(encode, n=64, prompt_len=(40, 40), seed=3)
    prompts = {request.prompt_token_ids for request in workload.requests}
    assert len(prompts) == 64


def test_serving_arrivals_poisson_mean_and_burstiness() -> None:
    poisson = serving_workload(encode, rate=4.0, n=4000, prompt_len=(1, 2), seed=1)
    times = poisson.arrival_times
    assert times is not None
    assert times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0
    # Mean gap 1/rate; an exponential's coefficient of variation is 1.
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.08)
    bursty = serving_workload(encode, rate=4.0, burstiness=0.25, n=4000, prompt_len=(1, 2))
    assert bursty.arrival_times is not None
    bursty_gaps = [b - a for a, b in itertools.pairwise(bursty.arrival_times)]
    assert statistics.fmean(bursty_gaps) == pytest.approx(0.25, rel=0.12)
    # Gamma shape k: coefficient of variation 1/sqrt(k) = 2.
    cv = statistics.stdev(bursty_gaps) / statistics.fmean(bursty_gaps)
    assert cv == pytest.approx(2.0, rel=0.12)
    assert "Poisson" in poisson.description
    assert "gamma shape 0.25" in bursty.description


def test_serving_prompts_equal_offline_prompts() -> None:
    offline = offline_workload(encode, n=16, seed=5)
    serving = serving_workload(encode, rate=2.0, n=16, seed=5)
    assert serving.requests == offline.requests
    assert serving.arrival_times == serving_workload(encode, rate=2.0, n=16, seed=5).arrival_times
    assert serving.arrival(3) == serving.arrival_times[3]  # type: ignore[index]
    assert offline.arrival(3) == 0.0


def test_totals() -> None:
    workload = Workload(
        requests=(BenchRequest((1, 2, 3), 4), BenchRequest((5,), 6)),
        arrival_times=None,
        seed=0,
        description="two",
    )
    assert workload.num_prompt_tokens == 4
    assert workload.num_output_tokens == 10


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: offline_workload(encode, n=0), "n must be an int >= 1, got 0"),
        (
            lambda: offline_workload(encode, prompt_len=(10, 5)),
            r"prompt_len must satisfy 1 <= low <= high, got \(10, 5\)",
        ),
        (
            lambda: offline_workload(encode, output_len=(0, 5)),
            r"output_len must satisfy 1 <= low <= high, got \(0, 5\)",
        ),
        (lambda: offline_workload(encode, text=" "), "the prompt text encodes to no tokens"),
        (
            lambda: serving_workload(encode, rate=0.0),
            "rate must be a finite number of requests per second > 0, got 0.0",
        ),
        (
            lambda: serving_workload(encode, rate=math.inf),
            "rate must be a finite number of requests per second > 0, got inf",
        ),
        (
            lambda: serving_workload(encode, rate=1.0, burstiness=-1.0),
            "burstiness must be a finite gamma shape > 0, got -1.0",
        ),
        (lambda: BenchRequest((), 3), "prompt_token_ids must hold at least one token, got none"),
        (lambda: BenchRequest((1, -2), 3), "prompt_token_ids must be ids >= 0, got -2"),
        (lambda: BenchRequest((1,), 0), "max_tokens must be >= 1, got 0"),
        (
            lambda: Workload((), None, 0, ""),
            "a workload must hold at least one request, got none",
        ),
        (
            lambda: Workload((BenchRequest((1,), 1),), (0.0, 1.0), 0, ""),
            r"arrival_times must give one time per request \(1\), got 2",
        ),
        (
            lambda: Workload((BenchRequest((1,), 1),) * 2, (1.0, 0.5), 0, ""),
            "arrival_times must be finite, >= 0 and non-decreasing, got 0.5 after 1.0",
        ),
    ],
)
def test_bad_arguments_name_the_rule_and_the_value(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


def test_shared_prefixes_round_robin_before_each_own_window() -> None:
    plain = offline_workload(encode, n=8, prompt_len=(20, 40), seed=5)
    shared = offline_workload(
        encode, n=8, prompt_len=(20, 40), seed=5, shared_prefix_len=512, num_prefixes=4
    )
    assert (plain.shared_prefix_len, shared.shared_prefix_len) == (0, 512)
    prefixes = [request.prompt_token_ids[:512] for request in shared.requests]
    assert len(set(prefixes)) == 4
    for index, (own, request) in enumerate(zip(plain.requests, shared.requests, strict=True)):
        assert prefixes[index] == prefixes[index % 4]
        assert request.prompt_token_ids[512:] == own.prompt_token_ids  # the same own window
        assert request.max_tokens == own.max_tokens
    assert shared.description == (
        "offline: 8 requests at once, prompts 20-40 tokens after one of 4 shared 512-token "
        "prefixes, outputs 16-256 tokens, seed 5"
    )
    serving = serving_workload(
        encode, rate=2.0, n=8, prompt_len=(20, 40), seed=5, shared_prefix_len=512, num_prefixes=4
    )
    assert serving.requests == shared.requests
    assert "after one of 4 shared 512-token prefixes" in serving.description


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"shared_prefix_len": -1}, ValueError, "shared_prefix_len must be >= 0, got -1"),
        ({"shared_prefix_len": 1.5}, TypeError, "shared_prefix_len must be an int, got float 1.5"),
        (
            {"shared_prefix_len": 8, "num_prefixes": 0},
            ValueError,
            "num_prefixes must be >= 1, got 0",
        ),
    ],
)
def test_bad_sharing_names_the_rule(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{message}$"):
        offline_workload(encode, n=2, **options)  # type: ignore[arg-type]


def test_a_quarter_of_the_requests_carry_the_bench_schema() -> None:
    plain = offline_workload(encode, n=32, output_len=(16, 64), seed=3)
    structured = with_json_schemas(plain, 0.25)
    assert structured.num_constrained == 8
    assert plain.num_constrained == 0
    assert structured.description == f"{plain.description}; 8 of 32 with a JSON schema (25%)"
    for before, after in zip(plain.requests, structured.requests, strict=True):
        assert (before.prompt_token_ids, before.max_tokens) == (
            after.prompt_token_ids,
            after.max_tokens,
        )
        if after.json_schema is not None:
            schema = json.loads(after.json_schema)
            assert schema == bench_schema(after.max_tokens)
            assert schema["properties"]["keywords"]["minItems"] == after.max_tokens
    # The same seed picks the same requests; another seed others.
    assert with_json_schemas(plain, 0.25) == structured
    other = with_json_schemas(offline_workload(encode, n=32, output_len=(16, 64), seed=4), 0.25)
    assert [r.json_schema is None for r in other.requests] != [
        r.json_schema is None for r in structured.requests
    ]
    assert without_json_schemas(structured).requests == plain.requests
    assert without_json_schemas(plain) is plain
    assert with_json_schemas(plain, 0) is plain
    assert with_json_schemas(plain, 1).num_constrained == 32


def test_a_fraction_of_the_requests_offer_tools_on_the_same_prompts() -> None:
    plain = offline_workload(encode, n=32, output_len=(16, 64), seed=3)
    offered = with_tools(plain, 0.5)
    assert (offered.num_with_tools, offered.num_constrained, plain.num_with_tools) == (16, 16, 0)
    assert offered.description == (
        f"{plain.description}; 16 of 32 offer tools, tool_choice auto (50%)"
    )
    assert [(r.prompt_token_ids, r.max_tokens) for r in offered.requests] == [
        (r.prompt_token_ids, r.max_tokens) for r in plain.requests
    ]
    assert with_tools(plain, 0.5) == offered  # the seed picks them
    assert without_tools(offered).requests == plain.requests
    assert without_tools(plain) is plain
    assert with_tools(plain, 0) is plain
    both = with_tools(with_json_schemas(plain, 0.25), 1)  # a schema and tools on one request
    assert (both.num_constrained, both.num_with_tools) == (32, 32)
    assert without_tools(both).requests == with_json_schemas(plain, 0.25).requests
    with pytest.raises(TypeError, match=r"^tools must be a bool, got int 1$"):
        BenchRequest((1,), 1, tools=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("fraction", [-0.1, 1.5, math.nan, "0.25", True])
def test_a_fraction_outside_zero_to_one_is_refused(fraction: object) -> None:
    with pytest.raises(ValueError, match="fraction must be a number in"):
        with_json_schemas(offline_workload(encode, n=4), fraction)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fraction must be a number in"):
        with_tools(offline_workload(encode, n=4), fraction)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("schema", "error", "message"),
    [
        (7, TypeError, "json_schema must be JSON text or None, got int"),
        ("{", ValueError, "json_schema must be JSON text, got '{'"),
        ("[1]", ValueError, "json_schema must be a JSON object, got list"),
    ],
)
def test_a_request_refuses_a_schema_that_is_not_a_json_object(
    schema: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        BenchRequest((1,), 1, json_schema=schema)  # type: ignore[arg-type]


def test_the_bench_schema_needs_at_least_one_keyword() -> None:
    with pytest.raises(ValueError, match="min_items must be"):
        bench_schema(0)
