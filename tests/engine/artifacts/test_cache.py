"""The artifact cache: where it lives, how entries are keyed, atomic writes, stale folders,
records and their checks, private modes, the size cap, eviction, pruning and clearing."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from twostroke.engine.artifacts import cache as artifacts
from twostroke.engine.artifacts.cache import (
    CACHE_DIR_ENV,
    CACHE_LIMIT_ENV,
    DEFAULT_LIMIT,
    LAST_USED,
    MARKER,
    NATIVE_FOLDER,
    NO_CACHE_ENV,
    SOURCE_RECORD,
    ArtifactCache,
    InvalidCacheLimit,
    format_size,
    parse_size,
)
from twostroke.engine.artifacts.records import (
    RECORD,
    DamagedArtifact,
    Provenance,
    Record,
    UnsafeCachePath,
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
    assert sorted(os.listdir(target.parent)) == [LAST_USED, "weights.bin"]


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
    assert sorted(os.listdir(target.parent)) == [LAST_USED, "tokenizer"]
    assert cache.open(target) is not None  # the record that stayed is the files' own


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
    assert json.loads((entry / SOURCE_RECORD).read_text()) == {
        "source": str(model.resolve()),
        "key": entry.name,
    }
    assert cache.prepare(model) == entry  # again: nothing changes
    assert sorted(path.name for path in cache.root.iterdir()) == [MARKER, entry.name]


def test_a_changed_file_replaces_its_older_folder(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    model = _model(tmp_path / "models")
    old = cache.prepare(model)
    _fill(old)
    model.write_bytes(b"GGUF, a newer version")
    new = cache.prepare(model)
    assert new != old
    assert not old.exists()
    assert sorted(path.name for path in cache.root.iterdir()) == [MARKER, new.name]


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
        [MARKER, *(cache.entry(source).name for source in (kept, other, fresh))]
    )


def test_folders_without_a_record_naming_them_are_never_stale(tmp_path: Path) -> None:
    """Not even those named like an entry of the file converted: a record names an entry."""
    cache = ArtifactCache(tmp_path / "cache")
    assert cache.store(cache.root / "x.gguf-0123456789abcdef" / "t", files(a="1"))  # marked
    cache.discard(cache.root / "x.gguf-0123456789abcdef")
    legacy_same = cache.root / "model.gguf-0123456789abcdef"
    legacy_other = cache.root / "other.gguf-0123456789abcdef"
    stranger = cache.root / ".in-progress"
    for folder in (legacy_same, legacy_other, stranger):
        _fill(folder)
    (cache.root / "notes.txt").write_text("a user's file")
    entry = cache.prepare(_model(tmp_path / "models"))
    assert sorted(path.name for path in cache.root.iterdir()) == sorted(
        [MARKER, entry.name, legacy_same.name, legacy_other.name, stranger.name, "notes.txt"]
    )


def test_an_unreadable_record_is_left_alone(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    odd = cache.root / "model.gguf-fedcba9876543210"
    (odd / SOURCE_RECORD).mkdir(parents=True)  # not a file: reading it fails
    entry = cache.prepare(_model(tmp_path / "models"))
    assert sorted(path.name for path in cache.root.iterdir()) == sorted([entry.name, odd.name])


# --- the size cap -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 2**30),
        ("8GiB", 8 * 2**30),
        ("8G", 8 * 2**30),
        ("8 gib", 8 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5K", 1536),
        ("2TB", 2 * 10**12),
        ("100B", 100),
        ("unlimited", None),
        (" Unlimited ", None),
    ],
)
def test_the_limit_is_a_size(text: str, expected: int | None) -> None:
    assert parse_size(text) == expected
    cache = ArtifactCache.from_environment({CACHE_DIR_ENV: "/c", CACHE_LIMIT_ENV: text})
    assert cache is not None
    assert cache.limit == expected


@pytest.mark.parametrize("text", ["lots", "0", "-1", "8XB", "iB", "0.1", "8 G B", "1e9"])
def test_a_bad_limit_is_refused_naming_the_variable_and_the_value(text: str) -> None:
    message = (
        f"TWOSTROKE_CACHE_LIMIT must be a size above zero such as 8GiB, 500MB or 1073741824 "
        f"(bytes), or 'unlimited'; got {text!r}"
    )
    with pytest.raises(InvalidCacheLimit) as caught:
        ArtifactCache.from_environment({CACHE_DIR_ENV: "/c", CACHE_LIMIT_ENV: text})
    assert str(caught.value) == message
    assert isinstance(caught.value, ValueError)


def test_the_default_limit_when_unset_or_empty() -> None:
    for environ in ({}, {CACHE_LIMIT_ENV: ""}):
        cache = ArtifactCache.from_environment(environ)
        assert cache is not None
        assert cache.limit == DEFAULT_LIMIT == 8 * 2**30


def test_sizes_are_printed_for_people() -> None:
    assert [format_size(size) for size in (0, 999, 1000, 538_123_456, 8 * 2**30)] == [
        "0 B",
        "999 B",
        "1.0 kB",
        "538.1 MB",
        "8.6 GB",
    ]


# --- records and their checks -----------------------------------------------------------------


def files(**contents: str) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        folder.mkdir()
        for name, text in contents.items():
            (folder / name).write_text(text)

    return write


MADE = Provenance(
    what="weights", source="/m.gguf", torch="2.x", isa="native (avx2)", dtype="float32"
)


def test_a_stored_folder_carries_its_record_and_opens(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    artifact = cache.root / "m.gguf-0123456789abcdef" / "model-float32"
    assert cache.open(artifact) is None  # nothing there yet
    assert cache.store(artifact, files(a="alpha", b="beta"), provenance=MADE, checksum="crc32")
    record = cache.open(artifact)
    assert record is not None
    assert record.key == "m.gguf-0123456789abcdef/model-float32"
    assert record.provenance == MADE
    assert record.checksum == "crc32"
    assert {name: file.size for name, file in record.files.items()} == {"a": 5, "b": 4}
    assert Record.from_json((artifact / RECORD).read_text()) == record
    assert cache.store(cache.root / "x-0123456789abcdef" / "t", files(t="{}"))
    plain = cache.open(cache.root / "x-0123456789abcdef" / "t")
    assert plain is not None
    assert (plain.provenance, plain.checksum) == (Provenance(what="t"), "sha256")


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda a: (a / "a").write_text("alphA"), r"a: its sha256 is [0-9a-f]{64}, its record"),
        (lambda a: (a / "a").write_text("alph"), r"a: holds 4 bytes, its record says 5"),
        (lambda a: (a / "b").unlink(), r"b: is missing"),
        (lambda a: (a / RECORD).unlink(), r"model-float32: has no readable record\.json"),
        (lambda a: (a / RECORD).write_text("{"), r"has no readable record\.json"),
        (
            lambda a: (a / "a").chmod(0o666),
            r"a: is writable by its group or by others \(mode 0666\)",
        ),
        (lambda a: a.chmod(0o777), r"model-float32: is writable by its group or by others"),
        (lambda a: ((a / "b").unlink(), (a / "b").symlink_to(a / "a")), r"b: is a symbolic link"),
    ],
)
def test_an_artifact_unlike_its_record_is_refused(
    tmp_path: Path, damage: Callable[[Path], object], problem: str
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    artifact = cache.root / "m.gguf-0123456789abcdef" / "model-float32"
    cache.store(artifact, files(a="alpha", b="beta"))
    damage(artifact)
    with pytest.raises(DamagedArtifact, match=problem):
        cache.open(artifact)
    cache.discard(artifact)
    assert not artifact.exists()
    assert cache.open(artifact) is None


def test_deferred_files_are_checked_for_size_only(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    artifact = cache.root / "m.gguf-0123456789abcdef" / "model-float32"
    cache.store(artifact, files(weights="12345678", config="{}"), checksum="crc32")
    (artifact / "weights").write_text("12345679")  # one bit: the reader's CRC catches it
    assert cache.open(artifact, deferred=["weights"]) is not None
    with pytest.raises(DamagedArtifact, match="weights: its crc32 is"):
        cache.open(artifact)


def test_a_moved_artifact_is_refused(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    one = cache.root / "m.gguf-0123456789abcdef" / "model-float32"
    other = cache.root / "m.gguf-0123456789abcdef" / "model-bfloat16"
    cache.store(one, files(a="alpha"))
    one.rename(other)
    with pytest.raises(
        DamagedArtifact, match=r"its record is 'm\.gguf-0123456789abcdef/model-float32'"
    ):
        cache.open(other)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "home" / ".cache" / "twostroke")
    artifact = cache.root / "m.gguf-0123456789abcdef" / "tokenizer"
    with umask(0):
        assert cache.store(artifact, files(a="alpha"))
        assert cache.store(artifact.parent / SOURCE_RECORD, lambda path: path.write_text("/m"))
    for folder in (tmp_path / "home", tmp_path / "home" / ".cache", cache.root, artifact):
        assert mode(folder) == 0o700, folder
    for file in (artifact / "a", artifact / RECORD, artifact.parent / SOURCE_RECORD):
        assert mode(file) == 0o600, file
    assert mode(artifact.parent / LAST_USED) == 0o600


@pytest.mark.parametrize("where", ["root", "native"])
def test_a_cache_folder_others_may_write_is_neither_read_nor_written(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    artifact = cache.root / NATIVE_FOLDER / "lib-0123456789abcdef"
    assert cache.store(artifact, files(a="alpha"))
    (cache.root if where == "root" else cache.root / NATIVE_FOLDER).chmod(0o777)
    with pytest.raises(
        UnsafeCachePath,
        match=r"is writable by its group or by others \(mode 0777\); a cache folder must "
        "belong to this user",
    ):
        cache.open(artifact)
    assert cache.unsafe() is not None
    with caplog.at_level(logging.WARNING):
        assert not cache.store(artifact.with_name("other"), files(a="alpha"))
    assert "UnsafeCachePath" in caplog.text
    assert [entry.path for entry in cache.clear()] == [artifact]
    assert mode(cache.root) == mode(cache.root / NATIVE_FOLDER) == 0o700  # private again
    assert cache.unsafe() is None


def test_a_cache_folder_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    artifact = cache.root / "m.gguf-0123456789abcdef" / "tokenizer"
    assert cache.store(artifact, files(a="alpha"))
    real = os.geteuid()
    monkeypatch.setattr(artifacts.os, "geteuid", lambda: real + 1)  # as another user sees it
    with pytest.raises(
        UnsafeCachePath,
        match=rf"cache: is owned by uid {real}, not by this user \(uid {real + 1}\)",
    ):
        cache.open(artifact)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_an_entry_of_another_user_is_refused_and_replaced(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    artifact = cache.root / "m.gguf-0123456789abcdef" / "tokenizer"
    assert cache.store(artifact, files(a="alpha"))
    os.chown(artifact / "a", 12345, -1)
    with pytest.raises(DamagedArtifact, match=r"a: is owned by uid 12345, not by this user"):
        cache.open(artifact)
    os.chown(artifact.parent, 12345, -1)
    with pytest.raises(DamagedArtifact, match=r"0123456789abcdef: is owned by uid 12345"):
        cache.open(artifact)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    entry = cache.prepare(model)  # its own entry is made afresh
    assert entry.lstat().st_uid == os.geteuid()


def test_two_writers_of_one_artifact_leave_one_whole(tmp_path: Path) -> None:
    """The second process's whole store runs while the first writes: the first's rename
    finds the folder in place, and what stays is one writer's files with its own record."""
    cache = ArtifactCache(tmp_path / "cache")
    artifact = cache.root / "m.gguf-0123456789abcdef" / "tokenizer"

    def first(folder: Path) -> None:
        files(a="first's")(folder)
        assert cache.store(artifact, files(a="second's"))

    assert cache.store(artifact, first)
    record = cache.open(artifact)
    assert record is not None
    assert (artifact / "a").read_text() == "second's"
    assert sorted(os.listdir(artifact.parent)) == [LAST_USED, "tokenizer"]  # nothing left over


# --- eviction, pruning, clearing --------------------------------------------------------------


def entry_of(cache: ArtifactCache, name: str, size: int, used: int) -> Path:
    """A stored entry of ``size`` bytes of files, last used at ``used`` (seconds)."""
    if name.startswith("lib"):
        artifact = entry = cache.root / NATIVE_FOLDER / f"{name}-0123456789abcdef"
    else:
        entry = cache.root / f"{name}.gguf-0123456789abcdef"
        artifact = entry / "model-float32"
    assert cache.store(artifact, files(data="x" * size))
    os.utime(entry / LAST_USED, (used, used))
    return entry


def test_a_store_evicts_the_least_recently_used_entries_past_the_limit(tmp_path: Path) -> None:
    unbounded = ArtifactCache(tmp_path / "cache", limit=None)
    old = entry_of(unbounded, "old", 3000, used=100)
    middle = entry_of(unbounded, "lib", 3000, used=200)
    recent = entry_of(unbounded, "recent", 3000, used=300)
    assert unbounded.open(old / "model-float32") is not None  # a read: now the newest
    cache = ArtifactCache(unbounded.root, limit=8000)
    new = entry_of(cache, "new", 3000, used=400)
    assert {entry.path for entry in cache.entries()} == {old, new}
    assert not middle.exists()
    assert not recent.exists()


def test_the_entry_just_stored_stays_even_past_the_limit(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", limit=100)
    first = entry_of(cache, "first", 500, used=100)
    assert [entry.path for entry in cache.entries()] == [first]
    second = entry_of(cache, "second", 500, used=200)
    assert [entry.path for entry in cache.entries()] == [second]


def test_entries_say_what_they_hold(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", limit=None)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    entry = cache.prepare(model)
    cache.store(entry / "model-float32", files(w="1234"), provenance=MADE, checksum="crc32")
    os.utime(entry / LAST_USED, (1000, 1000))
    (cache.root / NATIVE_FOLDER).mkdir()
    library = cache.root / NATIVE_FOLDER / "paged_decode-0123456789abcdef"
    assert cache.store(library, files(lib="\x7fELF"))
    os.utime(library / LAST_USED, (500, 500))
    # Neither an older twostroke's library (no record) nor a folder of the user's is an
    # entry: never listed, never removed.
    (cache.root / NATIVE_FOLDER / "paged_decode-0123456789abcdef.so").write_bytes(b"\x7fELF")
    (cache.root / "notes").mkdir()
    [found, lib] = cache.entries()
    assert (found.path, found.kind, found.source, found.last_used) == (
        entry,
        "model",
        str(model.resolve()),
        1000,
    )
    assert [(name, record is not None) for name, record in found.artifacts] == [
        ("model-float32", True)
    ]
    assert found.size == sum(path.lstat().st_size for path in entry.rglob("*") if path.is_file())
    assert (lib.path, lib.kind, lib.last_used) == (library, "library", 500)
    assert [(name, record is not None) for name, record in lib.artifacts] == [(library.name, True)]


def test_prune_keeps_the_newest_and_fits_the_limit(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", limit=None)
    made = [entry_of(cache, f"m{index}", 1000, used=100 * index) for index in range(1, 5)]
    assert [entry.path for entry in cache.prune(limit=None, keep_newest=3)] == [made[0]]
    removed = cache.prune(limit=3000)  # two entries of 1000 bytes and their records
    assert [entry.path for entry in removed] == [made[1]]
    assert [entry.path for entry in cache.entries()] == [made[3], made[2]]
    with pytest.raises(ValueError, match="keep_newest must be >= 0, got -1"):
        cache.prune(limit=None, keep_newest=-1)


def test_leftovers_of_a_crashed_writer_go_after_an_hour(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", limit=None)
    entry = entry_of(cache, "m", 10, used=100)
    old = entry / f".model-bfloat16.{'0123' * 8}.tmp"
    fresh = cache.root / f".m.gguf-0123.{'4567' * 8}.tmp"
    for leftover in (old, fresh):
        leftover.mkdir()
    os.utime(old, (0, 0))
    cache.evict()
    assert not old.exists()
    assert fresh.exists()  # perhaps another process writing it now
    cache.clear()
    assert not fresh.exists()


def test_clear_removes_every_entry_and_only_those(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", limit=None)
    made = {entry_of(cache, "m", 10, used=100), entry_of(cache, "lib", 10, used=200)}
    (cache.root / "notes.txt").write_text("a user's file")
    assert {entry.path for entry in cache.clear()} == made
    assert sorted(path.name for path in cache.root.iterdir()) == [
        MARKER,
        NATIVE_FOLDER,
        "notes.txt",
    ]
    assert cache.entries() == []
