"""The device boundary: devices (CUDA, CPU, fake) and the completions of the steps they run.

This package may import torch and anyio, never ``twostroke.engine`` or ``twostroke.states``.
"""

# First, before anything below imports torch: OpenMP reads its wait policy once, when torch
# loads it (see twostroke.gpu.openmp).
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
