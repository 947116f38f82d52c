"""How many KV blocks an engine's pool holds: as configured, or as its memory budget allows.

A model whose sliding-window layers keep their KV apart
(:mod:`~twostroke.engine.runners.window_kv`) has a second pool for them, sized for the worst
case of the scheduler's limits, so that it never runs out: :func:`size_windowed_pool`.
"""

from __future__ import annotations

import attrs

from twostroke.engine.config import EngineConfig
from twostroke.engine.runners.protocol import ModelRunner, WindowApartRunner
from twostroke.gpu.device import Device
from twostroke.states.windowed import WindowedKV, window_pool_blocks

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
#: requests' windows would take more, fewer requests of a whole window run at once.
WINDOWED_KV_SHARE = 0.5


@attrs.frozen
class WindowedPool:
    """The windowed layers' own pool (:mod:`~twostroke.engine.runners.window_kv`).

    Attributes:
        kv: What the scheduler admits against
            (:class:`~twostroke.states.windowed.WindowedKV`: the window, the blocks).
        num_bytes: Its memory, which the global layers' pool does not get.
        num_windows: Requests whose whole window it holds at once (shorter requests take
            less: the scheduler admits by each one's reservation).
    """

    kv: WindowedKV
    num_bytes: int
    num_windows: int


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

    As many blocks as ``max_num_seqs`` requests' windows take beside one step's rows and
    the drafts of speculative decoding
    (:func:`~twostroke.states.windowed.window_pool_blocks`); where the pool is sized from the
    memory budget (``num_blocks`` unset), at most :data:`WINDOWED_KV_SHARE` of it, and then
    the scheduler admits fewer requests of a whole window at once (shorter ones take less).

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

    count = blocks(config.max_num_seqs)
    if config.num_blocks is None:
        share = int(_budget(device, config) * WINDOWED_KV_SHARE)
        count = min(count, share // max(per_block, 1))
        if count < blocks(1):
            raise ValueError(
                f"the windowed layers' KV of one request (window {window}, "
                f"{blocks(1)} blocks of {per_block} bytes) does not fit "
                f"{WINDOWED_KV_SHARE:g} of kv_cache_memory ({share} bytes); give more memory "
                "or swa_full=True"
            )
    # The blocks are linear in the requests: a fixed part and a part per request.
    per_request = blocks(2) - blocks(1)
    windows = (count - (blocks(1) - per_request)) // per_request
    return WindowedPool(
        kv=WindowedKV(window=window, num_blocks=count),
        num_bytes=count * per_block,
        num_windows=windows,
    )


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
