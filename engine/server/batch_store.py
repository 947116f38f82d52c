"""Files and batches of the Batch API: what ``/v1/files`` and ``/v1/batches`` keep.

An uploaded file (``purpose: "batch"``, JSONL), each batch (its record: status, timestamps,
file ids) and each answered line of a batch are rows of one SQLite database, so a batch
outlives the server that ran it: a new server on the same file resumes it, keeping the lines
already answered (:mod:`~twostroke.engine.server.batches`).

**Where.** ``ServerConfig.batches_store``; by default ``batches.sqlite3`` beside the response
store's default file (``responses/`` in the artifact cache folder), or ``:memory:``. The same
rules as :mod:`~twostroke.engine.server.response_store`: the folder is made 0700, the file
0600 (it holds prompts and answers), each call runs in a worker thread, one at a time, on one
connection.

**Bounded.** Files (uploads and outputs) hold at most ``max_bytes`` bytes in all: an upload
past it is refused (the client deletes files to make room); an output file is always written,
since its batch's lines were answered (it holds at most ``max_lines`` answers, each at most a
response's size). Nothing expires on its own: a file lives until it is deleted.

**Whose.** Every row carries its owner (a SHA-256 of the API key,
:func:`~twostroke.engine.server.response_store.owner_of`): another key neither reads, lists,
cancels nor deletes it.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import msgspec

from twostroke.engine.errors import EngineError
from twostroke.engine.server.database import MEMORY, Database
from twostroke.engine.server.response_store import default_store_path

__all__ = ["BatchStore", "BatchStoreError", "default_batches_path"]

logger = logging.getLogger("twostroke.server")


_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    record BLOB NOT NULL,
    size INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created INTEGER NOT NULL,
    record BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_by_age ON batches (created);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    record BLOB NOT NULL,
    PRIMARY KEY (batch_id, line)
);
"""

#: The statuses of a batch that the runner still has work for.
OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


class BatchStoreError(EngineError):
    """The batch store's database could not be opened, read or written (its message names
    the file, the action and SQLite's or the system's error)."""


def default_batches_path() -> str:
    """The batch store's file when ``batches_store`` is ``None``: ``batches.sqlite3`` beside
    the response store's default file, or :data:`MEMORY` when that is in memory."""
    responses = default_store_path()
    if responses == MEMORY:
        return MEMORY
    return str(Path(responses).with_name("batches.sqlite3"))


class BatchStore:
    """Files, batches and batch results in a SQLite database, files bounded in bytes.

    No I/O here: the database is opened by the first call, in a worker thread. Every public
    call is a checkpoint; a cancelled caller waits for its call to finish (it is never
    abandoned mid-write). :meth:`aclose` closes the connection.

    Args:
        path: The database file, or :data:`MEMORY`.
        max_bytes: The most bytes the stored files may hold in all (uploads past it are
            refused).

    Raises:
        ValueError: ``max_bytes`` below 1.
    """

    def __init__(self, path: str, *, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self._db = Database(path, _SCHEMA, name="the batch store", error=BatchStoreError)

    def __repr__(self) -> str:
        return f"<BatchStore {self.path!r} max_bytes={self.max_bytes}>"

    # --- files ------------------------------------------------------------------------------

    async def put_file(
        self, owner: str, record: dict[str, Any], content: bytes, *, bounded: bool = True
    ) -> bool:
        """Store a file (``record["id"]`` is its key) with its bytes.

        Args:
            bounded: Whether ``max_bytes`` applies (uploads); output files are always kept.

        Returns:
            Whether it was stored: ``False`` when the stored files and it would pass
            ``max_bytes``.

        Raises:
            BatchStoreError: the database could not be written.
        """
        encoded = msgspec.json.encode(record)

        def put(db: sqlite3.Connection) -> bool:
            with db:
                (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM files").fetchone()
                if bounded and total + len(content) > self.max_bytes:
                    return False
                db.execute(
                    "INSERT INTO files VALUES (?, ?, ?, ?, ?)",
                    (record["id"], owner, encoded, len(content), content),
                )
            return True

        return await self._db.run("write", put)

    async def file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        """The record of ``owner``'s file ``file_id``, or ``None``.

        Raises:
            BatchStoreError: the database could not be read.
        """
        row = await self._db.run(
            "read",
            lambda db: db.execute(
                "SELECT record FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).fetchone(),
        )
        return None if row is None else msgspec.json.decode(row[0])

    async def file_content(self, owner: str, file_id: str) -> bytes | None:
        """The bytes of ``owner``'s file ``file_id``, or ``None``.

        Raises:
            BatchStoreError: the database could not be read.
        """
        row = await self._db.run(
            "read",
            lambda db: db.execute(
                "SELECT content FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).fetchone(),
        )
        return None if row is None else bytes(row[0])

    async def delete_file(self, owner: str, file_id: str) -> bool:
        """Delete ``owner``'s file ``file_id``; whether there was one.

        Raises:
            BatchStoreError: the database could not be written.
        """

        def delete(db: sqlite3.Connection) -> bool:
            with db:
                cursor = db.execute(
                    "DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)
                )
            return cursor.rowcount > 0

        return await self._db.run("write", delete)

    # --- batches ----------------------------------------------------------------------------

    async def put_batch(self, owner: str, record: dict[str, Any]) -> None:
        """Store (insert or replace) a batch's record, ``record["id"]`` its key.

        Raises:
            BatchStoreError: the database could not be written.
        """
        encoded = msgspec.json.encode(record)

        def put(db: sqlite3.Connection) -> None:
            with db:
                db.execute(
                    "INSERT INTO batches VALUES (?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                    "record = excluded.record",
                    (record["id"], owner, record["created_at"], encoded),
                )

        await self._db.run("write", put)

    async def batch(self, owner: str | None, batch_id: str) -> dict[str, Any] | None:
        """The record of batch ``batch_id`` (``owner``'s; any owner's when ``None``, for the
        runner), with its ``request_counts`` from the answered lines, or ``None``.

        Raises:
            BatchStoreError: the database could not be read.
        """

        def read(db: sqlite3.Connection) -> tuple[bytes, int, int] | None:
            row = db.execute(
                "SELECT record FROM batches WHERE id = ? AND (? IS NULL OR owner = ?)",
                (batch_id, owner, owner),
            ).fetchone()
            if row is None:
                return None
            done, failed = db.execute(
                "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0) FROM results "
                "WHERE batch_id = ?",
                (batch_id,),
            ).fetchone()
            return row[0], done, failed

        found = await self._db.run("read", read)
        return None if found is None else _with_counts(*found)

    async def batches(
        self, owner: str, *, limit: int, after: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        """``owner``'s batches, newest first, at most ``limit`` after the batch ``after``.

        Returns:
            The page and whether more follow it.

        Raises:
            BatchStoreError: the database could not be read.
        """

        def read(db: sqlite3.Connection) -> list[tuple[bytes, int, int]]:
            start = (1 << 62, "~")  # past any batch: newest first from the top
            if after is not None:
                row = db.execute(
                    "SELECT created, id FROM batches WHERE id = ? AND owner = ?", (after, owner)
                ).fetchone()
                start = start if row is None else (row[0], row[1])
            rows = db.execute(
                "SELECT id, record FROM batches WHERE owner = ? AND (created, id) < (?, ?) "
                "ORDER BY created DESC, id DESC LIMIT ?",
                (owner, start[0], start[1], limit + 1),
            ).fetchall()
            counted = []
            for batch_id, record in rows:
                done, failed = db.execute(
                    "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0) FROM results "
                    "WHERE batch_id = ?",
                    (batch_id,),
                ).fetchone()
                counted.append((record, done, failed))
            return counted

        rows = await self._db.run("read", read)
        return [_with_counts(*row) for row in rows[:limit]], len(rows) > limit

    async def open_batches(self) -> list[tuple[str, str]]:
        """Every batch the runner still has work for, oldest first, as (owner, id).

        Raises:
            BatchStoreError: the database could not be read.
        """

        def read(db: sqlite3.Connection) -> list[tuple[str, str]]:
            rows = db.execute("SELECT owner, id, record FROM batches ORDER BY created, id")
            return [
                (owner, batch_id)
                for owner, batch_id, record in rows
                if msgspec.json.decode(record)["status"] in OPEN_STATUSES
            ]

        return await self._db.run("read", read)

    # --- results ----------------------------------------------------------------------------

    async def put_results(self, batch_id: str, results: list[tuple[int, bool, bytes]]) -> None:
        """Record answered lines of a batch, as (line, ok, output line); a line answered
        already keeps its first answer.

        Raises:
            BatchStoreError: the database could not be written.
        """

        def put(db: sqlite3.Connection) -> None:
            with db:
                db.executemany(
                    "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                    [(batch_id, line, int(ok), record) for line, ok, record in results],
                )

        await self._db.run("write", put)

    async def answered(self, batch_id: str) -> set[int]:
        """The lines of ``batch_id`` answered already.

        Raises:
            BatchStoreError: the database could not be read.
        """
        rows = await self._db.run(
            "read",
            lambda db: db.execute(
                "SELECT line FROM results WHERE batch_id = ?", (batch_id,)
            ).fetchall(),
        )
        return {line for (line,) in rows}

    async def results(self, batch_id: str) -> tuple[bytes, bytes]:
        """The output file and the error file of ``batch_id``: its answered lines in input
        order, JSONL.

        Raises:
            BatchStoreError: the database could not be read.
        """

        def read(db: sqlite3.Connection) -> tuple[bytes, bytes]:
            files: tuple[list[bytes], list[bytes]] = ([], [])
            for ok, record in db.execute(
                "SELECT ok, record FROM results WHERE batch_id = ? ORDER BY line", (batch_id,)
            ):
                files[0 if ok else 1].append(bytes(record) + b"\n")
            return b"".join(files[0]), b"".join(files[1])

        return await self._db.run("read", read)

    async def aclose(self) -> None:
        """Close the database (a later call opens it again). Shielded: it always closes."""
        await self._db.aclose()


def _with_counts(record: bytes, done: int, failed: int) -> dict[str, Any]:
    batch: dict[str, Any] = msgspec.json.decode(record)
    batch["request_counts"] = {
        "total": batch["request_counts"]["total"],
        "completed": done,
        "failed": failed,
    }
    return batch
