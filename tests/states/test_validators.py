"""The shared field validators: each rule, its type check, and the message it writes."""

from __future__ import annotations

import enum
import math
import re
from typing import Any

import attrs
import pytest

from twostroke.states.validators import (
    PIPELINE_DEPTH,
    boolean,
    check_int_at_least,
    check_number,
    int_at_least,
    int_in,
    is_int,
    is_number,
    number_in,
    one_of,
)


class Shade(enum.Enum):
    DARK = "dark"
    LIGHT = "light"


@attrs.frozen(kw_only=True)
class Sample:
    count: int = attrs.field(default=1, validator=int_at_least(1))
    limit: int | None = attrs.field(default=None, validator=int_at_least(0, optional=True))
    seed: int = attrs.field(default=0, validator=int_in(0, 2**63, high_open=True))
    index: int = attrs.field(default=0, validator=int_in(None, 3))
    ratio: float = attrs.field(default=0.5, validator=number_in(0, 1, low_open=True))
    scale: float = attrs.field(default=1.0, validator=number_in(0, low_open=True, note=" (!)"))
    cap: float = attrs.field(default=0.0, validator=number_in(high=5, high_open=True))
    mode: str = attrs.field(default="a", validator=one_of("a", "b"))
    #: Choices of two types: a value of neither type names both.
    unit: int | str = attrs.field(default=1, validator=one_of(1, "auto"))
    #: A type with no article of its own is named "a <type>".
    shade: Shade = attrs.field(default=Shade.DARK, validator=one_of(Shade.DARK))
    depth: int = attrs.field(default=1, validator=PIPELINE_DEPTH)
    flag: bool = attrs.field(default=False, validator=boolean)


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("count", 0, ValueError, "count must be >= 1, got 0"),
        ("count", True, TypeError, "count must be an int, got bool True"),
        ("count", None, TypeError, "count must be an int, got NoneType None"),
        ("limit", -1, ValueError, "limit must be >= 0, got -1"),
        ("limit", 1.0, TypeError, "limit must be an int, got float 1.0"),
        ("seed", 2**63, ValueError, f"seed must be in [0, 2**63), got {2**63}"),
        ("seed", None, TypeError, "seed must be an int, got NoneType None"),
        ("index", 4, ValueError, "index must be <= 3, got 4"),
        ("ratio", 0, ValueError, "ratio must be in (0, 1], got 0"),
        ("ratio", math.inf, ValueError, "ratio must be finite, got inf"),
        ("ratio", "1", TypeError, "ratio must be a number, got str '1'"),
        ("ratio", False, TypeError, "ratio must be a number, got bool False"),
        ("scale", 0.0, ValueError, "scale must be > 0 (!), got 0.0"),
        ("cap", 5, ValueError, "cap must be < 5, got 5"),
        ("mode", "c", ValueError, "mode must be one of 'a', 'b', got 'c'"),
        ("mode", 1, TypeError, "mode must be a str: one of 'a', 'b', got int 1"),
        ("unit", 1.5, TypeError, "unit must be a str or an int: one of 1, 'auto', got float 1.5"),
        (
            "shade",
            "dark",
            TypeError,
            "shade must be a Shade: one of <Shade.DARK: 'dark'>, got str 'dark'",
        ),
        (
            "shade",
            Shade.LIGHT,
            ValueError,
            "shade must be one of <Shade.DARK: 'dark'>, got <Shade.LIGHT: 'light'>",
        ),
        ("depth", 3, ValueError, "depth must be 1 (serial) or 2 (lookahead), got 3"),
        (
            "depth",
            2.0,
            TypeError,
            "depth must be an int: 1 (serial) or 2 (lookahead), got float 2.0",
        ),
        ("flag", 1, TypeError, "flag must be a bool, got int 1"),
    ],
)
def test_bad_values_name_field_rule_and_value(
    field: str, value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        Sample(**{field: value})


def test_good_values_pass() -> None:
    sample = Sample(count=3, limit=None, seed=2**63 - 1, index=-5, ratio=1, scale=2, cap=4.9)
    assert (sample.count, sample.ratio, sample.seed) == (3, 1, 2**63 - 1)
    assert Sample(mode="b", depth=2, flag=True).depth == 2


def test_plain_checks() -> None:
    assert check_int_at_least("n", 0, 0) == 0
    with pytest.raises(ValueError, match=r"^n must be >= 1, got 0$"):
        check_int_at_least("n", 0, 1)
    assert check_number("x", 2) == 2.0
    with pytest.raises(ValueError, match=r"^x must be finite, got nan$"):
        check_number("x", math.nan)


def test_the_predicates_say_the_rule_alone() -> None:
    assert [is_int(v) for v in (3, -1, True, 3.0, "3", None)] == [1, 1, 0, 0, 0, 0]
    assert [is_number(v) for v in (3, 2.5, math.inf, False, "3")] == [1, 1, 1, 0, 0]


def test_a_range_needs_a_bound() -> None:
    with pytest.raises(ValueError, match=r"^a range needs at least one bound$"):
        number_in()


@pytest.mark.parametrize(
    ("high", "shown"),
    [(2**16, "2**16"), (2**20, "2**20"), (2**16 + 2, "65538"), (2**15, "32768"), (1000, "1000")],
)
def test_large_powers_of_two_read_as_powers(high: int, shown: str) -> None:
    @attrs.frozen
    class Bounded:
        value: int = attrs.field(validator=int_in(0, high))

    with pytest.raises(ValueError, match=rf"^value must be in \[0, {re.escape(shown)}\], got -1$"):
        Bounded(-1)
