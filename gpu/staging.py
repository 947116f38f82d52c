"""Staging host data for the device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device"]


def to_device(
    values: Sequence[int] | Sequence[float],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """A host list as a device tensor, without waiting for the device.

    On CUDA a plain ``torch.tensor(values, device=...)`` copies from pageable memory, which
    synchronizes with the work already queued: the step being built would wait for the one
    in flight. Staging through pinned memory with a non-blocking copy keeps the queue full
    (the caching host allocator keeps the pinned buffer until the copy is done).
    """
    if device.type == "cuda":
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)
