"""Engine configuration: one frozen value, validated when built."""

from __future__ import annotations

from typing import Any, Literal

import attrs

__all__ = ["EngineConfig"]


def _optional_at_least(minimum: int) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{attribute.name} must be an int, got {type(value).__name__} {value!r}"
            )
        if value < minimum:
            raise ValueError(f"{attribute.name} must be >= {minimum}, got {value}")

    return check


def _check_kv_memory(_: object, __: object, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"kv_cache_memory must be bytes (int) or a fraction (float), got {value!r}")
    if isinstance(value, float) and not 0 < value < 1:
        raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1), got {value}")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"kv_cache_memory in bytes must be >= 1, got {value}")


def _check_choice(*choices: object) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            allowed = ", ".join(repr(choice) for choice in choices)
            raise ValueError(f"{attribute.name} must be one of {allowed}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How an engine batches, how much KV memory it takes, and how it shuts down.

    Args:
        block_size: Token positions per KV block.
        num_blocks: KV blocks in the pool; ``None`` sizes the pool from ``kv_cache_memory``.
        kv_cache_memory: KV cache budget when ``num_blocks`` is ``None``: bytes (``int``) or
            a fraction of the device's free memory (``float`` in (0, 1)). ``None`` takes
            half the free memory on CUDA and 1 GiB on the CPU (whose memory the rest of the
            program shares).
        max_num_batched_tokens: Token budget of one step (chunked prefill splits longer
            prompts).
        max_num_seqs: The most requests running at once.
        max_model_len: Context length; ``None`` takes the model's.
        pipeline_depth: 2 plans step N+1 while step N runs (the default); 1 is serial.
        shutdown: Leaving the ``async with`` block normally ``"drain"``s open requests, or
            ``"cancel"``s them.
        dtype: Weights and activations: ``"auto"`` (bfloat16 where the device computes it
            fast, else float32 on the CPU and float16 on CUDA), ``"float32"``,
            ``"bfloat16"`` or ``"float16"``.
        torch_threads: torch's intra-op threads for the forward pass (process-wide). ``None``
            takes one fewer than the cores on the CPU (the event loop thread runs the
            bookkeeping stroke meanwhile) and leaves torch's default on CUDA.
    """

    block_size: int = attrs.field(default=16, validator=_optional_at_least(1))
    num_blocks: int | None = attrs.field(default=None, validator=_optional_at_least(1))
    kv_cache_memory: int | float | None = attrs.field(default=None, validator=_check_kv_memory)
    max_num_batched_tokens: int = attrs.field(default=512, validator=_optional_at_least(1))
    max_num_seqs: int = attrs.field(default=64, validator=_optional_at_least(1))
    max_model_len: int | None = attrs.field(default=None, validator=_optional_at_least(2))
    pipeline_depth: int = attrs.field(default=2, validator=_check_choice(1, 2))
    shutdown: Literal["drain", "cancel"] = attrs.field(
        default="drain", validator=_check_choice("drain", "cancel")
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = attrs.field(
        default="auto", validator=_check_choice("auto", "float32", "bfloat16", "float16")
    )
    torch_threads: int | None = attrs.field(default=None, validator=_optional_at_least(1))
