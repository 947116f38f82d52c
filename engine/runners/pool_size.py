"""How many KV blocks an engine's pool holds: as configured, or as its memory budget allows."""

from __future__ import annotations

from twostroke.engine.config import EngineConfig
from twostroke.engine.runners.protocol import ModelRunner
from twostroke.gpu.device import Device

__all__ = ["CPU_KV_CACHE_BYTES", "CUDA_KV_CACHE_FRACTION", "size_pool"]

#: The KV budget on the CPU when ``kv_cache_memory`` is not set: the rest of the program
#: shares the host's memory, so a fixed 1 GiB rather than a fraction of what is free.
CPU_KV_CACHE_BYTES = 1 << 30
#: The KV budget on CUDA when ``kv_cache_memory`` is not set: half the GPU's free memory.
CUDA_KV_CACHE_FRACTION = 0.5


def size_pool(runner: ModelRunner, device: Device, config: EngineConfig) -> int:
    """Blocks in the KV pool: ``config.num_blocks``, or as many as the memory budget holds.

    The budget is ``config.kv_cache_memory`` (bytes, or a fraction of the device's free
    memory), by default half the free memory on CUDA and 1 GiB elsewhere. A pool never gets
    more blocks than ``max_num_seqs`` requests of the model's whole context can use.

    Raises:
        ValueError: the budget holds no block.
    """
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = runner.kv_cache_bytes_per_block(config.block_size)
    budget = config.kv_cache_memory
    if budget is None:
        budget = CUDA_KV_CACHE_FRACTION if device.kind == "cuda" else CPU_KV_CACHE_BYTES
    if isinstance(budget, float):
        budget = int(budget * device.free_memory())
    num_blocks = budget // max(per_block, 1)
    needed = -(-runner.max_model_len // config.block_size)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory ({budget} bytes) holds no KV block of {per_block} bytes")
    return int(min(num_blocks, max(needed * config.max_num_seqs, needed)))
