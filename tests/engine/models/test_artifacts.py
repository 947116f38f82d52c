"""The artifact cache: where it lives, how entries are keyed, atomic writes, stale folders."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from twostroke.engine.models.artifacts import (
    CACHE_DIR_ENV,
    NO_CACHE_ENV,
    SOURCE_RECORD,
    ArtifactCache,
)


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


def _model(folder: Path, name: str = "model.gguf", contents: bytes = b"GGUF") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / name
    model.write_bytes(contents)
    return model


def _fill(entry: Path) -> None:
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "weights.bin").write_bytes(b"weights")


def test_prepare_records_the_source_in_its_folder(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    model = _model(tmp_path / "models")
    entry = cache.prepare(tmp_path / "models" / "." / "model.gguf")
    assert entry == cache.entry(model)
    assert (entry / SOURCE_RECORD).read_text() == f"{model.resolve()}\n"
    assert cache.prepare(model) == entry  # again: nothing changes
    assert sorted(path.name for path in cache.root.iterdir()) == [entry.name]


def test_a_changed_file_replaces_its_older_folder(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    model = _model(tmp_path / "models")
    old = cache.prepare(model)
    _fill(old)
    model.write_bytes(b"GGUF, a newer version")
    new = cache.prepare(model)
    assert new != old
    assert not old.exists()
    assert [path.name for path in cache.root.iterdir()] == [new.name]


def test_folders_of_files_that_are_gone_are_removed(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    kept = _model(tmp_path / "venv-a" / "pkg")
    gone = _model(tmp_path / "venv-b" / "pkg")
    other = _model(tmp_path / "elsewhere", name="other.gguf")
    for source in (kept, gone, other):
        _fill(cache.prepare(source))
    gone.unlink()  # its virtual environment was deleted
    fresh = _model(tmp_path / "venv-c" / "pkg")
    cache.prepare(fresh)
    assert sorted(path.name for path in cache.root.iterdir()) == sorted(
        cache.entry(source).name for source in (kept, other, fresh)
    )


def test_folders_without_a_record_go_only_when_their_file_name_is_converted(
    tmp_path: Path,
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    legacy_same = cache.root / "model.gguf-0123456789abcdef"
    legacy_other = cache.root / "other.gguf-0123456789abcdef"
    stranger = cache.root / ".in-progress"
    for folder in (legacy_same, legacy_other, stranger):
        _fill(folder)
    (cache.root / "notes.txt").write_text("a user's file")
    entry = cache.prepare(_model(tmp_path / "models"))
    assert sorted(path.name for path in cache.root.iterdir()) == sorted(
        [entry.name, legacy_other.name, stranger.name, "notes.txt"]
    )


def test_an_unreadable_record_is_left_alone(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    odd = cache.root / "model.gguf-fedcba9876543210"
    (odd / SOURCE_RECORD).mkdir(parents=True)  # not a file: reading it fails
    entry = cache.prepare(_model(tmp_path / "models"))
    assert sorted(path.name for path in cache.root.iterdir()) == sorted([entry.name, odd.name])
