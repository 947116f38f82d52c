"""Field validators: the one place that says what an int, a number or a choice must be.

Every configuration and parameter value in ``states/`` (and ``engine/``'s config) is checked
by these, so one rule reads the same everywhere: a value of the wrong type raises
``TypeError`` and one out of range raises ``ValueError``, both naming the field, the rule and
the value (``"max_tokens must be >= 1, got 0"``). ``bool`` is never an int here, although
Python says it is: ``max_num_seqs=True`` is a mistake, not a one.

The attrs validators (:func:`int_at_least`, :func:`int_in`, :func:`number_in`,
:func:`one_of`, :func:`boolean`) take ``(instance, attribute, value)``; the plain checks
(:func:`check_int`, :func:`check_number`, :func:`check_int_at_least`) take the field's name,
for values that are not attrs fields; the predicates (:func:`is_int`, :func:`is_number`) are
the rule alone, for a check that words its own message (an item of a list, a value that
may be one of two kinds). :func:`frozen_mapping` is the converter that makes a
mapping field of a frozen value read-only. ``gpu/`` keeps its own: it may not import ``states/``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import attrs

__all__ = [
    "MAX_PIPELINE_DEPTH",
    "PIPELINE_DEPTH",
    "Validator",
    "boolean",
    "check_int",
    "check_int_at_least",
    "check_number",
    "frozen_mapping",
    "int_at_least",
    "int_in",
    "is_int",
    "is_number",
    "number_in",
    "one_of",
]

#: What attrs calls: ``validator(instance, attribute, value)``, raising on a bad value.
Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

_ARTICLES = {int: "an int", str: "a str", float: "a float", bool: "a bool"}


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int: an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is a number: an ``int`` or a ``float``, and not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int (and not a bool).

    Raises:
        TypeError: ``"{name} must be an int, got float 2.0"``.
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {_kind(value)}")
    return value


def check_int_at_least(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int of at least ``minimum``.

    Raises:
        TypeError: not an int.
        ValueError: ``"{name} must be >= {minimum}, got {value}"``.
    """
    number = check_int(name, value)
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return number


def check_number(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite int or float (and not a bool).

    Raises:
        TypeError: ``"{name} must be a number, got str 'hot'"``.
        ValueError: ``"{name} must be finite, got inf"``.
    """
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {_kind(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


def _bound(value: float) -> str:
    # 2**63 reads better than 9223372036854775808 in a message.
    if isinstance(value, int) and value >= 2**16 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return f"{value}"


def _range(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        opening, closing = "(" if low_open else "[", ")" if high_open else "]"
        return f"in {opening}{_bound(low)}, {_bound(high)}{closing}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_bound(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_bound(high)}"
    raise ValueError("a range needs at least one bound")


def _inside(
    value: float, low: float | None, high: float | None, low_open: bool, high_open: bool
) -> bool:
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or (value < high if high_open else value <= high)


def int_at_least(minimum: int, *, optional: bool = False, note: str = "") -> Validator:
    """An attrs validator: an int ``>= minimum`` (``None`` too when ``optional``).

    Args:
        minimum: The smallest value allowed.
        optional: Whether ``None`` is allowed (it means "not set" or "disabled").
        note: Appended to the rule in the message, e.g. ``" (or None to disable)"``.
    """
    return int_in(minimum, None, optional=optional, note=note)


def int_in(
    low: int | None,
    high: int | None,
    *,
    high_open: bool = False,
    optional: bool = False,
    note: str = "",
) -> Validator:
    """An attrs validator: an int in ``[low, high]`` (``[low, high)`` when ``high_open``).

    Args:
        low: The smallest value allowed, or ``None`` for no lower bound.
        high: The largest value allowed, or ``None`` for no upper bound.
        high_open: Whether ``high`` itself is excluded.
        optional: Whether ``None`` is allowed.
        note: Appended to the rule in the message.
    """
    rule = _range(low, high, False, high_open) + note

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if not _inside(check_int(attribute.name, value), low, high, False, high_open):
            raise ValueError(f"{attribute.name} must be {rule}, got {value}")

    return check


def number_in(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    note: str = "",
) -> Validator:
    """An attrs validator: a finite number (int or float) in a range.

    Args:
        low: The lower bound, or ``None``.
        high: The upper bound, or ``None``.
        low_open: Whether ``low`` itself is excluded.
        high_open: Whether ``high`` itself is excluded.
        note: Appended to the rule in the message, e.g. ``" (1 disables it)"``.
    """
    rule = _range(low, high, low_open, high_open) + note

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        number = check_number(attribute.name, value)
        if not _inside(number, low, high, low_open, high_open):
            raise ValueError(f"{attribute.name} must be {rule}, got {value}")

    return check


def one_of(*choices: object, describe: str | None = None) -> Validator:
    """An attrs validator: one of ``choices``, of the same type as the choice it equals.

    ``1.0`` and ``True`` equal ``1`` but are not the choice ``1``: a value whose type no
    choice has raises ``TypeError``, so ``pipeline_depth=1.0`` is not quietly serial.

    Args:
        choices: The allowed values.
        describe: The rule in words (``"1 (serial) or 2 (lookahead)"``); by default
            ``"one of 1, 2"``.
    """
    rule = describe or "one of " + ", ".join(repr(choice) for choice in choices)
    types = {type(choice) for choice in choices}
    expected = " or ".join(sorted(_ARTICLES.get(kind, f"a {kind.__name__}") for kind in types))

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if type(value) not in types:
            raise TypeError(f"{attribute.name} must be {expected}: {rule}, got {_kind(value)}")
        if value not in choices:
            raise ValueError(f"{attribute.name} must be {rule}, got {value!r}")

    return check


def boolean(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An attrs validator: exactly ``True`` or ``False`` (not 1, not ``"yes"``).

    Raises:
        TypeError: ``"{name} must be a bool, got int 1"``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be a bool, got {_kind(value)}")


#: The most steps in flight at once: 2, the one-step lookahead. Step N+1 is planned while at
#: most step N runs, so a plan is made behind at most one step
#: (:attr:`~twostroke.states.plan.StepPlan.planned_behind`): its pending inputs are that
#: step's samples, which the runner keeps on the device, and when that step fails the rows it
#: strands are in the one plan after it (:meth:`~twostroke.states.plan.StepPlan.stranded_by`,
#: :meth:`~twostroke.states.prefix_cache.PrefixCache.distrust`). A deeper pipeline would need
#: each of these to look further back.
MAX_PIPELINE_DEPTH = 2

#: ``pipeline_depth`` of the scheduler and of the engine: how many steps may be in flight.
PIPELINE_DEPTH = one_of(*range(1, MAX_PIPELINE_DEPTH + 1), describe="1 (serial) or 2 (lookahead)")


def frozen_mapping(value: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """An attrs converter: a read-only copy of ``value``.

    A frozen attrs class only stops rebinding its fields; a ``dict`` field would still change
    under whoever holds the value. The copy means the caller's own dict can change later
    without reaching in, and the proxy raises ``TypeError`` on any assignment. (Not generic:
    mypy's attrs plugin rejects a generic converter; the field's annotation keeps the types.)
    """
    return types.MappingProxyType(dict(value))
