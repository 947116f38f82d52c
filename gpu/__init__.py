"""The device and host boundary: devices (CUDA, CPU, fake), the completions of the steps
they run, and the host's CPU policy (its instruction set and personality, its cores, its
OpenMP threads, the dtype it computes in).

This package may import torch and anyio, never ``twostroke.engine`` or ``twostroke.states``.

Importing it sets process-wide variables that torch's libraries read once, when they first
load or dispatch, and so must precede any torch op: OpenMP's wait policy
(:mod:`twostroke.gpu.openmp`, unless the user chose one) and, where ``TWOSTROKE_CPU_ISA``
asks for a lower instruction set, the caps of ATen, oneDNN, MKL and fbgemm
(:mod:`twostroke.gpu.isa`). Nothing else is written.
"""

# First, before anything below imports torch: OpenMP reads its wait policy once, when torch
# loads it (see twostroke.gpu.openmp), and torch's libraries read their instruction-set caps
# when they first dispatch (see twostroke.gpu.isa).
import twostroke.gpu.isa
import twostroke.gpu.openmp  # noqa: F401

# isort: split
from twostroke.gpu.completion import (
    Completion,
    CompletionAlreadySet,
    CompletionError,
    CompletionNotDone,
    CompletionState,
    CompletionStatistics,
    Launched,
    PollSchedule,
    ReadyEvent,
    SupportsQuery,
)
from twostroke.gpu.device import CpuDevice, CudaDevice, Device, DeviceUnavailable
from twostroke.gpu.dtype import default_dtype
from twostroke.gpu.fake import CountdownEvent, FakeDevice, VirtualEvent
from twostroke.gpu.selection import select_device

__all__ = [
    "Completion",
    "CompletionAlreadySet",
    "CompletionError",
    "CompletionNotDone",
    "CompletionState",
    "CompletionStatistics",
    "CountdownEvent",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "DeviceUnavailable",
    "FakeDevice",
    "Launched",
    "PollSchedule",
    "ReadyEvent",
    "SupportsQuery",
    "VirtualEvent",
    "default_dtype",
    "select_device",
]
