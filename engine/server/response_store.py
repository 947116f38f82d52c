"""Stored Responses: what ``/v1/responses`` keeps for ``previous_response_id`` and ``GET``.

A Response created with ``store`` (the default, as OpenAI's) is written to a SQLite database
(the standard library's ``sqlite3``) with the conversation it answered: every input item of
its context, each with an id, the items of the responses it continues included. A request
that names it as ``previous_response_id`` continues from those items and its output; ``GET
/v1/responses/{id}`` reads it back, ``DELETE`` removes it, ``GET .../input_items`` lists its
input items a page at a time.

**Where.** A file (``ServerConfig.responses_store``; by default ``responses/responses.sqlite3``
in the artifact cache folder), so that a response outlives the server that made it, or
``:memory:``, gone with the server. The folder is created mode 0700 and the file 0600: it
holds conversations.

**Bounded.** At most ``max_count`` responses holding at most ``max_bytes`` bytes of JSON, none
older than ``max_age`` seconds: each write first drops what has expired, then the oldest
until the new one fits; a response past its age is gone for every reader at once, whether
or not a write dropped it yet. One response larger than ``max_bytes`` on its own is not
stored (its ``store`` reads ``false``).

**Whose.** Each response belongs to the API key it was made with, as a SHA-256 of the key
(never the key): another key neither reads, continues, lists nor deletes it. Without a key,
all clients share one namespace.

**Off the event loop.** SQLite calls block (a write waits for the disk), so each one runs in
a worker thread, one at a time (a capacity limiter of 1), on one connection opened there
lazily with ``check_same_thread=False``. One serialized connection rather than one a thread:
SQLite lets one writer at a time into a file anyway, ``:memory:`` is one database per
connection, and anyio's worker threads come and go on their own, so a connection per thread
could not be closed by the store that opened it. Each call takes a few milliseconds; a
cancelled caller waits for its call to finish (it is not abandoned mid-write).
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import attrs
import msgspec

from twostroke.engine.errors import EngineError
from twostroke.engine.server.database import MEMORY, Database

__all__ = [
    "MEMORY",
    "ResponseStore",
    "ResponseStoreError",
    "StoredResponse",
    "default_store_path",
    "owner_of",
]

logger = logging.getLogger("twostroke.server")


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    size INTEGER NOT NULL,
    response BLOB NOT NULL,
    input BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created);
"""


class ResponseStoreError(EngineError):
    """The response store's database could not be opened, read or written (its message
    names the file, the action and SQLite's or the system's error)."""


def default_store_path() -> str:
    """The store's file when ``responses_store`` is ``None``: ``responses/responses.sqlite3``
    in the artifact cache folder (``$TWOSTROKE_CACHE_DIR``, ``$XDG_CACHE_HOME/twostroke`` or
    ``~/.cache/twostroke``), or :data:`MEMORY` when ``TWOSTROKE_NO_CACHE=1``."""
    from twostroke.engine.artifacts.cache import ArtifactCache

    cache = ArtifactCache.from_environment()
    if cache is None:
        return MEMORY
    return str(cache.root / "responses" / "responses.sqlite3")


def owner_of(api_key: str | None) -> str:
    """The namespace of responses made with ``api_key``: a SHA-256 of it, never the key;
    ``""`` without one."""
    if api_key is None:
        return ""
    return hashlib.sha256(b"twostroke-responses\0" + api_key.encode()).hexdigest()


@attrs.frozen
class StoredResponse:
    """A stored Response and the input items of its context.

    Attributes:
        response: The Response object, as ``GET /v1/responses/{id}`` answers it.
        input_items: Every input item of its context, in order, each with an ``id``.
    """

    response: dict[str, Any]
    input_items: list[dict[str, Any]]


class ResponseStore:
    """Responses in a SQLite database, bounded in count, bytes and age.

    No I/O here: the database is opened by the first call, in a worker thread. Every public
    call is a checkpoint; :meth:`aclose` closes the connection.

    Args:
        path: The database file, or :data:`MEMORY`.
        max_count: The most responses kept.
        max_bytes: The most bytes of JSON (responses and their input items) kept.
        max_age: Seconds a response is kept after it was stored.
        clock: Seconds since the epoch (``time.time``; tests give a fake one).

    Raises:
        ValueError: a bound below 1 (the message names it and the value).
    """

    def __init__(
        self,
        path: str,
        *,
        max_count: int,
        max_bytes: int,
        max_age: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for name, value in (("max_count", max_count), ("max_bytes", max_bytes)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not max_age > 0:
            raise ValueError(f"max_age must be > 0 seconds, got {max_age}")
        self.path = path
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.max_age = max_age
        self._clock = clock
        self._db = Database(path, _SCHEMA, name="the response store", error=ResponseStoreError)

    def __repr__(self) -> str:
        return (
            f"<ResponseStore {self.path!r} max_count={self.max_count} "
            f"max_bytes={self.max_bytes} max_age={self.max_age:g}s>"
        )

    async def put(
        self, owner: str, response: dict[str, Any], input_items: list[dict[str, Any]]
    ) -> bool:
        """Store ``response`` (its ``id`` is the key) with the input items of its context.

        Drops expired responses, then the oldest until the new one fits the bounds.

        Returns:
            Whether it was stored: ``False`` when it alone is larger than ``max_bytes``.

        Raises:
            ResponseStoreError: the database could not be written.
        """
        body, items = msgspec.json.encode(response), msgspec.json.encode(input_items)
        return await self._db.run(
            "write", lambda db: self._put(db, owner, response["id"], body, items)
        )

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The response ``response_id`` of ``owner`` with its input items, or ``None`` when
        there is none (never stored, deleted, evicted, expired, or another owner's).

        Raises:
            ResponseStoreError: the database could not be read.
        """
        row = await self._db.run("read", lambda db: self._get(db, owner, response_id))
        if row is None:
            return None
        return StoredResponse(msgspec.json.decode(row[0]), msgspec.json.decode(row[1]))

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete the response ``response_id`` of ``owner``.

        Returns:
            Whether there was one to delete.

        Raises:
            ResponseStoreError: the database could not be written.
        """

        def delete(db: sqlite3.Connection) -> bool:
            with db:
                cursor = db.execute(
                    "DELETE FROM responses WHERE id = ? AND owner = ? AND created >= ?",
                    (response_id, owner, self._clock() - self.max_age),
                )
            return cursor.rowcount > 0

        return await self._db.run("write", delete)

    async def aclose(self) -> None:
        """Close the database (a later call opens it again). Shielded: it always closes."""
        await self._db.aclose()

    def _put(
        self, db: sqlite3.Connection, owner: str, response_id: str, body: bytes, items: bytes
    ) -> bool:
        size = len(body) + len(items)
        if size > self.max_bytes:
            logger.warning(
                "response %s not stored: its %d bytes pass the store's max_bytes, %d",
                response_id, size, self.max_bytes,
            )  # fmt: skip
            return False
        now = self._clock()
        with db:
            db.execute("DELETE FROM responses WHERE created < ?", (now - self.max_age,))
            count, total = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses"
            ).fetchone()
            if count + 1 > self.max_count or total + size > self.max_bytes:
                evicted = []
                for old_id, old_size in db.execute(
                    "SELECT id, size FROM responses ORDER BY created, rowid"
                ):
                    if count + 1 <= self.max_count and total + size <= self.max_bytes:
                        break
                    evicted.append((old_id,))
                    count, total = count - 1, total - old_size
                db.executemany("DELETE FROM responses WHERE id = ?", evicted)
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (response_id, owner, now, size, body, items),
            )
        return True

    def _get(
        self, db: sqlite3.Connection, owner: str, response_id: str
    ) -> tuple[bytes, bytes] | None:
        row = db.execute(
            "SELECT response, input FROM responses WHERE id = ? AND owner = ? AND created >= ?",
            (response_id, owner, self._clock() - self.max_age),
        ).fetchone()
        return None if row is None else (row[0], row[1])
