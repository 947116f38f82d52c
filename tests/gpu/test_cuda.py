"""The device layer on a real GPU (marked ``cuda``: skipped without one; scripts/gpu_check.sh).

Everything here also has a CPU-only test of the same code through fakes; these check that the
fakes told the truth about CUDA.
"""

from __future__ import annotations

import pytest
import torch

from twostroke.gpu.completion import Completion, Launched
from twostroke.gpu.device import CudaDevice

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]


def _matmuls(device: torch.device, on: list[int]) -> Launched[float]:
    """Queue some seconds' worth of nothing much, record an event after it."""
    on.append(torch.cuda.current_device())
    x = torch.randn(2048, 2048, device=device)
    for _ in range(20):
        x = torch.tanh(x @ x)
    event = torch.cuda.Event()
    event.record()
    return Launched(event=event, readback=lambda: float(x[0, 0].item()), keepalive=(x,))


@pytest.mark.parametrize("in_block", [True, False], ids=["forward-thread", "worker-threads"])
async def test_a_completion_polls_a_real_cuda_event(in_block: bool) -> None:
    index = torch.cuda.device_count() - 1  # the last GPU: not the loop thread's current one
    device = CudaDevice(index)
    on: list[int] = []
    completion: Completion[float] = Completion()
    if in_block:
        async with device:
            await device.run(lambda: _matmuls(device.torch_device, on), completion)
            value = await completion
    else:
        await device.run(lambda: _matmuls(device.torch_device, on), completion)
        value = await completion
    assert on == [index]
    assert -1.0 <= value <= 1.0
    assert completion.statistics().polls >= 1


async def test_a_live_gpu_passes_its_probe() -> None:
    device = CudaDevice(0)
    await device.probe()
    async with device:
        await device.probe()
