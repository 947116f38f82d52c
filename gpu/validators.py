"""The device boundary's argument checks: what an int and a number of seconds must be.

The same rule as ``twostroke.states.validators`` (``bool`` is never an int here, although
Python says it is), kept here once for ``gpu/``, which may not import ``states/``.
"""

from __future__ import annotations

import math

__all__ = ["check_int_at_least", "check_seconds"]


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def check_int_at_least(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``.

    Raises:
        TypeError: ``"{name} must be an int, got float 2.0"``.
        ValueError: ``"{name} must be >= {minimum}, got {value}"``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {_kind(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_seconds(name: str, value: object, *, positive: bool) -> float:
    """Return ``value`` as a float if it is a finite number (not a bool), ``>= 0`` or ``> 0``.

    Args:
        name: The argument's name, for the message.
        value: The value to check.
        positive: Whether 0 is refused too.

    Raises:
        TypeError: ``"{name} must be a number, got str 'hot'"``.
        ValueError: ``"{name} must be finite and > 0, got 0"``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {_kind(value)}")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{name} must be finite and {'>' if positive else '>='} 0, got {value!r}")
    return float(value)
