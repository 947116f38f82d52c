"""Engine test helpers: a toy engine with a leak check when it closes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio.testing

from twostroke.engine import Engine
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.gpu.device import Device, FakeDevice


@asynccontextmanager
async def toy_engine(
    *,
    runner: ToyRunner | None = None,
    device: Device | str = "cpu",
    **config: Any,
) -> AsyncIterator[Engine]:
    """A toy engine that proves, when its block ends normally, that nothing leaked."""
    config.setdefault("num_blocks", 64)
    config.setdefault("block_size", 4)
    async with Engine.open(
        runner=runner or ToyRunner(), tokenizer=ByteTokenizer(), device=device, **config
    ) as engine:
        yield engine
        await engine.wait_idle()
        engine.check_invariants()
        stats = engine.statistics()
        assert stats.num_free_blocks == stats.num_blocks, stats
        assert stats.num_open_requests == 0, stats


@pytest.fixture
def make_engine() -> Callable[..., Any]:
    return toy_engine


@pytest.fixture(
    params=[
        pytest.param(("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}), id="trio"),
    ]
)
def virtual_time_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def fake_device(step_time: float = 1.0) -> FakeDevice:
    return FakeDevice(step_time=step_time)
