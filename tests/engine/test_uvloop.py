"""The engine runs on uvloop unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from twostroke.engine import SamplingParams

from .conftest import toy_engine

uvloop = pytest.importorskip("uvloop")
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> Any:
    return ("asyncio", {"use_uvloop": True})


async def test_generate_and_stream_on_uvloop() -> None:
    import asyncio

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    async with toy_engine() as engine:
        output = await engine.generate("uv", SamplingParams(max_tokens=10, ignore_eos=True))
        async with engine.stream("uv", SamplingParams(max_tokens=10, ignore_eos=True)) as deltas:
            text = "".join([delta.text async for delta in deltas])
    assert text == output.text
