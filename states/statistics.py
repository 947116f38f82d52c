"""Statistics records whose fields add up: each one declared a count or seconds.

A field of such a record (the scheduler's, and the engine's that extends it) says what it
holds where it is declared: :func:`count` (requests, blocks, steps, tokens: an int) or
:func:`seconds` (a float). Both add up over engines, so :func:`total` sums records field by
field, and a reader of a record from elsewhere (the coordinator, off a replica's wire) asks
:func:`zero` what kind of number a field holds, instead of guessing from its annotation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import attrs

__all__ = ["count", "per_position", "seconds", "total", "zero"]

R = TypeVar("R", bound=attrs.AttrsInstance)

_ZERO = "twostroke.statistics.zero"


def count() -> Any:
    """Declare a field that counts (requests, blocks, steps, tokens): an int.

    (Typed ``Any``, as ``attrs.field`` is to a type checker: the annotation gives the type.)
    """
    return attrs.field(metadata={_ZERO: 0})


def seconds() -> Any:
    """Declare a field of seconds: a float."""
    return attrs.field(metadata={_ZERO: 0.0})


def per_position(length: int) -> Any:
    """Declare a field of ``length`` counts, one per position (accepted drafts by their
    place in the draft): a tuple of ints that adds up position by position."""
    return attrs.field(default=(0,) * length, metadata={_ZERO: (0,) * length})


def zero(field: attrs.Attribute[Any]) -> int | float | tuple[int, ...]:
    """What a declared field starts from: ``0`` for a count, ``0.0`` for seconds, a tuple
    of zeros for counts per position.

    Raises:
        TypeError: the field was declared neither with :func:`count`, :func:`seconds` nor
            :func:`per_position`.
    """
    try:
        value: int | float | tuple[int, ...] = field.metadata[_ZERO]
    except KeyError:
        raise TypeError(
            f"statistics field {field.name} is neither a count(), seconds() nor per_position()"
        ) from None
    return value


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, tuple):
        return tuple(x + y for x, y in zip(a, b, strict=True))
    return a + b


def total(cls: type[R], records: Iterable[R]) -> R:
    """The records summed field by field: a record of ``cls`` (every field zero for none).

    Args:
        cls: An attrs class whose every field is declared with :func:`count` or
            :func:`seconds`.
        records: Records of ``cls`` (or of a subclass: its own fields are left out).

    Raises:
        TypeError: a field of ``cls`` is declared neither way.
    """
    records = tuple(records)
    fields: dict[str, Any] = {}
    for field in attrs.fields(cls):
        value = zero(field)
        for record in records:
            value = _add(value, getattr(record, field.name))
        fields[field.name] = value
    return cls(**fields)
