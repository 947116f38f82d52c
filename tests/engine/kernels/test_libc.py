"""Freed memory handed back to the OS: glibc's ``malloc_trim``, where the C library has it."""

from __future__ import annotations

import ctypes.util
import sys

import pytest

from twostroke.engine.kernels import libc


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or "libc.so" not in str(ctypes.util.find_library("c")),
    reason="glibc's malloc_trim is a Linux C library's",
)
def test_the_c_library_trims_where_it_can() -> None:
    assert libc._malloc_trim() is not None
    assert isinstance(libc.release_free_memory(), bool)


def test_without_malloc_trim_nothing_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(libc, "_malloc_trim", lambda: None)
    assert libc.release_free_memory() is False


def test_the_answer_is_whether_memory_was_released(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def trim(pad: int) -> int:
        asked.append(pad)
        return len(asked) % 2  # released, then not

    monkeypatch.setattr(libc, "_malloc_trim", lambda: trim)
    assert libc.release_free_memory() is True
    assert libc.release_free_memory() is False
    assert asked == [0, 0]  # no padding kept at the heap's top
