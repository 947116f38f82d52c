"""The artifact cache: what is converted or compiled once, and read back by later runs.

Loading SmolLM2's GGUF takes seconds that are all conversion: dequantizing every tensor
(about 1 s) and building a fast tokenizer out of the GGUF vocabulary through
``transformers`` (1.1 s, plus 2-3 s to import it); the compiled kernels take another second
(:mod:`~twostroke.engine.kernels.build`). The results depend on the file and the machine
alone, so the first load writes them to a cache folder and the next loads read them back:
the weights as safetensors in the model's dtype, read straight into the parameters
(:mod:`~twostroke.engine.checkpoints.safetensors`), the tokenizer as ``tokenizer.json``,
its configuration and its chat template, read without ``transformers``
(:mod:`~twostroke.engine.text.saved_tokenizer`), and the kernels' shared libraries.

**Where.** ``$TWOSTROKE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/twostroke``, else
``~/.cache/twostroke``; ``TWOSTROKE_NO_CACHE=1`` turns the cache off. It holds **entries**:
one folder per model file, named after the file and keyed by its resolved path, size and
modification time (so an edited or replaced file is converted again), holding that file's
artifacts (``model-float32/``, ``tokenizer/``), and one folder per compiled library in
``native/``. A model entry records the path of its source (``source``); each conversion
removes the entries it makes stale: those of its own file at an earlier size or time, those
whose file is gone (a deleted virtual environment, an uninstalled package), and entries of
the same file name without a record (written before records were kept).

**Bounded.** ``$TWOSTROKE_CACHE_LIMIT`` caps the cache's size (default 8 GiB; ``unlimited``
for no cap): each store evicts the least recently used entries until the cache fits, never
the entry it stored. Reading an artifact touches its entry's ``last-used`` file (one
``utime``). ``twostroke cache`` lists the entries, ``twostroke cache prune`` and
``twostroke cache clear`` remove them; deleting the cache folder is always safe.

**Removes only what it wrote.** ``$TWOSTROKE_CACHE_DIR`` may name a folder of the user's,
so the cache removes nothing on a guess. The folder is *marked* (:data:`MARKER`, a Cache
Directory Tag, which backup tools skip too) when the cache creates it, or when the cache
finds it empty and stores into it (nothing of anyone's can be lost then). An **entry** is a
folder whose record names it: a model entry's ``source`` record or one of its artifacts'
``record.json`` gives the entry's own path, a library's ``record.json`` its own; a folder
named like an entry, one holding a file called ``source``, a record copied or moved from
another path, are not entries. Eviction, pruning, clearing and the removal of stale entries
and of crashed writers' temporary names happen in a marked folder only; elsewhere they
remove nothing and change no mode, and ``clear`` and ``prune`` raise
:class:`UnmarkedCache` (the folder holds files, so it is the user's, or an older
twostroke's cache, which holds no marker: delete that one, and the next load makes it
afresh, marked). Entries in an unmarked folder are still listed, read and stored, unbounded.

**Written whole.** Every artifact is written to a temporary name beside its final place,
given its record (:mod:`~twostroke.engine.artifacts.records`: what made it, and each
file's size and checksum) and renamed into place, so a reader never sees half an artifact,
and two processes converting the same model at once both succeed (the first rename wins;
the second finds the folder in place and keeps it). Folders are created mode 0700 and files
0600, whatever the umask. A cache that cannot be written (read-only home, full disk) is
logged and skipped: loading never fails because of it.

**Checked before it is read.** :meth:`ArtifactCache.open` reads nothing from a cache
folder that another user owns or may write (:class:`UnsafeCachePath`), and refuses an
artifact whose files are not this user's, are writable by others, or differ from its record
in size or checksum (:class:`DamagedArtifact`): the caller removes it and makes it again.

This module does no conversion itself and imports neither torch nor transformers; the
loader, the tokenizer and the kernels decide what to store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import attrs

from twostroke.engine.artifacts.records import (
    RECORD,
    Checksum,
    DamagedArtifact,
    Provenance,
    Record,
    UnsafeCachePath,
    check_file,
    make_private,
    record_folder,
    unsafe_because,
    write_private,
)
from twostroke.states.errors import EngineError

__all__ = [
    "CACHE_DIR_ENV",
    "CACHE_LIMIT_ENV",
    "DEFAULT_LIMIT",
    "LAST_USED",
    "MARKER",
    "NATIVE_FOLDER",
    "NO_CACHE_ENV",
    "SOURCE_RECORD",
    "ArtifactCache",
    "CacheEntry",
    "InvalidCacheLimit",
    "UnmarkedCache",
    "format_size",
    "parse_size",
]

#: Environment variable naming the cache folder.
CACHE_DIR_ENV = "TWOSTROKE_CACHE_DIR"
#: Environment variable that turns the cache off when set to ``1``.
NO_CACHE_ENV = "TWOSTROKE_NO_CACHE"
#: Environment variable capping the cache's size (:func:`parse_size`).
CACHE_LIMIT_ENV = "TWOSTROKE_CACHE_LIMIT"
#: The cap when :data:`CACHE_LIMIT_ENV` is unset: a few models' entries (SmolLM2's is
#: 0.6 GB in float32) and every library, or one 1-2 B model in float32.
DEFAULT_LIMIT = 8 * 2**30

#: Bumped when the layout or the contents of a cache folder change.
_FORMAT = 2

#: The file in a model entry that records the resolved path of the entry's source.
SOURCE_RECORD = "source"
#: The file in an entry whose modification time is the entry's last use.
LAST_USED = "last-used"
#: The folder in the cache holding one entry per compiled library.
NATIVE_FOLDER = "native"
#: The file marking a folder as the cache's own (the Cache Directory Tagging Specification's
#: name, https://bford.info/cachedir/): only in a marked folder does the cache remove entries.
MARKER = "CACHEDIR.TAG"
#: The unmarked cache folders this process has warned of (see ArtifactCache.evict).
_WARNED_UNMARKED: set[Path] = set()
#: The marker's text: the specification's signature, then a line of our own, so that another
#: tool's tag (a build folder's) does not make a folder ours.
_MARKER_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This folder is twostroke's artifact cache, which made it: `twostroke cache clear` "
    "empties it.\n"
    "# For information about cache directory tags, see https://bford.info/cachedir/\n"
)
#: A record in ``source`` is a few hundred bytes; a longer file is no record of ours.
_MAX_SOURCE_RECORD = 2**16

#: A temporary name left this long ago is a crashed writer's: eviction removes it.
_LEFTOVER_SECONDS = 3600.0
#: A temporary name the cache gives (:meth:`ArtifactCache.store`, :meth:`~ArtifactCache.discard`).
_TEMPORARY_NAME = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)
_EXPONENTS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}

_log = logging.getLogger(__name__)


class InvalidCacheLimit(EngineError, ValueError):
    """:data:`CACHE_LIMIT_ENV` (or a ``--max-size``) is not a size."""


class UnmarkedCache(EngineError, ValueError):
    """``clear`` or ``prune`` asked of a cache folder the cache did not make: one that holds
    files but no :data:`MARKER` of the cache's (a folder of the user's, or an older
    twostroke's cache). Nothing was removed.

    Attributes:
        root: The cache folder.
        action: What was asked (``"clear"``, ``"prune"``).
    """

    def __init__(self, root: Path, action: str) -> None:
        self.root = root
        self.action = action
        super().__init__(
            f"twostroke cache {action} removes entries only from a folder the cache made, "
            f"which holds its {MARKER}; {root} holds none (a folder of yours, or an older "
            "twostroke's cache), so nothing was removed. If it holds only twostroke's cache, "
            f"delete it (the next load makes it afresh, marked); else point {CACHE_DIR_ENV} "
            "at a new folder"
        )


def parse_size(text: str, *, name: str = CACHE_LIMIT_ENV) -> int | None:
    """A size in bytes from text: ``1073741824``, ``8GiB`` or ``8G`` (powers of 1024),
    ``500MB`` (powers of 1000); ``unlimited`` is ``None``.

    Args:
        text: The value.
        name: What the value is, for the error message.

    Raises:
        InvalidCacheLimit: not a size, or not above zero.
    """
    if text.strip().lower() == "unlimited":
        return None
    match = _SIZE.fullmatch(text)
    if match is not None:
        number, prefix, binary, unit = match.groups()
        base = 1000 if (prefix and unit and not binary) else 1024
        if prefix or not binary:  # "iB" alone is no unit
            value = int(float(number) * base ** _EXPONENTS[prefix.lower()])
            if value >= 1:
                return value
    raise InvalidCacheLimit(
        f"{name} must be a size above zero such as 8GiB, 500MB or 1073741824 (bytes), or "
        f"'unlimited'; got {text!r}"
    )


def format_size(size: int) -> str:
    """``538.1 MB``: a size for people (powers of 1000, as ``du --si`` prints them)."""
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


@attrs.frozen
class CacheEntry:
    """One entry of the cache, as :meth:`ArtifactCache.entries` finds it.

    Attributes:
        path: Its folder.
        kind: ``"model"`` (a model file's artifacts) or ``"library"``.
        source: The model file it was converted from (a model entry's ``source``).
        size: Bytes of all its files.
        last_used: When it was last read or written (seconds since the epoch).
        artifacts: Each artifact's name and its record (``None``: none could be read,
            as for an older twostroke's files).
    """

    path: Path
    kind: str
    source: str | None
    size: int
    last_used: float
    artifacts: tuple[tuple[str, Record | None], ...]


@attrs.frozen
class ArtifactCache:
    """A cache folder holding one entry per converted model file and per compiled library.

    Attributes:
        root: The cache folder (created on first write, mode 0700).
        limit: The most bytes it holds after a store (``None``: no cap).
    """

    root: Path = attrs.field(converter=Path)
    limit: int | None = DEFAULT_LIMIT

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ArtifactCache | None:
        """The cache the environment asks for, or ``None`` when it is turned off.

        Args:
            environ: The environment (``os.environ`` when ``None``).

        Returns:
            The cache at ``$TWOSTROKE_CACHE_DIR``, ``$XDG_CACHE_HOME/twostroke`` or
            ``~/.cache/twostroke``, capped at ``$TWOSTROKE_CACHE_LIMIT``; ``None`` if
            ``TWOSTROKE_NO_CACHE`` is ``1``.

        Raises:
            InvalidCacheLimit: ``$TWOSTROKE_CACHE_LIMIT`` is not a size.
        """
        env = os.environ if environ is None else environ
        if env.get(NO_CACHE_ENV, "") == "1":
            return None
        limit = env.get(CACHE_LIMIT_ENV, "")
        bound = parse_size(limit) if limit.strip() else DEFAULT_LIMIT
        explicit = env.get(CACHE_DIR_ENV)
        if explicit:
            return cls(Path(explicit).expanduser(), bound)
        base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(Path(base) / "twostroke", bound)

    # --- model entries ---------------------------------------------------------------------

    def entry(self, source: Path) -> Path:
        """The folder of ``source``'s artifacts (it may not exist yet).

        Args:
            source: The model file the artifacts are converted from; it must exist.

        Returns:
            ``root / "<file name>-<key>"``, the key hashing the resolved path, the size, the
            modification time and the cache format.

        Raises:
            OSError: ``source`` cannot be read.
        """
        resolved = source.resolve()
        stat_result = resolved.stat()
        identity = f"{_FORMAT}\0{resolved}\0{stat_result.st_size}\0{stat_result.st_mtime_ns}"
        digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
        return self.root / f"{resolved.name}-{digest}"

    def prepare(self, source: Path) -> Path:
        """The folder to write ``source``'s artifacts into, recording the source in it, and
        with the folders this conversion makes stale removed (see the module).

        Call it when ``source`` was converted (a cache miss), before storing what the
        conversion made; never on reads. An entry folder that is not this user's alone is
        removed first. The ``source`` record names the model file and the entry, which makes
        the folder an entry (:meth:`entries`) before any artifact is stored in it. Only in
        a marked folder (:meth:`marked`) is anything removed.

        Args:
            source: The model file the artifacts are converted from; it must exist.

        Returns:
            :meth:`entry` of ``source``.

        Raises:
            OSError: ``source`` cannot be read.
        """
        entry = self.entry(source)
        resolved = str(source.resolve())

        def record(path: Path) -> None:
            path.write_text(json.dumps({"source": resolved, "key": self._key(entry)}) + "\n")

        with contextlib.suppress(UnsafeCachePath):  # store() says so
            try:
                self._check_levels(entry, include_self=True)
            except DamagedArtifact as error:
                if self.marked():  # elsewhere store() refuses to write into it, and says so
                    _log.warning("twostroke: removing the cache folder %s", error)
                    self.discard(entry)
        if self._read_source(entry)[1] != self._key(entry):  # none, or an older twostroke's
            self.store(entry / SOURCE_RECORD, record)
        if self.marked():
            for stale in self._stale(entry, resolved):
                _log.info("twostroke: removing the stale cache folder %s", stale)
                self.discard(stale)
        return entry

    def _stale(self, entry: Path, resolved: str) -> list[Path]:
        """The entries besides ``entry`` that the conversion of ``resolved`` makes stale:
        the same file's, and those whose file is gone."""
        return [
            found.path
            for found in self.entries()
            if found.kind == "model"
            and found.path != entry
            and found.source is not None
            and (found.source == resolved or not Path(found.source).exists())
        ]

    # --- storing and reading artifacts -----------------------------------------------------

    def store(
        self,
        path: Path,
        write: Callable[[Path], None],
        *,
        provenance: Provenance | None = None,
        checksum: Checksum = "sha256",
    ) -> bool:
        """Create ``path`` atomically: ``write`` fills a temporary file or folder, a folder
        gets its record, then it is renamed into place; then the cache is cut to its limit.

        Args:
            path: The artifact's final path, inside an entry folder (or the entry folder
                itself, for a library).
            write: Writes the artifact to the path it is given (a file, or a folder it
                creates and fills).
            provenance: What made a folder's files, for its record (default: its name).
            checksum: How its record sums a folder's files (see
                :mod:`~twostroke.engine.artifacts.records`).

        Returns:
            Whether the artifact is now in place (ours, or an identical one another
            process put there first). Failures to write are logged, not raised.
        """
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            self._make_private(path.parent)
            write(temporary)
            if temporary.is_dir() and not temporary.is_symlink():
                make_private(temporary)
                record = record_folder(
                    temporary,
                    key=self._key(path),
                    provenance=provenance or Provenance(what=path.name),
                    checksum=checksum,
                )
                write_private(temporary / RECORD, record.to_json())
            else:
                os.chmod(temporary, 0o600)
            try:
                os.replace(temporary, path)
            except OSError:
                if not (temporary.is_dir() and path.is_dir()):
                    raise
                # Another process put the same folder in place first (a folder cannot
                # replace a non-empty one); theirs is as good as ours, and open() checks it.
            entry = self._entry_of(path)
            self._touch(entry)
            self.evict(protect=(entry,))
            return True
        except Exception as error:  # an optimization must not fail the load it speeds up
            _log.warning(
                "twostroke: cannot write %s to the cache (%s: %s); continuing",
                path,
                type(error).__name__,
                error,
            )
            return False
        finally:
            _remove(temporary)

    def open(self, artifact: Path, *, deferred: Collection[str] = ()) -> Record | None:
        """The record of the artifact folder ``artifact``, once its files are checked
        against it; ``None`` if there is no such artifact. Marks its entry used.

        Args:
            artifact: A folder :meth:`store` wrote.
            deferred: Files whose checksum the caller checks itself while it reads them
                (their size is checked here): the weights, summed as they are read.

        Raises:
            UnsafeCachePath: the cache folder (or ``native/``) is another user's or
                writable by others; nothing in it may be read.
            DamagedArtifact: the artifact has no valid record, a file that is not this
                user's alone, or a file whose size or checksum is not its record's; the
                caller removes it (:meth:`discard`) and makes it again.
        """
        try:
            artifact.lstat()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise DamagedArtifact(artifact, f"cannot be examined ({error})") from error
        self._check_levels(artifact, include_self=True)
        record = self._read_record(artifact)
        if record is None:
            raise DamagedArtifact(artifact, f"has no readable {RECORD}")
        if record.key != self._key(artifact):
            raise DamagedArtifact(artifact, f"its record is {record.key!r}'s")
        for name, expected in record.files.items():
            check_file(artifact / name, expected, record.checksum, summed=name not in deferred)
        self._touch(self._entry_of(artifact))
        return record

    def discard(self, artifact: Path) -> None:
        """Remove an artifact or entry: renamed out of the way at once (readers see it or
        nothing), then deleted."""
        hidden = artifact.with_name(f".{artifact.name}.{uuid.uuid4().hex}.tmp")
        try:
            os.rename(artifact, hidden)
        except OSError:
            return  # gone already (another process discarded it), or not ours to move
        _remove(hidden)

    def read_record(self, artifact: Path) -> Record | None:
        """An artifact's record as it is, unchecked (for listings); ``None`` if unreadable."""
        return self._read_record(artifact)

    def marked(self) -> bool:
        """Whether the cache folder is the cache's own: it holds the cache's :data:`MARKER`,
        a regular file of this user's that no one else may write. Only there are entries
        removed (see the module)."""
        marker = self.root / MARKER
        try:
            if unsafe_because(marker) is not None or not stat.S_ISREG(marker.lstat().st_mode):
                return False
            with marker.open("rb") as file:
                return file.read(len(_MARKER_TEXT) + 1) == _MARKER_TEXT.encode()
        except OSError:
            return False

    def unsafe(self) -> UnsafeCachePath | None:
        """Why nothing in this cache may be read (its folder or ``native/`` is another
        user's or writable by others), or ``None``."""
        try:
            self._check_levels(self.root / NATIVE_FOLDER, include_self=True)
        except UnsafeCachePath as error:
            return error
        return None

    # --- entries, eviction ------------------------------------------------------------------

    def entries(self) -> list[CacheEntry]:
        """Every entry in the cache, most recently used first.

        Only what this cache writes counts, a folder whose record names it: a model entry's
        ``source`` record or one of its artifacts' ``record.json`` gives its path, a
        library's ``record.json`` (in ``native/``) gives its own. A folder named like an
        entry, one holding a file called ``source``, one whose records name another path,
        and anything else in the folder are left alone.
        """
        found: list[CacheEntry] = []
        for child in _children(self.root):
            if child.is_symlink() or not child.is_dir():
                continue
            if child.name == NATIVE_FOLDER:
                found.extend(self._library(path) for path in _children(child) if self._named(path))
            elif self._read_source(child)[1] == self._key(child) or any(
                self._named(artifact) for artifact in _children(child)
            ):
                found.append(self._model(child))
        return sorted(found, key=lambda entry: entry.last_used, reverse=True)

    def evict(self, *, protect: Sequence[Path] = ()) -> list[CacheEntry]:
        """Cut the cache to :attr:`limit` (what :meth:`store` does after each store).

        Args:
            protect: Entries never removed (the one just stored).

        Returns:
            The entries removed: none in a folder that is not marked (:meth:`marked`),
            which is logged.
        """
        if not self.marked():
            if self.root in _WARNED_UNMARKED:
                return []
            _WARNED_UNMARKED.add(self.root)  # once a process: every store would say it again
            _log.warning(
                "twostroke: the cache folder %s holds no %s of the cache's (a folder of yours, "
                "or an older twostroke's cache): nothing in it is evicted, so %s does not "
                "bound it (`twostroke cache clear` says what to do)",
                self.root,
                MARKER,
                CACHE_LIMIT_ENV,
            )
            return []
        return self.prune(limit=self.limit, protect=protect)

    def prune(
        self,
        *,
        limit: int | None,
        keep_newest: int | None = None,
        protect: Sequence[Path] = (),
    ) -> list[CacheEntry]:
        """Remove the least recently used entries until the cache fits, and the temporary
        files a crashed writer left (an hour old).

        Args:
            limit: The most bytes to keep (``None``: no cap).
            keep_newest: Also keep at most this many entries, the most recently used.
            protect: Entries never removed.

        Returns:
            The entries removed (none from a missing or empty folder).

        Raises:
            ValueError: ``keep_newest`` is below 0.
            UnmarkedCache: the folder holds files but is not marked (:meth:`marked`);
                nothing was removed.
        """
        if keep_newest is not None and keep_newest < 0:
            raise ValueError(f"keep_newest must be >= 0, got {keep_newest}")
        if not self._may_remove("prune"):
            return []
        for leftover in self._leftovers(older_than=_LEFTOVER_SECONDS):
            _remove(leftover)
        entries = self.entries()
        kept, removed = [], []
        for position, entry in enumerate(entries):
            if keep_newest is not None and position >= keep_newest and entry.path not in protect:
                removed.append(entry)
            else:
                kept.append(entry)
        total = sum(entry.size for entry in kept)
        for entry in reversed(kept):  # least recently used first
            if limit is None or total <= limit:
                break
            if entry.path in protect:
                continue
            removed.append(entry)
            total -= entry.size
        for entry in removed:
            _log.info("twostroke: evicting %s from the cache", entry.path)
            self.discard(entry.path)
        return removed

    def clear(self) -> list[CacheEntry]:
        """Remove every entry and every temporary name the cache gives; a cache folder of
        this user's that others could write is made private again (no entry from that time
        is left in it, and nothing else in it is ever read).

        Returns:
            The entries removed (none from a missing or empty folder, whose mode stays).

        Raises:
            UnmarkedCache: the folder holds files but is not marked (:meth:`marked`);
                nothing was removed and no mode changed.
        """
        if not self._may_remove("clear"):
            return []
        removed = self.entries()
        for entry in removed:
            self.discard(entry.path)
        for leftover in self._leftovers(older_than=None):
            _remove(leftover)
        # The cache folder may be a link (to a disk of more room); native/ never is.
        for folder, follow in ((self.root, True), (self.root / NATIVE_FOLDER, False)):
            with contextlib.suppress(OSError):
                status = folder.stat() if follow else folder.lstat()
                if status.st_uid == os.geteuid() and stat.S_ISDIR(status.st_mode):
                    os.chmod(folder, 0o700)
        return removed

    # --- helpers ---------------------------------------------------------------------------

    def _key(self, artifact: Path) -> str:
        return artifact.relative_to(self.root).as_posix()

    def _entry_of(self, path: Path) -> Path:
        """The entry holding ``path``: its first folder under the cache (under ``native/``
        for a library)."""
        parts = path.relative_to(self.root).parts
        if parts[0] == NATIVE_FOLDER and len(parts) > 1:
            return self.root / NATIVE_FOLDER / parts[1]
        return self.root / parts[0]

    def _shared(self, folder: Path) -> bool:
        """Whether ``folder`` is the cache folder or ``native/`` (not an entry's)."""
        return folder in (self.root, self.root / NATIVE_FOLDER)

    def _check_levels(self, path: Path, *, include_self: bool) -> None:
        """Check every folder from the cache folder down to ``path`` that exists."""
        parts = path.relative_to(self.root).parts
        levels = [self.root]
        for index in range(len(parts) if include_self else len(parts) - 1):
            levels.append(self.root.joinpath(*parts[: index + 1]))
        for level in levels:
            try:
                problem = unsafe_because(level, follow=level == self.root)
            except FileNotFoundError:
                return
            except OSError as error:
                problem = f"cannot be examined ({error})"
            if problem is None:
                continue
            if self._shared(level):
                raise UnsafeCachePath(
                    level,
                    f"{problem}; a cache folder must belong to this user and be writable by "
                    "no one else",
                )
            raise DamagedArtifact(level, problem)

    def _make_private(self, folder: Path) -> None:
        """Create ``folder`` and the folders above it that are missing, mode 0700 whatever
        the umask, and check every level of the cache down to it. The cache folder is
        marked when it is made here, or found empty (:meth:`_adopt`)."""
        missing = []
        level = folder
        while not os.path.lexists(level) and level != level.parent:
            missing.append(level)
            level = level.parent
        if self.root not in missing:
            self._adopt()  # before anything is made in it
        for created in reversed(missing):
            try:
                os.mkdir(created, 0o700)
            except FileExistsError:
                continue  # another process made it: checked below
            os.chmod(created, 0o700)  # the umask only takes bits away; this is exact
            if created == self.root:
                self._adopt()
        self._check_levels(folder, include_self=True)

    def _adopt(self) -> None:
        """Mark the cache folder as the cache's if nothing at all is in it (it was just
        made, or was found empty): removing entries from it later can take nothing of
        anyone's. A folder that holds anything, an older twostroke's cache included, stays
        unmarked."""
        if not _empty(self.root):
            return
        temporary = self.root / f".{MARKER}.{uuid.uuid4().hex}.tmp"
        try:
            write_private(temporary, _MARKER_TEXT)
            os.replace(temporary, self.root / MARKER)  # whole, for a reader in another process
        finally:
            _remove(temporary)

    def _may_remove(self, action: str) -> bool:
        """Whether ``action`` may remove entries: in a marked folder; not in a missing or
        empty one, where there is nothing to remove.

        Raises:
            UnmarkedCache: the folder holds something but no marker.
        """
        if self.marked():
            return True
        try:
            with os.scandir(self.root) as children:
                if next(children, None) is None:
                    return False
        except FileNotFoundError:
            return False
        except OSError:
            pass  # a file, or unreadable: not the cache's either
        raise UnmarkedCache(self.root, action)

    def _named(self, artifact: Path) -> bool:
        """Whether ``artifact`` is a folder whose record names its path."""
        if artifact.is_symlink() or not artifact.is_dir():
            return False
        record = self._read_record(artifact)
        return record is not None and record.key == self._key(artifact)

    def _read_source(self, folder: Path) -> tuple[str | None, str | None]:
        """A model entry's ``source`` record: the model file's path and the entry it names
        (the key); ``(path, None)`` for an older twostroke's record (the path alone),
        ``(None, None)`` for none, or a file of someone else's."""
        path = folder / SOURCE_RECORD
        try:
            if unsafe_because(path) is not None or path.lstat().st_size > _MAX_SOURCE_RECORD:
                return None, None
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None, None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return text.strip() or None, None  # an absolute path is never JSON
        if (
            isinstance(data, dict)
            and isinstance(data.get("source"), str)
            and isinstance(data.get("key"), str)
        ):
            return data["source"], data["key"]
        return None, None

    def _read_record(self, artifact: Path) -> Record | None:
        path = artifact / RECORD
        try:
            if unsafe_because(path) is not None or path.lstat().st_size > 2**20:
                return None
            return Record.from_json(path.read_bytes())
        except (OSError, ValueError):
            return None

    def _touch(self, entry: Path) -> None:
        """Mark ``entry`` used now (a failure, as in a read-only cache, changes nothing)."""
        marker = entry / LAST_USED
        try:
            os.utime(marker)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        except OSError:
            pass

    def _last_used(self, entry: Path) -> float:
        for path in (entry / LAST_USED, entry):
            with contextlib.suppress(OSError):
                return path.lstat().st_mtime
        return 0.0

    def _model(self, folder: Path) -> CacheEntry:
        source = self._read_source(folder)[0]
        artifacts = tuple(
            (child.name, self._read_record(child) if child.is_dir() else None)
            for child in _children(folder)
            if child.name not in (SOURCE_RECORD, LAST_USED)
        )
        return CacheEntry(
            folder, "model", source, _size(folder), self._last_used(folder), artifacts
        )

    def _library(self, path: Path) -> CacheEntry:
        record = self._read_record(path) if path.is_dir() else None
        source = None if record is None else record.provenance.source
        return CacheEntry(
            path, "library", source, _size(path), self._last_used(path), ((path.name, record),)
        )

    def _leftovers(self, *, older_than: float | None) -> list[Path]:
        """Temporary names the cache gives (``.name.<32 hex digits>.tmp``) in the cache
        folder, its entries and ``native/``."""
        folders = [self.root]
        native = self.root / NATIVE_FOLDER
        if native.is_dir() and not native.is_symlink():
            folders.append(native)
        folders += [entry.path for entry in self.entries()]
        now = time.time()
        found = []
        for folder in folders:
            for child in _children(folder, hidden=True):
                if not _TEMPORARY_NAME.fullmatch(child.name):
                    continue
                with contextlib.suppress(OSError):
                    if older_than is None or now - child.lstat().st_mtime > older_than:
                        found.append(child)
        return found


def _children(folder: Path, *, hidden: bool = False) -> list[Path]:
    """A folder's children, sorted; hidden ones only when asked; none if unreadable."""
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return []
    return [child for child in children if hidden or not child.name.startswith(".")]


def _empty(folder: Path) -> bool:
    """Whether ``folder`` is a folder with nothing in it, hidden names included."""
    try:
        with os.scandir(folder) as children:
            return next(children, None) is None
    except OSError:
        return False


def _size(path: Path) -> int:
    """Bytes of the files at or under ``path``, links not followed."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _remove(path: Path) -> None:
    """Delete a file or folder, if it is there; never raises."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass
