"""The state machines of the core: marked ``state_machine``, with a hang tripwire of their own.

`make test-core` runs them without the coverage tracer (it tripled their time: TestScheduler
6 s alone, 17 s traced, on a quiet 2-core AVX2 machine) and gates coverage on the core's other
tests, which reach every branch by themselves (the gate fails the day they stop).
"""

from __future__ import annotations

import unittest

import pytest

#: Seconds: the core's hypothesis state machines take 6-11 s each with coverage on a quiet
#: 2-core AVX2 machine, but `make test` runs them beside the rest of the suite (and, in the
#: measured case, another job busy on one core), where one took over 120 s. The timeout only
#: catches a hang, as the Ray tests' does.
STATE_MACHINE_TIMEOUT = 300


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        cls = getattr(item, "cls", None)
        is_machine = cls is not None and issubclass(cls, unittest.TestCase)
        if not is_machine:
            continue
        item.add_marker(pytest.mark.state_machine)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(STATE_MACHINE_TIMEOUT))
