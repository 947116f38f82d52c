"""The KV pool's size: configured, or what the memory budget holds, capped by what can be used."""

from __future__ import annotations

import re
from typing import Any, ClassVar, cast

import pytest

from twostroke.engine.config import EngineConfig
from twostroke.engine.runners.pool_size import (
    CPU_KV_CACHE_BYTES,
    WindowedPool,
    size_pool,
    size_windowed_pool,
)
from twostroke.engine.runners.protocol import ModelRunner
from twostroke.gpu.device import Device
from twostroke.gpu.fake import FakeDevice
from twostroke.states.windowed import WindowedKV


class Runner:
    """A model whose KV block takes ``per_position`` bytes per position."""

    def __init__(self, per_position: int, max_model_len: int = 4096) -> None:
        self.per_position = per_position
        self.max_model_len = max_model_len

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.per_position * block_size


class Gpu(FakeDevice):
    kind: ClassVar[str] = "cuda"

    def free_memory(self) -> int:
        return 1 << 20


def blocks(runner: Runner, device: Device | None = None, **config: Any) -> int:
    return size_pool(cast(ModelRunner, runner), device or FakeDevice(), EngineConfig(**config))


def test_a_configured_pool_size_is_taken_as_it_is() -> None:
    assert blocks(Runner(1 << 40), num_blocks=7) == 7


def test_the_budget_in_bytes_or_as_a_fraction_of_free_memory() -> None:
    runner = Runner(64, max_model_len=1 << 20)  # a block of 16 positions: 1 KiB
    assert blocks(runner, kv_cache_memory=10 * 1024 + 5) == 10
    assert blocks(runner, Gpu(), kv_cache_memory=0.25) == 256  # of 1 MiB free
    assert blocks(runner, Gpu()) == 512  # half the GPU's free memory by default
    assert blocks(runner) == CPU_KV_CACHE_BYTES // 1024  # 1 GiB elsewhere


def test_no_more_blocks_than_max_num_seqs_whole_contexts_use() -> None:
    runner = Runner(64, max_model_len=100)  # 7 blocks of 16 hold a context
    assert blocks(runner, max_num_seqs=3) == 21
    assert blocks(runner, max_num_seqs=3, kv_cache_memory=4 * 1024) == 4


def test_a_budget_that_holds_no_block_is_refused() -> None:
    message = "kv_cache_memory (1000 bytes) holds no KV block of 1024 bytes"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        blocks(Runner(64), kv_cache_memory=1000)


class WindowedRunner(Runner):
    """A model whose windowed layers keep their KV apart: ``windowed_per_position`` bytes a
    position there, a window of ``window``."""

    def __init__(self, per_position: int, windowed_per_position: int, window: int | None) -> None:
        super().__init__(per_position, max_model_len=1 << 20)
        self.windowed_per_position = windowed_per_position
        self.windowed_kv_window = window

    def windowed_kv_bytes_per_block(self, block_size: int) -> int:
        return self.windowed_per_position * block_size

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, *, num_windowed_blocks: int = 0
    ) -> None:
        raise AssertionError("not allocated here")


def windowed(runner: Runner, **config: Any) -> WindowedPool | None:
    return size_windowed_pool(cast(ModelRunner, runner), FakeDevice(), EngineConfig(**config))


def test_the_windowed_pool_holds_max_num_seqs_windows_and_a_step() -> None:
    runner = WindowedRunner(64, 128, window=33)  # blocks of 16: 2 KiB each apart
    assert windowed(Runner(64)) is None
    assert windowed(WindowedRunner(64, 128, window=None)) is None
    pool = windowed(runner, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=10)
    # 1 padding + 4 x (blocks_for(32) + 2) + blocks_for(64); drafts add to each request's
    expected = 1 + 4 * 4 + 4
    assert pool == WindowedPool(
        kv=WindowedKV(window=33, num_blocks=expected), num_bytes=expected * 2048, num_windows=4
    )
    drafted = windowed(
        runner,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_blocks=10,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    assert drafted is not None
    assert drafted.kv.num_blocks == 1 + 4 * 5 + 4
    # The budget: the windowed pool first, the rest to the global layers' blocks of 1 KiB.
    budget = 1 << 20
    pool = windowed(runner, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=budget)
    assert pool is not None
    assert pool.num_windows == 4
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=budget)
    assert size_pool(cast(ModelRunner, runner), FakeDevice(), config, pool) == (
        (budget - expected * 2048) // 1024
    )


def test_a_windowed_pool_past_its_share_holds_fewer_whole_windows() -> None:
    runner = WindowedRunner(64, 128, window=33)
    # Half of 64 KiB holds 16 blocks of 2 KiB: 1 + 4 (a step) + 2 whole windows of 4, and 3
    # blocks more, which shorter requests' reservations may take (the scheduler's).
    pool = windowed(runner, max_num_batched_tokens=64, kv_cache_memory=64 * 1024)
    assert pool is not None
    assert (pool.num_windows, pool.kv.num_blocks) == (2, 16)
    message = "the windowed layers' KV of one request (window 33, 9 blocks of 2048 bytes)"
    with pytest.raises(ValueError, match=re.escape(message)):
        windowed(runner, max_num_batched_tokens=64, kv_cache_memory=16 * 1024)
