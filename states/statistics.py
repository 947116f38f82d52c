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

__all__ = ["count", "seconds", "total", "zero"]

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


def zero(field: attrs.Attribute[Any]) -> int | float:
    """What a declared field starts from: ``0`` for a count, ``0.0`` for seconds.

    Raises:
        TypeError: the field was declared neither with :func:`count` nor :func:`seconds`.
    """
    try:
        value: int | float = field.metadata[_ZERO]
    except KeyError:
        raise TypeError(
            f"statistics field {field.name} is neither a count() nor seconds()"
        ) from None
    return value


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
    return cls(
        **{
            field.name: sum((getattr(record, field.name) for record in records), zero(field))
            for field in attrs.fields(cls)
        }
    )
