"""SamplingParams: every validator, with its message pinned."""

from __future__ import annotations

import math
import re
from typing import Any

import attrs
import pytest
from hypothesis import given

from twostroke.states.params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    check_params,
)
from twostroke.states.testing import sampling_params


def test_defaults_are_valid_and_follow_vllm() -> None:
    params = SamplingParams()
    assert (params.max_tokens, params.min_tokens, params.temperature) == (16, 0, 1.0)
    assert (params.top_k, params.top_p, params.min_p, params.seed) == (None, 1.0, 0.0, None)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == ((), (), False)
    assert not params.greedy
    assert not params.uses_penalties


OUT_OF_RANGE = [
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("max_tokens", -5, "max_tokens must be >= 1, got -5"),
    ("min_tokens", -1, "min_tokens must be >= 0, got -1"),
    ("temperature", -0.5, "temperature must be >= 0, got -0.5"),
    ("temperature", math.inf, "temperature must be finite, got inf"),
    ("temperature", math.nan, "temperature must be finite, got nan"),
    ("top_k", 0, "top_k must be >= 1 (or None to disable), got 0"),
    ("top_k", -1, "top_k must be >= 1 (or None to disable), got -1"),
    ("top_p", 0, "top_p must be in (0, 1], got 0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_p", -math.inf, "top_p must be finite, got -inf"),
    ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
    ("min_p", 1.01, "min_p must be in [0, 1], got 1.01"),
    ("seed", -1, "seed must be in [0, 2**63), got -1"),
    ("seed", 2**63, f"seed must be in [0, 2**63), got {2**63}"),
    ("stop", ("ok", ""), "stop strings must be non-empty, got ''"),
    ("stop", "", "stop strings must be non-empty, got ''"),
    ("stop_token_ids", (3, -1), "stop_token_ids must be >= 0, got -1"),
    # Issue 20: one 20,000-character stop string cost the server 774 MiB (n=4).
    ("stop", ["x"] * 17, "stop must hold <= 16 strings, got 17"),
    ("stop", "x" * 257, "stop strings must be <= 256 characters long, got one of 257"),
    ("stop", ["ok", "x" * 20_000], "stop strings must be <= 256 characters long, got one of 20000"),
    ("stop_token_ids", range(129), "stop_token_ids must hold <= 128 ids, got 129"),
    ("repetition_penalty", 0, "repetition_penalty must be > 0 (1 disables it), got 0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0 (1 disables it), got -1.0"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("presence_penalty", -3, "presence_penalty must be in [-2, 2], got -3"),
    ("frequency_penalty", 2.01, "frequency_penalty must be in [-2, 2], got 2.01"),
    ("frequency_penalty", math.nan, "frequency_penalty must be finite, got nan"),
    ("logprobs", -1, f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got -1"),
    ("logprobs", MAX_LOGPROBS + 1, f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got 21"),
]


@pytest.mark.parametrize(("field", "value", "message"), OUT_OF_RANGE)
def test_out_of_range_values_raise_value_error_naming_field_rule_and_value(
    field: str, value: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SamplingParams(**{field: value})


WRONG_TYPES = [
    ("max_tokens", 1.0, "max_tokens must be an int, got float 1.0"),
    ("max_tokens", True, "max_tokens must be an int, got bool True"),
    ("max_tokens", "16", "max_tokens must be an int, got str '16'"),
    ("min_tokens", None, "min_tokens must be an int, got NoneType None"),
    ("temperature", "hot", "temperature must be a number, got str 'hot'"),
    ("temperature", False, "temperature must be a number, got bool False"),
    ("top_k", 2.0, "top_k must be an int, got float 2.0"),
    ("top_p", None, "top_p must be a number, got NoneType None"),
    ("min_p", [0.1], "min_p must be a number, got list [0.1]"),
    ("seed", 1.5, "seed must be an int, got float 1.5"),
    ("stop", 5, "stop must be a string or a sequence of strings, got 5"),
    ("stop", None, "stop must be a string or a sequence of strings, got None"),
    ("stop", ["a", 1], "stop must contain only strings, got int 1"),
    ("stop_token_ids", "12", "stop_token_ids must be a sequence of ints, got '12'"),
    ("stop_token_ids", b"\x01", "stop_token_ids must be a sequence of ints, got b'\\x01'"),
    ("stop_token_ids", 7, "stop_token_ids must be a sequence of ints, got 7"),
    ("stop_token_ids", [1, 2.0], "stop_token_ids must be an int, got float 2.0"),
    ("stop_token_ids", [False], "stop_token_ids must be an int, got bool False"),
    ("ignore_eos", 1, "ignore_eos must be a bool, got int 1"),
    ("repetition_penalty", "1", "repetition_penalty must be a number, got str '1'"),
    ("presence_penalty", None, "presence_penalty must be a number, got NoneType None"),
    ("frequency_penalty", True, "frequency_penalty must be a number, got bool True"),
    ("logprobs", 1.0, "logprobs must be an int, got float 1.0"),
    (
        "include_stop_str_in_output",
        "yes",
        "include_stop_str_in_output must be a bool, got str 'yes'",
    ),
]


@pytest.mark.parametrize(("field", "value", "message"), WRONG_TYPES)
def test_wrong_types_raise_type_error(field: str, value: Any, message: str) -> None:
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        SamplingParams(**{field: value})


def test_min_tokens_may_not_exceed_max_tokens() -> None:
    message = "min_tokens must be <= max_tokens, got min_tokens=5 and max_tokens=4"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_max_tokens_none_leaves_the_number_to_the_context() -> None:
    params = SamplingParams(max_tokens=None, min_tokens=100)  # no number to compare with
    assert (params.max_tokens, params.min_tokens) == (None, 100)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 1),
        ("temperature", 0),
        ("top_k", 1),
        ("top_p", 1),
        ("top_p", 1e-9),
        ("min_p", 0),
        ("min_p", 1),
        ("seed", 0),
        ("seed", 2**63 - 1),
        ("repetition_penalty", 1e-6),
        ("presence_penalty", -2),
        ("frequency_penalty", 2),
        ("logprobs", 0),
        ("logprobs", MAX_LOGPROBS),
        ("stop", ("x",) * MAX_STOP_STRINGS),
        ("stop", ("x" * MAX_STOP_STRING_LENGTH,)),
        ("stop_token_ids", tuple(range(MAX_STOP_TOKEN_IDS))),
    ],
)
def test_boundary_values_are_accepted(field: str, value: Any) -> None:
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_stop_and_stop_token_ids_are_normalized_to_tuples() -> None:
    params = SamplingParams(stop="###", stop_token_ids=[2, 3])
    assert params.stop == ("###",)
    assert params.stop_token_ids == (2, 3)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_greedy_and_penalties() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties
    assert SamplingParams(frequency_penalty=0.5).uses_penalties


def test_params_are_frozen_and_evolve_revalidates() -> None:
    params = SamplingParams()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        params.max_tokens = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 1, got 0$"):
        attrs.evolve(params, max_tokens=0)


@given(sampling_params())
def test_the_strategy_draws_only_valid_params(params: SamplingParams) -> None:
    # Rebuilding from the fields runs every validator again.
    assert SamplingParams(**attrs.asdict(params, recurse=False)) == params
    assert 0 <= params.min_tokens <= params.max_tokens


def test_a_submit_without_parameters_gets_the_one_default_and_a_wrong_type_is_refused() -> None:
    """What every surface's ``submit`` asks first (the engine's and the coordinator's)."""
    assert check_params(None) is check_params(None) == SamplingParams()
    chosen = SamplingParams(max_tokens=3)
    assert check_params(chosen) is chosen
    with pytest.raises(TypeError, match=r"^params must be SamplingParams, got dict$"):
        check_params({"max_tokens": 3})  # type: ignore[arg-type]
