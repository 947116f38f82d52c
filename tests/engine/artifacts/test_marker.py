"""The artifact cache removes only what it wrote: its folder carries a marker the cache
wrote when it made the folder (or found it empty), an entry is a folder whose record names
its path, and outside a marked folder nothing is removed and no mode changes."""

from __future__ import annotations

import argparse
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from twostroke.engine.artifacts.cache import (
    CACHE_DIR_ENV,
    MARKER,
    NATIVE_FOLDER,
    SOURCE_RECORD,
    ArtifactCache,
    UnmarkedCache,
)
from twostroke.engine.artifacts.command import cache_command

#: A folder of a user's own that holds everything the cache once took for its own: names
#: like an entry's, a folder holding a file called ``source`` (naming a file that is gone),
#: ``native/``, and a temporary name.
USER_FILES = {
    "photos-0123456789abcdef/cat.jpg": "meow",
    "project/source": "/nowhere/model.gguf\n",
    "project/main.c": "int main(void) { return 0; }",
    f"{NATIVE_FOLDER}/libmine.so": "ELF",
    ".draft.tmp": "unsaved",
    "notes.txt": "a user's file",
}


def user_folder(root: Path) -> dict[str, str]:
    for name, text in USER_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.chmod(0o755)
    return dict(USER_FILES)


def contents(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the cache's own entries, with its text."""
    return {
        path.relative_to(root).as_posix(): path.read_text()
        for path in root.rglob("*")
        if path.is_file()
    }


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def files(**texts: str) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        folder.mkdir()
        for name, text in texts.items():
            (folder / name).write_text(text)

    return write


UNMARKED = (
    r"twostroke cache {action} removes entries only from a folder the cache made, which "
    r"holds its CACHEDIR\.TAG; {root} holds none \(a folder of yours, or an older twostroke's "
    r"cache\), so nothing was removed"
)


def test_clear_and_prune_refuse_a_folder_of_the_user_and_leave_it_as_it_was(
    tmp_path: Path,
) -> None:
    root = tmp_path / "mine"
    before = user_folder(root)
    cache = ArtifactCache(root, limit=1)
    for action, call in (
        ("clear", cache.clear),
        ("prune", lambda: cache.prune(limit=1)),
    ):
        with pytest.raises(UnmarkedCache, match=UNMARKED.format(action=action, root=root)):
            call()
    assert cache.evict() == []
    assert cache.entries() == []  # nothing here is the cache's
    assert contents(root) == before
    assert mode(root) == 0o755


def test_the_first_load_into_a_folder_of_the_user_removes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "mine"
    before = user_folder(root)
    cache = ArtifactCache(root, limit=1)  # every store is past the limit
    model = tmp_path / "models" / "model.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF")
    entry = cache.prepare(model)
    with caplog.at_level(logging.WARNING):
        assert cache.store(entry / "model-float32", files(weights="1234"))
        assert cache.store(root / NATIVE_FOLDER / "lib-0123456789abcdef", files(a="lib"))
    # Said once a process, not at every store (a model's first load stores three artifacts).
    assert caplog.text.count("nothing in it is evicted") == 1
    after = contents(root)
    assert {name: after[name] for name in before} == before
    assert not (root / MARKER).exists()  # not the cache's to mark: it held the user's files
    assert mode(root) == 0o755
    assert {found.path for found in cache.entries()} == {
        entry,
        root / NATIVE_FOLDER / "lib-0123456789abcdef",
    }


def test_cache_clear_on_a_folder_of_the_user_says_why_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "mine"
    before = user_folder(root)
    monkeypatch.setenv(CACHE_DIR_ENV, str(root))
    for action in ("clear", "prune"):
        status = cache_command(argparse.Namespace(cache_action=action, max_size=None, keep=None))
        assert status == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        message = UNMARKED.format(action=action, root=root).replace("\\", "")
        assert captured.err.startswith(f"twostroke cache: error: {message}")
    assert contents(root) == before


def test_a_folder_the_cache_creates_is_marked_and_cleared(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "new" / "cache", limit=None)
    assert not cache.marked()
    artifact = cache.root / "m.gguf-0123456789abcdef" / "model-float32"
    assert cache.store(artifact, files(w="1"))
    assert cache.marked()
    assert mode(cache.root / MARKER) == 0o600
    assert (
        (cache.root / MARKER)
        .read_text()
        .startswith("Signature: 8a477f597d28d172789f06886806bc55\n")
    )
    assert not (tmp_path / "new" / MARKER).exists()  # only the cache folder is marked
    assert [found.path for found in cache.clear()] == [artifact.parent]


def test_a_library_first_marks_the_folder_before_native_fills_it(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", limit=None)
    assert cache.store(cache.root / NATIVE_FOLDER / "lib-0123456789abcdef", files(a="lib"))
    assert cache.marked()


def test_an_empty_folder_is_adopted(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    cache = ArtifactCache(root, limit=None)
    assert cache.clear() == []  # nothing to remove, and nothing written or changed
    assert not cache.marked()
    assert cache.store(root / "m.gguf-0123456789abcdef" / "model-float32", files(w="1"))
    assert cache.marked()
    assert len(cache.clear()) == 1


def test_an_older_twostrokes_cache_is_used_but_never_emptied(tmp_path: Path) -> None:
    """A cache folder an older twostroke made holds no marker: its entries are listed and
    read, and new ones stored, but nothing in it is removed."""
    older = ArtifactCache(tmp_path / "cache", limit=None)
    artifact = older.root / "m.gguf-0123456789abcdef" / "model-float32"
    assert older.store(artifact, files(w="1"))
    (older.root / MARKER).unlink()  # as an older twostroke left it
    cache = ArtifactCache(older.root, limit=1)
    assert [found.path for found in cache.entries()] == [artifact.parent]
    assert cache.open(artifact) is not None
    assert cache.store(older.root / "n.gguf-0123456789abcdef" / "model-float32", files(w="2"))
    assert len(cache.entries()) == 2  # over the limit, and nothing evicted
    with pytest.raises(UnmarkedCache, match="an older twostroke's cache"):
        cache.clear()
    assert len(cache.entries()) == 2
    assert not cache.marked()


@pytest.mark.parametrize(
    "forge",
    [
        lambda marker: marker.write_text("Signature: 8a477f597d28d172789f06886806bc55\n"),
        lambda marker: marker.symlink_to(marker.with_name("elsewhere")),
        lambda marker: marker.mkdir(),
        lambda marker: (marker.write_text(_text_of_a_marker()), marker.chmod(0o666)),
    ],
    ids=["another tool's tag", "a link", "a folder", "writable by others"],
)
def test_only_a_marker_of_the_cache_marks_a_folder(
    tmp_path: Path, forge: Callable[[Path], object]
) -> None:
    made = ArtifactCache(tmp_path / "made")
    assert made.store(made.root / "x-0123456789abcdef" / "t", files(a="1"))
    (tmp_path / "elsewhere").write_text((made.root / MARKER).read_text())
    root = tmp_path / "mine"
    user_folder(root)
    forge(root / MARKER)
    cache = ArtifactCache(root)
    assert not cache.marked()
    with pytest.raises(UnmarkedCache):
        cache.clear()


def _text_of_a_marker() -> str:
    return (
        "Signature: 8a477f597d28d172789f06886806bc55\n"
        "# This folder is twostroke's artifact cache, which made it: `twostroke cache clear` "
        "empties it.\n"
        "# For information about cache directory tags, see https://bford.info/cachedir/\n"
    )


def test_the_marker_text(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    assert cache.store(cache.root / "x-0123456789abcdef" / "t", files(a="1"))
    assert (cache.root / MARKER).read_text() == _text_of_a_marker()


def test_in_a_marked_folder_only_entries_with_a_record_naming_them_go(tmp_path: Path) -> None:
    """Even in the cache's own folder, a folder named like an entry, one holding a file
    called ``source``, a moved entry and an odd temporary name are not the cache's."""
    cache = ArtifactCache(tmp_path / "cache", limit=None)
    entry = cache.root / "m.gguf-0123456789abcdef"
    assert cache.store(entry / "model-float32", files(w="1"))
    moved = cache.root / "moved-0123456789abcdef"
    assert cache.store(cache.root / "x.gguf-0123456789abcdef" / "t", files(a="1"))
    os.rename(cache.root / "x.gguf-0123456789abcdef", moved)  # its record names another path
    strangers = {
        "look-alike-0123456789abcdef/file": "kept",
        "holder/source": "/nowhere/model.gguf\n",
        f"{NATIVE_FOLDER}/libmine.so": "ELF",
        f"{NATIVE_FOLDER}/unrecorded-0123456789abcdef/lib.so": "ELF",
        ".notes.tmp": "kept",
        ".a.0123.tmp": "kept",
    }
    for name, text in strangers.items():
        (cache.root / name).parent.mkdir(parents=True, exist_ok=True)
        (cache.root / name).write_text(text)
        os.utime(cache.root / name, (0, 0))  # old enough to be a crashed writer's
    leftover = cache.root / f".m.gguf-0123456789abcdef.{'ab' * 16}.tmp"
    leftover.write_text("a crashed writer's")
    os.utime(leftover, (0, 0))
    assert [found.path for found in cache.entries()] == [entry]
    assert cache.prune(limit=None) == []
    assert not leftover.exists()
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    fresh = cache.prepare(model)  # "holder" records a file that is gone: not an entry
    assert {found.path for found in cache.clear()} == {entry, fresh}
    left = contents(cache.root)
    assert {name: left[name] for name in strangers} == strangers
    assert moved.exists()


def test_prepare_records_the_entry_it_names(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    entry = cache.prepare(model)
    assert [found.path for found in cache.entries()] == [entry]  # a record, no artifact yet
    assert [found.source for found in cache.entries()] == [str(model.resolve())]
    (entry / SOURCE_RECORD).write_text(f"{model.resolve()}\n")  # as an older twostroke wrote it
    assert cache.entries() == []
    assert cache.prepare(model) == entry
    assert [found.path for found in cache.entries()] == [entry]


def test_cache_lists_an_unmarked_folder_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    older = ArtifactCache(tmp_path / "cache", limit=None)
    assert older.store(older.root / "m.gguf-0123456789abcdef" / "t", files(a="1"))
    monkeypatch.setenv(CACHE_DIR_ENV, str(older.root))
    status = cache_command(argparse.Namespace(cache_action="list"))
    assert status == 0
    assert "note:" not in capsys.readouterr().out
    (older.root / MARKER).unlink()
    assert cache_command(argparse.Namespace(cache_action="list")) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "note: it holds no CACHEDIR.TAG of the cache's (a folder of yours, or an older "
        "twostroke's cache): nothing in it is evicted, pruned or cleared; if it holds only "
        "twostroke's cache, delete it and the next load makes it afresh"
    )
