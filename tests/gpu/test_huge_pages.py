"""Buffers in huge pages: how they are carved and advised."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from twostroke.gpu import huge_pages
from twostroke.gpu.huge_pages import HUGE_PAGE, huge_page_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_views_are_carved_on_cache_lines_apart_and_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    advised: list[tuple[int, int, int]] = []

    def madvise(mapping: mmap.mmap, advice: int, offset: int, length: int) -> None:
        advised.append((torch.frombuffer(mapping, dtype=torch.uint8).data_ptr() + offset,
                        length, advice))  # fmt: skip

    monkeypatch.setattr(huge_pages, "_MADV_HUGEPAGE", 14)
    monkeypatch.setattr(huge_pages, "_madvise", madvise)
    counts = [3, 0, HUGE_PAGE // 8, 1000]  # float32: the third is half a huge page
    views = huge_page_buffer(counts, torch.float32)
    assert [v.numel() for v in views] == counts
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in views)
    filled = [v for v in views if v.numel()]  # (an empty one's address is 0)
    starts = [v.data_ptr() for v in filled]
    assert all(start % 64 == 0 for start in starts)
    assert starts[0] % HUGE_PAGE == 0
    ends = [v.data_ptr() + v.numel() * 4 for v in filled]
    assert all(end <= later for end, later in zip(ends, starts[1:], strict=False))
    # Only the whole huge pages of the buffer are advised: here there is none.
    assert advised == []
    large = huge_page_buffer([HUGE_PAGE + 5], torch.uint8)
    assert advised == [(large[0].data_ptr(), HUGE_PAGE, 14)]
    for view in views:
        view.fill_(7.0)
    del large
    assert all(bool((v == 7.0).all()) for v in views)  # one allocation, kept by its views


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError, match=r"counts must be >= 0, got \[4, -1\]"):
        huge_page_buffer([4, -1], torch.bfloat16)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's here")
def test_linux_takes_the_advice_where_transparent_huge_pages_are_on() -> None:
    mode = THP.read_text() if THP.exists() else "[never]"
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages are off here: {mode.strip()}")
    mapping = mmap.mmap(-1, 3 * HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    offset = -torch.frombuffer(mapping, dtype=torch.uint8).data_ptr() % HUGE_PAGE
    assert huge_pages._advise(mapping, offset, HUGE_PAGE)
    assert not huge_pages._advise(mapping, offset, HUGE_PAGE - 1)  # less than one: no ask


def test_without_madvise_the_buffer_is_an_ordinary_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "_MADV_HUGEPAGE", None)
    (view,) = huge_page_buffer([3 * HUGE_PAGE], torch.uint8)
    mapping = mmap.mmap(-1, 3 * HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    assert not huge_pages._advise(mapping, 0, 3 * HUGE_PAGE)
    view.fill_(1)
    assert int(view.sum()) == 3 * HUGE_PAGE
