"""Rotary scaling as a configuration states it: :class:`RopeScaling`, read from a Hugging
Face ``rope_parameters`` (or older ``rope_scaling``) or from GGUF keys, as transformers'
``modeling_rope_utils`` and llama.cpp read them. The tables themselves are computed in
:mod:`~twostroke.engine.models.layers`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from twostroke.engine.models.fields import require
from twostroke.states.validators import number_in

__all__ = ["RopeScaling", "floats", "hf_rope_scaling", "phi3_rope", "yarn_mscale"]

_POSITIVE_NUMBER = number_in(0, low_open=True)


def floats(values: Iterable[float]) -> tuple[float, ...]:
    """A list of numbers (parsed JSON, a GGUF tensor's) as the frozen tuple a value holds."""
    return tuple(float(value) for value in values)


@attrs.frozen(kw_only=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts.

    ``"linear"`` divides every frequency by ``factor``; ``"llama3"`` divides only the low
    frequencies and interpolates in between (Llama 3.1's rule, as transformers computes it);
    ``"yarn"`` (Qwen2 and Qwen3's long context) blends divided and undivided frequencies
    over a ramp between ``beta_fast`` and ``beta_slow`` rotations and multiplies the rotary
    tables by ``attention_factor`` (transformers' ``_compute_yarn_parameters``);
    ``"longrope"`` (Phi-3's LongRoPE) divides each frequency by its own factor, from
    ``short_factor`` at positions inside ``original_max_position_embeddings`` and from
    ``long_factor`` beyond, and multiplies the tables by ``attention_factor``
    (transformers' ``_compute_longrope_parameters``; which set a position takes:
    :func:`~twostroke.engine.models.layers.rotary_tables`).

    Attributes:
        kind: ``"linear"``, ``"llama3"``, ``"yarn"`` or ``"longrope"``.
        factor: The stretch factor.
        low_freq_factor: llama3 only.
        high_freq_factor: llama3 only.
        original_max_position_embeddings: llama3, yarn and longrope: the context the model
            was trained on (longrope: the positions below it take the short factors).
        beta_fast: yarn only: the ramp's end, in rotations.
        beta_slow: yarn only: the ramp's start, in rotations.
        attention_factor: yarn and longrope: what ``cos`` and ``sin`` are multiplied by.
        truncate: yarn only: the ramp's bounds rounded outwards to whole dimensions.
        short_factor: longrope only: each rotated pair's divisor inside the original context.
        long_factor: longrope only: each rotated pair's divisor beyond it.
    """

    kind: str = attrs.field(
        validator=attrs.validators.in_(("linear", "llama3", "yarn", "longrope"))
    )
    factor: float = attrs.field(validator=_POSITIVE_NUMBER)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = attrs.field(default=1.0, validator=_POSITIVE_NUMBER)
    truncate: bool = True
    short_factor: tuple[float, ...] = attrs.field(default=(), converter=floats)
    long_factor: tuple[float, ...] = attrs.field(default=(), converter=floats)

    def __attrs_post_init__(self) -> None:
        if self.kind == "longrope" and (
            not self.short_factor or len(self.short_factor) != len(self.long_factor)
        ):
            raise ValueError(
                f"longrope needs short_factor and long_factor of one length (one per rotated "
                f"pair), got {len(self.short_factor)} and {len(self.long_factor)}"
            )


def hf_rope_scaling(scaling: Mapping[str, Any], max_positions: int) -> RopeScaling | None:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=require(scaling, "factor"))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=require(scaling, "factor"),
            low_freq_factor=require(scaling, "low_freq_factor"),
            high_freq_factor=require(scaling, "high_freq_factor"),
            original_max_position_embeddings=scaling.get(
                "original_max_position_embeddings", max_positions
            ),
        )
    if kind == "yarn":
        factor = scaling.get("factor")
        original = scaling.get("original_max_position_embeddings", max_positions)
        if factor is None:
            factor = max_positions / original
        attention_factor = scaling.get("attention_factor")
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        elif attention_factor is None:
            attention_factor = yarn_mscale(factor)
        return RopeScaling(
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            # transformers reads these with ``or``: a null or zero takes the default too.
            beta_fast=scaling.get("beta_fast") or 32.0,
            beta_slow=scaling.get("beta_slow") or 1.0,
            attention_factor=attention_factor,
            truncate=bool(scaling.get("truncate", True)),
        )
    if kind == "longrope":
        original = require(scaling, "original_max_position_embeddings")
        factor = scaling.get("factor")
        if factor is None:
            factor = max_positions / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:  # LongRoPE's paper, as transformers computes it
            attention_factor = (
                math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
            )
        return RopeScaling(
            kind="longrope",
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=attention_factor,
            short_factor=require(scaling, "short_factor"),
            long_factor=require(scaling, "long_factor"),
        )
    raise ValueError(
        f"unsupported rope_type {kind!r}; supported: 'default', 'linear', 'llama3', 'yarn', "
        "'longrope'"
    )


def phi3_rope(scaling: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3's rope parameters as ``Phi3Config`` standardizes them: ``"su"`` and ``"yarn"``
    are its old names of ``"longrope"``, and the top level's
    ``original_max_position_embeddings`` (4096 where absent) wins over the dict's."""
    found = dict(scaling)
    kind = found.get("rope_type", found.get("type", "default"))
    if kind in ("su", "yarn", "longrope"):
        found["rope_type"] = "longrope"
        found["original_max_position_embeddings"] = data.get(
            "original_max_position_embeddings", 4096
        )
    return found


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor (its paper's eq. 21, transformers' ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
