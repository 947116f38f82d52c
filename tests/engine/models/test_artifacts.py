"""The artifact cache: where it lives, how entries are keyed, and atomic writes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from twostroke.engine.models.artifacts import CACHE_DIR_ENV, NO_CACHE_ENV, ArtifactCache


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({CACHE_DIR_ENV: "/data/cache"}, "/data/cache"),
        ({CACHE_DIR_ENV: "/data/cache", "XDG_CACHE_HOME": "/xdg"}, "/data/cache"),
        ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/twostroke"),
        ({}, os.path.expanduser("~/.cache/twostroke")),
        ({CACHE_DIR_ENV: ""}, os.path.expanduser("~/.cache/twostroke")),
        ({CACHE_DIR_ENV: "/data/cache", NO_CACHE_ENV: "1"}, None),
        ({NO_CACHE_ENV: "0"}, os.path.expanduser("~/.cache/twostroke")),
    ],
)
def test_the_environment_chooses_the_folder(environ: dict[str, str], expected: str | None) -> None:
    cache = ArtifactCache.from_environment(environ)
    assert (None if cache is None else str(cache.root)) == expected


def test_entries_are_keyed_by_path_size_and_modification_time(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF one")
    first = cache.entry(model)
    assert first.parent == cache.root
    assert first.name.startswith("model.gguf-")
    assert cache.entry(tmp_path / "." / "model.gguf") == first  # the resolved path counts
    os.utime(model, ns=(0, 10**18))
    touched = cache.entry(model)
    assert touched != first
    model.write_bytes(b"GGUF two!")
    os.utime(model, ns=(0, 10**18))
    assert cache.entry(model) != touched  # same time, other size
    copy = tmp_path / "copy" / "model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(model.read_bytes())
    os.utime(copy, ns=(0, 10**18))
    assert cache.entry(copy) != cache.entry(model)
    assert not cache.root.exists()  # naming an entry writes nothing


def test_store_renames_a_finished_file_into_place(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    target = cache.root / "entry" / "weights.bin"
    seen: list[Path] = []

    def write(path: Path) -> None:
        assert not target.exists()  # nothing visible until the rename
        seen.append(path)
        path.write_bytes(b"data")

    assert cache.store(target, write)
    assert target.read_bytes() == b"data"
    assert seen[0].parent == target.parent
    assert seen[0] != target
    assert os.listdir(target.parent) == ["weights.bin"]


def test_a_failed_write_leaves_nothing_behind_and_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    target = cache.root / "entry" / "tokenizer"

    def write(path: Path) -> None:
        path.mkdir()
        (path / "half.json").write_text("{")
        raise RuntimeError("disk full")

    with caplog.at_level(logging.WARNING):
        assert not cache.store(target, write)
    assert os.listdir(target.parent) == []
    assert "cannot write" in caplog.text
    assert "RuntimeError: disk full" in caplog.text


def test_a_folder_stored_twice_keeps_the_first(tmp_path: Path) -> None:
    """Two processes converting at once: the second rename finds the folder in place."""
    cache = ArtifactCache(tmp_path / "cache")
    target = cache.root / "entry" / "tokenizer"

    def write(text: str) -> Callable[[Path], None]:
        def folder(path: Path) -> None:
            path.mkdir()
            (path / "tokenizer.json").write_text(text)

        return folder

    assert cache.store(target, write("first"))
    assert cache.store(target, write("second"))
    assert (target / "tokenizer.json").read_text() == "first"
    assert os.listdir(target.parent) == ["tokenizer"]


def test_an_unwritable_cache_is_skipped(tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the folder should be")
    cache = ArtifactCache(blocker)
    assert not cache.store(blocker / "entry" / "config.json", lambda path: path.write_text("{}"))
