"""What the artifact cache knows about each artifact (who made it from what, and its
checksums), and the rule for what it may read (this user's files, writable by no one else).

Every folder the cache stores (converted weights, a tokenizer, a compiled library) holds a
``record.json``, written into the folder before it is renamed into place, so the record and
the files it describes appear together or not at all. The record says what made the
artifact (the source, torch's version, the CPU personality, the dtype), which
``twostroke cache`` lists, and gives each file's size and checksum, which
:meth:`~twostroke.engine.artifacts.cache.ArtifactCache.open` checks before anything is read.

Two checksums, chosen by what they guard:

* **SHA-256** for compiled libraries and tokenizers: small files (a library is about
  100 kB), so the cost is microseconds, and a library is code that runs in the engine.
* **CRC-32** for the weights, which the loader sums as it reads them
  (:func:`~twostroke.engine.checkpoints.safetensors.read_into`). Measured on SmolLM2's
  538 MB of float32 weights (AVX2 EPYC with SHA-NI, zlib 1.2.13, one core, the file in the
  page cache): reading them into the parameters takes 0.066 s, and 0.22 s with the CRC-32
  summed as they come; a SHA-256 of the data in memory takes 0.36 s, BLAKE2b 0.70 s, and
  0.86-1.0 s each with a read of its own. A CRC-32 catches every error burst of up to 32
  bits, so a flipped bit, byte or word is always caught, and any other damage but for one
  chance in 2**32. (A sum of 64-bit words with numpy takes 0.03 s and catches one flipped
  word too, but not blocks that changed places; xxHash would be as fast and as thorough,
  and a dependency more.) It is no defence against someone who can write the cache: the
  owner and mode checks of :func:`unsafe_because` are.

This module does no I/O on import and uses the standard library alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import attrs

from twostroke.states.errors import EngineError

__all__ = [
    "RECORD",
    "Checksum",
    "DamagedArtifact",
    "FileDigest",
    "Provenance",
    "Record",
    "UnsafeCachePath",
    "UnusableArtifact",
    "check_file",
    "crc32_digest",
    "digest_file",
    "make_private",
    "record_folder",
    "unsafe_because",
    "write_private",
]

#: The file in each stored folder that records where it came from and its checksums.
RECORD = "record.json"

#: Bumped when a record's fields change; a record of another format is not read.
RECORD_FORMAT = 2

#: A record longer than this is damage (SmolLM2's tokenizer's is a few hundred bytes).
_MAX_RECORD = 2**20

Checksum = Literal["sha256", "crc32"]
_CHECKSUMS: tuple[Checksum, ...] = ("sha256", "crc32")


class UnusableArtifact(EngineError, ValueError):
    """Something in the cache that must not be read.

    Attributes:
        path: The file or folder at fault.
        problem: What is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class DamagedArtifact(UnusableArtifact):
    """An artifact whose files differ from its record, or that has no valid record: it is
    removed and made again."""


class UnsafeCachePath(UnusableArtifact):
    """A cache folder that another user owns or may write: nothing in it is read, and
    nothing is written to it (libraries are built in a private folder instead)."""


@attrs.frozen
class Provenance:
    """What made an artifact (every field but ``what`` is optional).

    Attributes:
        what: The kind: ``"weights"``, ``"tokenizer"``, ``"library"``.
        source: The model file, or the C source, it was made from.
        torch: torch's version.
        isa: The CPU personality (:meth:`twostroke.gpu.isa.Personality.describe`).
        dtype: The element type, where it has one.
        detail: Anything else that tells two artifacts of one source apart (a library's
            defines).
    """

    what: str
    source: str | None = None
    torch: str | None = None
    isa: str | None = None
    dtype: str | None = None
    detail: str | None = None


@attrs.frozen
class FileDigest:
    """One file of an artifact: its size in bytes and its checksum (hexadecimal)."""

    size: int
    digest: str


@attrs.frozen
class Record:
    """An artifact's ``record.json``.

    Attributes:
        key: The artifact's path relative to the cache folder, POSIX style: a record read
            anywhere else belongs to another artifact (a folder that was moved).
        provenance: What made it.
        checksum: How ``files`` are summed.
        files: Each file's path in the artifact folder, its size and its checksum.
        created: When it was stored (seconds since the epoch).
    """

    key: str
    provenance: Provenance
    checksum: Checksum
    files: Mapping[str, FileDigest]
    created: float

    def to_json(self) -> str:
        """The record as ``record.json`` holds it."""
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "key": self.key,
                **attrs.asdict(self.provenance),
                "checksum": self.checksum,
                "files": {name: [file.size, file.digest] for name, file in self.files.items()},
                "created": self.created,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Record:
        """Parse a ``record.json``.

        Raises:
            ValueError: it is not a record of this format (damage, not a wrong argument:
                never ``TypeError``); the message says what is wrong.
        """
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"the record is not JSON ({error})") from error
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise ValueError(f"the record is not of format {RECORD_FORMAT}")
        fields = {}
        for name in ("key", "what", "checksum"):
            if not isinstance(data.get(name), str):
                raise ValueError(f"the record's {name} is not a string")  # noqa: TRY004
        for name in ("source", "torch", "isa", "dtype", "detail"):
            value = data.get(name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"the record's {name} is not a string")
            fields[name] = value
        if data["checksum"] not in _CHECKSUMS:
            raise ValueError(
                f"the record's checksum {data['checksum']!r} is not one of {_CHECKSUMS}"
            )
        files = data.get("files")
        if not isinstance(files, dict) or not files:
            raise ValueError("the record names no files")
        digests = {}
        for name, entry in files.items():
            if (
                not isinstance(entry, list)
                or len(entry) != 2
                or not isinstance(entry[0], int)
                or not isinstance(entry[1], str)
                or not _inside(name)
            ):
                raise ValueError(f"the record's entry for {name!r} is not [size, checksum]")
            digests[name] = FileDigest(entry[0], entry[1])
        created = data.get("created")
        if not isinstance(created, int | float):
            raise ValueError("the record's created is not a number")  # noqa: TRY004
        return cls(
            key=data["key"],
            provenance=Provenance(what=data["what"], **fields),
            checksum=data["checksum"],
            files=digests,
            created=float(created),
        )


def _inside(name: str) -> bool:
    """Whether a recorded file name stays inside its artifact folder."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def crc32_digest(crc: int) -> str:
    """A CRC-32 as records write it."""
    return f"{crc & 0xFFFFFFFF:08x}"


def digest_file(path: Path, checksum: Checksum) -> str:
    """The checksum of a file's bytes, as records write it."""
    with path.open("rb", buffering=0) as file:
        if checksum == "sha256":
            return hashlib.file_digest(file, "sha256").hexdigest()
        crc, buffer = 0, bytearray(4 * 2**20)
        view = memoryview(buffer)
        while count := file.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
        return crc32_digest(crc)


def unsafe_because(path: Path, *, follow: bool = False) -> str | None:
    """Why ``path`` may not be trusted, or ``None``: the rule is that everything the cache
    reads belongs to this user and is writable by no one else (a library in it runs in
    the engine: another user who could write it would run their code there).

    Args:
        path: A file or folder that exists.
        follow: Follow a symbolic link (the cache folder itself may be one); below it, a
            link is refused, since the cache never makes one.

    Raises:
        OSError: ``path`` cannot be examined (it does not exist, say).
    """
    status = path.stat() if follow else path.lstat()
    if stat.S_ISLNK(status.st_mode):
        return "is a symbolic link (the cache makes none)"
    user = os.geteuid()
    if status.st_uid != user:
        return f"is owned by uid {status.st_uid}, not by this user (uid {user})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(status.st_mode)
        return f"is writable by its group or by others (mode {mode:04o})"
    return None


def make_private(folder: Path) -> None:
    """Make a folder about to be stored private: folders 0700, files 0600 (whatever the
    umask made them), and no links.

    Raises:
        ValueError: it holds a symbolic link.
        OSError: it cannot be walked or changed.
    """
    os.chmod(folder, 0o700)
    for parent, folders, files in os.walk(folder):
        for name in [*folders, *files]:
            path = os.path.join(parent, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise ValueError(f"{path} is a symbolic link; an artifact holds files only")
            os.chmod(path, 0o700 if stat.S_ISDIR(mode) else 0o600)


def record_folder(folder: Path, *, key: str, provenance: Provenance, checksum: Checksum) -> Record:
    """The record of every file in ``folder`` (but a record already there).

    Raises:
        ValueError: the folder holds no file.
    """
    files = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = Path(parent) / name
            relative = path.relative_to(folder).as_posix()
            if relative != RECORD:
                files[relative] = FileDigest(path.lstat().st_size, digest_file(path, checksum))
    if not files:
        raise ValueError(f"{folder} holds no file to store")
    return Record(
        key=key, provenance=provenance, checksum=checksum, files=files, created=time.time()
    )


def write_private(path: Path, text: str) -> None:
    """Write a new file, mode 0600 whatever the umask (never through a link)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(text)


def check_file(path: Path, expected: FileDigest, checksum: Checksum, *, summed: bool) -> None:
    """Refuse a recorded file that is not this user's alone, or not as recorded.

    Args:
        path: The file.
        expected: Its record.
        checksum: How ``expected.digest`` was summed.
        summed: Check the checksum too (else the size only).

    Raises:
        DamagedArtifact: the file is missing, not a regular file, not this user's alone,
            or differs from its record; the message says which.
    """
    try:
        problem = unsafe_because(path)
        status = path.lstat()
    except FileNotFoundError:
        raise DamagedArtifact(path, "is missing") from None
    except OSError as error:
        raise DamagedArtifact(path, f"cannot be examined ({error})") from error
    if problem is None and not stat.S_ISREG(status.st_mode):
        problem = "is not a regular file"
    if problem is not None:
        raise DamagedArtifact(path, problem)
    if status.st_size != expected.size:
        raise DamagedArtifact(
            path, f"holds {status.st_size} bytes, its record says {expected.size}"
        )
    if summed:
        try:
            digest = digest_file(path, checksum)
        except OSError as error:
            raise DamagedArtifact(path, f"cannot be read ({error})") from error
        if digest != expected.digest:
            raise DamagedArtifact(
                path, f"its {checksum} is {digest}, its record says {expected.digest}"
            )
