"""Token bitmasks as torch tensors: allocated on the host, applied to a batch's logits.

The layout is the one of :mod:`twostroke.states.constraints` (and llguidance, xgrammar and
vLLM): ``int32`` words, bit ``t % 32`` of word ``t // 32`` for token ``t``. Matchers fill rows
on the host (:func:`bitmask_row` gives one row as the memoryview they write into); the
sampler applies them on the device with :func:`apply_bitmask`, to the constrained rows of the
batch only, with no operation that reads a device value back: on CUDA the host never waits
for the device in it (``tests/engine/structured/test_bitmask.py`` checks this the way
``tests/engine/runners/test_device_syncs.py`` checks the runner's launches).
"""

from __future__ import annotations

import numpy as np
import torch

from twostroke.states.constraints import bitmask_words

__all__ = ["allocate_bitmask", "apply_bitmask", "bitmask_row", "bitmask_rows"]


def allocate_bitmask(num_rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A host bitmask of ``num_rows`` rows, every bit clear (nothing allowed).

    Args:
        num_rows: How many rows (constrained requests).
        vocab_size: How many token ids a row covers.
        pin_memory: Page-locked, for an asynchronous copy to a CUDA device.

    Returns:
        A contiguous ``int32`` tensor of shape ``(num_rows, bitmask_words(vocab_size))``.

    Zeroed by numpy, not by a torch fill: the bookkeeping stroke allocates masks on the
    event loop's thread, where ATen would split a fill of more than 32768 words (22 rows of
    SmolLM2's vocabulary) among an OpenMP team of that thread's own, a second team beside
    the forward thread's for the rest of the thread's life, and with more OpenMP threads
    than cores GNU OpenMP stops spinning at the forward pass's barriers
    (:mod:`twostroke.gpu.openmp`).
    """
    shape = (num_rows, bitmask_words(vocab_size))
    if pin_memory:
        pinned = torch.empty(shape, dtype=torch.int32, pin_memory=True)
        pinned.numpy().fill(0)
        return pinned
    return torch.from_numpy(np.zeros(shape, dtype=np.int32))


def _check_host(bitmask: torch.Tensor) -> None:
    if bitmask.device.type != "cpu" or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(
            "a bitmask must be a 2-D int32 tensor on the CPU, got "
            f"{bitmask.dim()}-D {bitmask.dtype} on {bitmask.device}"
        )
    if not bitmask.is_contiguous():
        raise ValueError("a bitmask must be contiguous")


def bitmask_row(bitmask: torch.Tensor, index: int) -> memoryview:
    """Row ``index`` of a host bitmask, as the memoryview a matcher's ``fill_bitmask`` takes."""
    _check_host(bitmask)
    return bitmask[index].numpy().data


def bitmask_rows(bitmask: torch.Tensor) -> memoryview:
    """A whole host bitmask as one memoryview, for :func:`~.matcher.fill_bitmasks`."""
    _check_host(bitmask)
    return bitmask.numpy().data


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set to ``-inf``, in place, the logits of the tokens each constrained row does not allow.

    Only the rows named in ``rows`` change; the others (unconstrained requests) are not
    touched. Token ids past the bitmask's width (a model whose logits are wider than its
    tokenizer's vocabulary) are never allowed. A row with no bit set leaves nothing to
    sample: callers finish or fail such a request instead of sampling it.

    Args:
        logits: ``(batch, vocab)``, floating point, on any device.
        bitmask: ``(len(rows), words)`` int32 on the logits' device (row ``i`` for batch
            row ``rows[i]``).
        rows: The batch rows the bitmask's rows belong to (int64, on the logits' device);
            ``None`` when the bitmask has one row per batch row.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together (checked from the
            tensors' metadata only: nothing is read from the device).
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(
            f"apply_bitmask takes 2-D logits and a 2-D int32 bitmask, got {logits.dim()}-D "
            f"logits and a {bitmask.dim()}-D {bitmask.dtype} bitmask"
        )
    if bitmask.device != logits.device or (rows is not None and rows.device != logits.device):
        raise ValueError(
            f"the bitmask and rows must be on the logits' device ({logits.device}), got "
            f"{bitmask.device} and {None if rows is None else rows.device}"
        )
    expected = logits.shape[0] if rows is None else rows.shape[0]
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64):
        raise ValueError(f"rows must be a 1-D int64 tensor, got {rows.dim()}-D {rows.dtype}")
    if bitmask.shape[0] != expected:
        raise ValueError(
            f"the bitmask has {bitmask.shape[0]} rows for {expected} constrained batch rows"
        )
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).to(torch.bool).flatten(1)
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        padding = allowed.new_zeros((allowed.shape[0], vocab - allowed.shape[1]))
        allowed = torch.cat((allowed, padding), dim=1)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, rows, masked)
