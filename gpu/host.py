"""The host machine, as Linux describes it under ``/proc``: its CPU and its free memory.

Read when a device, a policy or the benchmark asks, and at import time only where
``TWOSTROKE_CPU_ISA`` asks for a personality (:mod:`twostroke.gpu.isa` checks it against the
CPU's flags before torch dispatches). Off Linux (no ``/proc``) the CPU has no known flags or
name, and the free memory is what ``os.sysconf`` reports.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["available_memory", "cpu_flags", "cpu_model_name", "cpuinfo_text"]

_CPUINFO = Path("/proc/cpuinfo")
_MEMINFO = Path("/proc/meminfo")


def cpuinfo_text() -> str:
    """The text of ``/proc/cpuinfo``, read once in a process (``""`` off Linux).

    Every reader of the CPU's description calls this: the flags and the model name here,
    :mod:`twostroke.gpu.isa`'s checks at import, the kernels' build identity. The file
    describes hardware that does not change while the process runs, and reading it costs
    a few milliseconds on a machine of many cores (one stanza per core).
    """
    return _read_once(_CPUINFO)


@functools.cache
def _read_once(path: Path) -> str:
    # Keyed by the path, so a test that points _CPUINFO elsewhere reads that file.
    try:
        return path.read_text()
    except OSError:  # not Linux
        return ""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (``avx2``, ``avx512_bf16``, ...), from its ``flags`` lines.

    Args:
        cpuinfo: The text of ``/proc/cpuinfo``; ``None`` reads this machine's.
    """
    text = cpuinfo_text() if cpuinfo is None else cpuinfo
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return frozenset(flags)


def cpu_model_name(cpuinfo: str | None = None) -> str | None:
    """The CPU's model name (``"AMD EPYC 9R14 96-Core Processor"``), or ``None`` if unknown.

    Args:
        cpuinfo: The text of ``/proc/cpuinfo``; ``None`` reads this machine's.
    """
    text = cpuinfo_text() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return None


def available_memory() -> int:
    """Bytes of memory available to a new allocation without swapping.

    ``MemAvailable`` of ``/proc/meminfo`` (free memory plus what the kernel can reclaim), or
    the free pages ``os.sysconf`` reports where there is no such file.
    """
    try:
        with _MEMINFO.open(encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
