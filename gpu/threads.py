"""torch's intra-op thread count, set for a block and restored after it.

torch keeps one process-wide count of intra-op (OpenMP) threads. Several parts of twostroke
want a different count for a while: loading and weight packing are memory-bound and run
best on one thread; a benchmark gives each system the same cores; tests run on one thread
on a shared machine. Each such place uses :func:`torch_threads`, so none leaves its setting
behind for the next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from twostroke.gpu.validators import check_int_at_least

__all__ = ["torch_threads"]


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run the block with torch's intra-op thread count at ``threads``, then restore it.

    The count is restored also when the block raises or is cancelled. Enter it in the
    thread that runs the work: ATen fixes a thread's OpenMP team size when that thread
    first computes, so a thread that has already run torch keeps its count when another
    thread changes it (measured: a worker thread stayed at 2 after the main thread set 1),
    while threads that start computing later take the new count.

    Args:
        threads: Threads for the block (>= 1); ``None`` leaves the count as it is.

    Yields:
        The thread count inside the block.

    Raises:
        TypeError: ``threads`` is not an int (or ``None``).
        ValueError: ``threads`` is less than 1.
    """
    if threads is not None:
        check_int_at_least("threads", threads, 1)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
