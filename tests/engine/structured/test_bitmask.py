"""Bitmasks as tensors: applied to the constrained rows only, with no host-device sync."""

from __future__ import annotations

import os
import re
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.runners.test_device_syncs import SyncRecorder
from twostroke.engine.structured import (
    allocate_bitmask,
    apply_bitmask,
    bitmask_row,
    bitmask_rows,
)
from twostroke.states.constraints import bitmask_words, read_bitmask, write_bitmask


def expected(logits: torch.Tensor, allowed: dict[int, set[int]], width: int) -> torch.Tensor:
    """The plain way: -inf for each constrained row's token that is not allowed."""
    result = logits.clone()
    for row, tokens in allowed.items():
        for token in range(logits.shape[1]):
            if token >= width or token not in tokens:
                result[row, token] = float("-inf")
    return result


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, dict[int, set[int]], int]:
    batch = draw(st.integers(1, 5))
    vocab = draw(st.integers(1, 100))
    # the tokenizer's vocabulary may be narrower or wider than the logits
    mask_vocab = draw(st.integers(1, 110))
    rows = draw(st.sets(st.integers(0, batch - 1), max_size=batch))
    allowed = {row: draw(st.sets(st.integers(0, mask_vocab - 1), min_size=1)) for row in rows}
    logits = torch.randn(
        batch, vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    )
    return logits, allowed, mask_vocab


@settings(max_examples=60)
@given(cases(), st.booleans())
def test_apply_bitmask_masks_exactly_the_disallowed_tokens_of_constrained_rows(
    case: tuple[torch.Tensor, dict[int, set[int]], int], every_row: bool
) -> None:
    logits, allowed, mask_vocab = case
    if every_row:  # one bitmask row per batch row, no index
        allowed = {row: allowed.get(row, set(range(mask_vocab))) for row in range(len(logits))}
    order = sorted(allowed)
    bitmask = allocate_bitmask(len(order), mask_vocab)
    for index, row in enumerate(order):
        write_bitmask(allowed[row], bitmask_row(bitmask, index))
    width = 32 * bitmask_words(mask_vocab)
    want = expected(logits, allowed, width)
    rows = None if every_row else torch.tensor(order, dtype=torch.int64)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, want)


def test_unconstrained_rows_are_not_touched() -> None:
    logits = torch.arange(12.0).reshape(3, 4)
    bitmask = allocate_bitmask(1, 4)
    write_bitmask({1, 3}, bitmask_row(bitmask, 0))
    apply_bitmask(logits, bitmask, torch.tensor([1]))
    inf = float("-inf")
    assert logits.tolist() == [[0, 1, 2, 3], [inf, 5, inf, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_any_floating_dtype(dtype: torch.dtype) -> None:
    logits = torch.zeros(2, 40, dtype=dtype)
    bitmask = allocate_bitmask(2, 40)
    write_bitmask({0, 39}, bitmask_row(bitmask, 0))
    write_bitmask({33}, bitmask_row(bitmask, 1))
    apply_bitmask(logits, bitmask)
    assert logits.dtype == dtype
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 0], [0, 39], [1, 33]]


def test_applying_a_bitmask_never_synchronizes_the_host() -> None:
    """No op that would make the host wait for a CUDA device (tests/engine/runners)."""
    logits = torch.randn(6, 300)
    bitmask = allocate_bitmask(3, 280)
    bitmask_rows(bitmask)  # (no device work: a view)
    for index in range(3):
        write_bitmask(range(index, 280, 3), bitmask_row(bitmask, index))
    rows = torch.tensor([4, 0, 2])
    with SyncRecorder() as recorder:
        apply_bitmask(logits, bitmask, rows)
        apply_bitmask(logits, allocate_bitmask(6, 400))
    assert recorder.syncs == []
    assert torch.isinf(logits).all()


@pytest.mark.cuda
def test_apply_bitmask_on_cuda_matches_the_cpu() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 49_152)
    bitmask = allocate_bitmask(3, 49_152, pin_memory=True)
    for index in range(3):
        write_bitmask(range(index, 49_152, 7), bitmask_row(bitmask, index))
    rows = torch.tensor([7, 1, 4])
    on_device = logits.cuda()
    apply_bitmask(
        on_device, bitmask.to("cuda", non_blocking=True), rows.to("cuda", non_blocking=True)
    )
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(on_device.cpu(), logits)


def test_bitmask_rows_are_views_of_the_tensor() -> None:
    bitmask = allocate_bitmask(2, 33)
    assert (bitmask.dtype, tuple(bitmask.shape)) == (torch.int32, (2, 2))
    assert not bitmask.is_pinned()
    write_bitmask({0, 32}, bitmask_row(bitmask, 1))
    assert bitmask.tolist() == [[0, 0], [1, 1]]
    assert read_bitmask(bitmask_rows(bitmask)) == {64, 96}
    assert bitmask_rows(bitmask).nbytes == 16


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_large_bitmask_is_allocated_without_an_openmp_team() -> None:
    """The bookkeeping stroke allocates masks on the event loop's thread: a torch fill of
    64 rows of SmolLM2's vocabulary there would start an OpenMP team of that thread's own
    (a second one beside the forward thread's, which makes GNU OpenMP stop spinning). On
    a fresh thread with two torch threads, the allocation leaves the process's threads as
    they were, and the mask zeroed."""
    from twostroke.gpu.threads import torch_threads

    counts: list[int] = []
    masks: list[torch.Tensor] = []

    def allocate() -> None:
        with torch_threads(2):
            counts.append(len(os.listdir("/proc/self/task")))
            masks.append(allocate_bitmask(64, 49152))
            counts.append(len(os.listdir("/proc/self/task")))

    thread = threading.Thread(target=allocate)
    thread.start()
    thread.join()
    assert counts[1] == counts[0]
    [mask] = masks
    assert mask.shape == (64, bitmask_words(49152))
    assert not mask.any()


BAD_HOST_BITMASKS = [
    (torch.zeros(2, 3, dtype=torch.int64), "2-D torch.int64 on cpu"),
    (torch.zeros(3, dtype=torch.int32), "1-D torch.int32 on cpu"),
    (torch.zeros(2, 3, dtype=torch.int32, device="meta"), "2-D torch.int32 on meta"),
]


@pytest.mark.parametrize(("bitmask", "got"), BAD_HOST_BITMASKS)
def test_rows_come_from_a_2d_int32_host_bitmask(bitmask: torch.Tensor, got: str) -> None:
    message = f"a bitmask must be a 2-D int32 tensor on the CPU, got {got}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        bitmask_row(bitmask, 0)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        bitmask_rows(bitmask)
    with pytest.raises(ValueError, match=r"^a bitmask must be contiguous$"):
        bitmask_rows(torch.zeros(3, 2, dtype=torch.int32).t())


APPLY_ERRORS = [
    (
        (torch.zeros(4), allocate_bitmask(1, 4), None),
        "apply_bitmask takes 2-D logits and a 2-D int32 bitmask, got 1-D logits and a 2-D "
        "torch.int32 bitmask",
    ),
    (
        (torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int64), None),
        "apply_bitmask takes 2-D logits and a 2-D int32 bitmask, got 2-D logits and a 2-D "
        "torch.int64 bitmask",
    ),
    (
        (torch.zeros(2, 4), allocate_bitmask(1, 4), None),
        "the bitmask has 1 rows for 2 constrained batch rows",
    ),
    (
        (torch.zeros(2, 4), allocate_bitmask(1, 4), torch.tensor([0, 1])),
        "the bitmask has 1 rows for 2 constrained batch rows",
    ),
    (
        (torch.zeros(2, 4), allocate_bitmask(1, 4), torch.tensor([0], dtype=torch.int32)),
        "rows must be a 1-D int64 tensor, got 1-D torch.int32",
    ),
    (
        (torch.zeros(2, 4), allocate_bitmask(1, 4).to("meta"), None),
        "the bitmask and rows must be on the logits' device (cpu), got meta and None",
    ),
    (
        (torch.zeros(2, 4), allocate_bitmask(1, 4), torch.tensor([0], device="meta")),
        "the bitmask and rows must be on the logits' device (cpu), got cpu and meta",
    ),
]


@pytest.mark.parametrize(("arguments", "message"), APPLY_ERRORS)
def test_apply_bitmask_checks_its_tensors(
    arguments: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        apply_bitmask(*arguments)
