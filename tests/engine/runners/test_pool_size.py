"""The KV pool's size: configured, or what the memory budget holds, capped by what can be used."""

from __future__ import annotations

import re
from typing import Any, ClassVar, cast

import pytest

from twostroke.engine.config import EngineConfig
from twostroke.engine.runners.pool_size import CPU_KV_CACHE_BYTES, size_pool
from twostroke.engine.runners.protocol import ModelRunner
from twostroke.gpu.device import Device
from twostroke.gpu.fake import FakeDevice


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
