"""Statistics fields declared a count or seconds, and records summed by that declaration."""

from __future__ import annotations

import attrs
import pytest

from twostroke.states.scheduler_config import SchedulerStatistics
from twostroke.states.statistics import count, seconds, total, zero


@attrs.frozen(kw_only=True)
class Record:
    steps: int = count()
    busy: float = seconds()


@attrs.frozen(kw_only=True)
class Extended(Record):
    note: str = "left out of the total"


def test_a_field_starts_from_the_zero_of_its_kind() -> None:
    steps, busy = attrs.fields(Record)
    assert (zero(steps), zero(busy)) == (0, 0.0)
    assert isinstance(zero(steps), int)
    assert isinstance(zero(busy), float)


def test_a_field_declared_neither_way_has_no_zero() -> None:
    with pytest.raises(TypeError, match=r"^statistics field note is neither a count\(\), seconds"):
        zero(attrs.fields(Extended).note)


def test_records_add_up_field_by_field() -> None:
    records = [Record(steps=2, busy=0.5), Extended(steps=3, busy=1.0, note="x")]
    assert total(Record, iter(records)) == Record(steps=5, busy=1.5)


def test_no_records_total_zero_of_each_kind() -> None:
    empty = total(Record, [])
    assert empty == Record(steps=0, busy=0.0)
    assert isinstance(empty.busy, float)


def test_every_scheduler_count_is_declared() -> None:
    assert total(SchedulerStatistics, []).num_steps == 0
    with pytest.raises(TypeError, match=r"^statistics field note is neither"):
        total(Extended, [])
