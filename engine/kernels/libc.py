"""The one call twostroke makes into the C library itself: freed memory handed back.

A model's weights are read dense and then laid out in their compiled form (panels, packed
or quantized copies), the dense tensors dropped one by one. Each is a few MB, which glibc's
``malloc`` serves from its heap once its threshold for separate mappings has grown past
them (it grows to the largest block freed, up to 32 MiB), and a heap keeps the pages of the
blocks freed inside it: SmolLM2's bfloat16 model held 221 MB of freed dense weights after
its load (RSS 789 MB against 568 after ``malloc_trim(0)``, which took 7 ms; Intel Xeon,
2026-12-05). :func:`release_free_memory` asks for them back; where the C library has no
``malloc_trim`` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["release_free_memory"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    try:
        library = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:  # no C library ctypes can open by that name
        return None
    trim = getattr(library, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    found: Callable[[int], int] = trim
    return found


def release_free_memory() -> bool:
    """Hand the pages of the C heap's free blocks back to the OS (``malloc_trim(0)``).

    Returns:
        Whether any memory was released (``False`` also where there is no ``malloc_trim``).
    """
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))
