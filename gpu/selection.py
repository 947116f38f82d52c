"""Which device a name means: ``select_device("cpu")``, ``Engine.open(device="fake")``.

Apart from :mod:`twostroke.gpu.device` because the kinds include the fake device of
:mod:`twostroke.gpu.fake`, which builds on the devices there: this module depends on both, and
neither on it.
"""

from __future__ import annotations

import torch

from twostroke.gpu.device import CpuDevice, CudaDevice, Device, DeviceUnavailable
from twostroke.gpu.fake import FakeDevice
from twostroke.gpu.validators import check_int_at_least

__all__ = ["DEVICE_KINDS", "resolve_device", "select_device"]

#: The names a device can be given by.
DEVICE_KINDS = ("auto", "cuda", "cpu", "fake")


def select_device(kind: str = "auto", *, index: int = 0) -> Device:
    """Return the device of the given kind.

    Args:
        kind: ``"auto"`` (CUDA if torch sees a GPU, else the CPU), ``"cuda"``, ``"cpu"`` or
            ``"fake"`` (:class:`~twostroke.gpu.fake.FakeDevice` with ``step_time=0.0``).
        index: The CUDA device index; ignored by the other kinds.

    Returns:
        A new device.

    Raises:
        TypeError: ``kind`` is not a string or ``index`` not an int.
        ValueError: ``kind`` is not one of the kinds above, or ``index`` is negative.
        DeviceUnavailable: ``"cuda"`` was asked for without CUDA, or ``index`` is not a GPU
            of this machine.
    """
    if not isinstance(kind, str):
        raise TypeError(f"device kind must be a string, got {type(kind).__name__} {kind!r}")
    if kind not in DEVICE_KINDS:
        accepted = ", ".join(repr(k) for k in DEVICE_KINDS)
        raise ValueError(f"device kind must be one of {accepted}, got {kind!r}")
    check_int_at_least("index", index, 0)
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return CpuDevice()
    if kind == "fake":
        return FakeDevice(step_time=0.0)
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            "device kind 'cuda' needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailable(f"cuda index must be < {count} (the visible GPUs), got {index}")
    return CudaDevice(index)


def resolve_device(device: object) -> Device:
    """The device that ``Engine.open(device=...)`` names: a :class:`Device` or a kind.

    Args:
        device: A :class:`Device`, or a kind that :func:`select_device` takes.

    Returns:
        ``device`` itself, or a new device of that kind.

    Raises:
        TypeError: ``device`` is neither a :class:`Device` nor a string; the message names
            the accepted values.
        ValueError, DeviceUnavailable: as :func:`select_device`.
    """
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        return select_device(device)
    accepted = ", ".join(repr(kind) for kind in DEVICE_KINDS)
    raise TypeError(
        f"device must be a Device or one of {accepted}, got {type(device).__name__} {device!r}"
    )
