"""The bench's tests run on a fixed machine speed: the probe around each system
(:func:`~twostroke.engine.bench.roof.machine_speed`, a quarter second of products twice a
system) is tested on its own, and would only slow the others down."""

from __future__ import annotations

import pytest

from twostroke.engine.bench import runner


@pytest.fixture(autouse=True)
def steady_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "machine_speed", lambda *, threads: 100.0)
