"""How many KV blocks an engine's pool holds: as configured, or as its memory budget allows.

A model whose sliding-window layers keep their KV apart
(:mod:`~twostroke.engine.runners.window_kv`) has a second pool for them, sized for the worst
case of the scheduler's limits, so that it never runs out: :func:`size_windowed_pool`.
"""

from __future__ import annotations

import attrs

from twostroke.engine.config import EngineConfig
from twostroke.engine.runners.protocol import ModelRunner, WindowApartRunner
from twostroke.engine.runners.window_kv import window_pool_blocks
from twostroke.gpu.device import Device

__all__ = [
    "CPU_KV_CACHE_BYTES",
    "CUDA_KV_CACHE_FRACTION",
    "WINDOWED_KV_SHARE",
    "WindowedPool",
    "size_pool",
    "size_windowed_pool",
]

#: The KV budget on the CPU when ``kv_cache_memory`` is not set: the rest of the program
#: shares the host's memory, so a fixed 1 GiB rather than a fraction of what is free.
CPU_KV_CACHE_BYTES = 1 << 30
#: The KV budget on CUDA when ``kv_cache_memory`` is not set: half the GPU's free memory.
CUDA_KV_CACHE_FRACTION = 0.5
#: The most of the KV budget the windowed layers' own pool takes: where ``max_num_seqs``
#: requests' windows would take more, the engine runs fewer requests at once.
WINDOWED_KV_SHARE = 0.5


@attrs.frozen
class WindowedPool:
    """The windowed layers' own pool (:mod:`~twostroke.engine.runners.window_kv`).

    Attributes:
        num_blocks: Its blocks, padding included.
        max_num_seqs: The most requests the scheduler may run at once for it never to run
            out: ``max_num_seqs`` as configured, or fewer where the budget's share
            (:data:`WINDOWED_KV_SHARE`) holds fewer requests' windows.
        num_bytes: Its memory, which the global layers' pool does not get.
    """

    num_blocks: int
    max_num_seqs: int
    num_bytes: int


def _budget(device: Device, config: EngineConfig) -> int:
    budget = config.kv_cache_memory
    if budget is None:
        budget = CUDA_KV_CACHE_FRACTION if device.kind == "cuda" else CPU_KV_CACHE_BYTES
    if isinstance(budget, float):
        budget = int(budget * device.free_memory())
    return budget


def size_windowed_pool(
    runner: ModelRunner, device: Device, config: EngineConfig
) -> WindowedPool | None:
    """The windowed layers' own pool, or ``None`` where the runner keeps no windowed KV
    apart (:attr:`~twostroke.engine.runners.protocol.WindowApartRunner.windowed_kv_window`).

    Sized by :func:`~twostroke.engine.runners.window_kv.window_pool_blocks` for
    ``max_num_seqs`` requests, each step's token budget and the drafts of speculative
    decoding; where the pool is sized from the memory budget (``num_blocks`` unset) and
    that would take more than :data:`WINDOWED_KV_SHARE` of it, for as many requests as
    that share holds.

    Raises:
        ValueError: the share holds no request's window.
    """
    if not isinstance(runner, WindowApartRunner):
        return None
    window = runner.windowed_kv_window
    if window is None:
        return None
    speculative = config.speculative_config
    drafts = 0 if speculative is None else speculative.num_speculative_tokens
    per_block = runner.windowed_kv_bytes_per_block(config.block_size)

    def blocks(num_seqs: int) -> int:
        return window_pool_blocks(
            window=window,
            block_size=config.block_size,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_drafts=drafts,
        )

    num_seqs = config.max_num_seqs
    if config.num_blocks is None:
        share = int(_budget(device, config) * WINDOWED_KV_SHARE)
        # The blocks are linear in the requests: a fixed part and a part per request.
        per_request = blocks(2) - blocks(1)
        fitting = (share // max(per_block, 1) - (blocks(1) - per_request)) // per_request
        num_seqs = min(num_seqs, fitting)
        if num_seqs < 1:
            raise ValueError(
                f"the windowed layers' KV of one request (window {window}, "
                f"{blocks(1)} blocks of {per_block} bytes) does not fit "
                f"{WINDOWED_KV_SHARE:g} of kv_cache_memory ({share} bytes); give more memory "
                "or swa_full=True"
            )
    count = blocks(num_seqs)
    return WindowedPool(num_blocks=count, max_num_seqs=num_seqs, num_bytes=count * per_block)


def size_pool(
    runner: ModelRunner,
    device: Device,
    config: EngineConfig,
    windowed: WindowedPool | None = None,
) -> int:
    """Blocks in the KV pool: ``config.num_blocks``, or as many as the memory budget holds.

    The budget is ``config.kv_cache_memory`` (bytes, or a fraction of the device's free
    memory), by default half the free memory on CUDA and 1 GiB elsewhere, less the
    ``windowed`` layers' own pool. A pool never gets more blocks than ``max_num_seqs``
    requests of the model's whole context can use.

    Raises:
        ValueError: the budget holds no block.
    """
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = runner.kv_cache_bytes_per_block(config.block_size)
    budget = _budget(device, config) - (0 if windowed is None else windowed.num_bytes)
    num_blocks = budget // max(per_block, 1)
    needed = -(-runner.max_model_len // config.block_size)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory ({budget} bytes) holds no KV block of {per_block} bytes")
    return int(min(num_blocks, max(needed * config.max_num_seqs, needed)))
