"""Sampling parameters: what a caller asks of one request, validated at construction.

Every rule is enforced by a validator, never by ``assert``: a value out of range raises
``ValueError`` naming the field, the rule and the value; a value of the wrong type raises
``TypeError``. The names and defaults follow vLLM's ``SamplingParams`` so that people who
know one know the other; where vLLM uses a ``-1`` sentinel (``top_k``) we use ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs

__all__ = ["MAX_LOGPROBS", "SamplingParams"]

#: The most alternatives a request may ask log-probabilities for (vLLM's default cap).
MAX_LOGPROBS = 20
_MAX_SEED = 2**63


def _type_name(value: object) -> str:
    return type(value).__name__


def _int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {_type_name(value)} {value!r}")
    return value


def _number(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{field} must be a number, got {_type_name(value)} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{field} must be finite, got {value!r}")
    return number


def _bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{field} must be a bool, got {_type_name(value)} {value!r}")
    return value


def _stop_strings(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise TypeError(f"stop must be a string or a sequence of strings, got {value!r}")
    strings = tuple(value)
    for item in strings:
        if not isinstance(item, str):
            raise TypeError(f"stop must contain only strings, got {_type_name(item)} {item!r}")
        if not item:
            raise ValueError("stop strings must be non-empty, got ''")
    return strings


def _token_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"stop_token_ids must be a sequence of ints, got {value!r}")
    ids = tuple(value)
    for item in ids:
        _int("stop_token_ids", item)
        if item < 0:
            raise ValueError(f"stop_token_ids must be >= 0, got {item}")
    return ids


def _check_max_tokens(_: object, __: object, value: Any) -> None:
    if _int("max_tokens", value) < 1:
        raise ValueError(f"max_tokens must be >= 1, got {value}")


def _check_min_tokens(_: object, __: object, value: Any) -> None:
    if _int("min_tokens", value) < 0:
        raise ValueError(f"min_tokens must be >= 0, got {value}")


def _check_temperature(_: object, __: object, value: Any) -> None:
    if _number("temperature", value) < 0:
        raise ValueError(f"temperature must be >= 0, got {value}")


def _check_top_k(_: object, __: object, value: Any) -> None:
    if value is not None and _int("top_k", value) < 1:
        raise ValueError(f"top_k must be >= 1 (or None to disable), got {value}")


def _check_top_p(_: object, __: object, value: Any) -> None:
    if not 0 < _number("top_p", value) <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {value}")


def _check_min_p(_: object, __: object, value: Any) -> None:
    if not 0 <= _number("min_p", value) <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {value}")


def _check_seed(_: object, __: object, value: Any) -> None:
    if value is not None and not 0 <= _int("seed", value) < _MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63), got {value}")


def _check_repetition_penalty(_: object, __: object, value: Any) -> None:
    if _number("repetition_penalty", value) <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {value}")


def _check_additive_penalty(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not -2 <= _number(attribute.name, value) <= 2:
        raise ValueError(f"{attribute.name} must be in [-2, 2], got {value}")


def _check_logprobs(_: object, __: object, value: Any) -> None:
    if value is not None and not 0 <= _int("logprobs", value) <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got {value}")


def _check_bool(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    _bool(attribute.name, value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request's output, and when to stop.

    Args:
        max_tokens: The most tokens to generate (>= 1). The request finishes with reason
            ``length`` when it reaches this many.
        min_tokens: Stop tokens and EOS are ignored until this many tokens exist.
        temperature: 0 means greedy; higher flattens the distribution.
        top_k: Keep only the k most likely tokens (``None`` keeps all).
        top_p: Keep the smallest set of tokens whose probability reaches ``top_p``.
        min_p: Drop tokens less likely than ``min_p`` times the most likely one.
        seed: Makes sampling reproducible for this request whatever else is batched with it.
        stop: Strings that end the output; they are not included unless
            ``include_stop_str_in_output``.
        stop_token_ids: Token ids that end the output (in addition to the model's EOS).
        ignore_eos: Keep generating past the model's EOS token (benchmarks use this).
        repetition_penalty: Divides the logits of tokens already seen (prompt and output)
            when positive, multiplies them when negative; 1 disables it.
        presence_penalty: Subtracted once from the logit of every token already generated.
        frequency_penalty: Subtracted from a token's logit once per time it was generated.
        logprobs: Return the log-probability of each chosen token and of this many top
            alternatives (``None`` returns none).
        include_stop_str_in_output: Keep the matched stop string at the end of the text.

    Raises:
        TypeError: a value of the wrong type.
        ValueError: a value outside its range; the message names the field and the rule.
    """

    max_tokens: int = attrs.field(default=16, validator=_check_max_tokens)
    min_tokens: int = attrs.field(default=0, validator=_check_min_tokens)
    temperature: float = attrs.field(default=1.0, validator=_check_temperature)
    top_k: int | None = attrs.field(default=None, validator=_check_top_k)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    min_p: float = attrs.field(default=0.0, validator=_check_min_p)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool)
    repetition_penalty: float = attrs.field(default=1.0, validator=_check_repetition_penalty)
    presence_penalty: float = attrs.field(default=0.0, validator=_check_additive_penalty)
    frequency_penalty: float = attrs.field(default=0.0, validator=_check_additive_penalty)
    logprobs: int | None = attrs.field(default=None, validator=_check_logprobs)
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_check_bool)

    def __attrs_post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to taking the most likely token."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Whether any history-dependent penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
