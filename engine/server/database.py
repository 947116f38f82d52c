"""The SQLite database under each of the server's stores (stored responses, batches).

One file, or :data:`MEMORY`, opened by the first call, in a worker thread; its folder is made
0700 and the file 0600 (it holds prompts and answers). Every call runs in a worker thread, one
at a time, on one connection: SQLite writes one at a time anyway, ``:memory:`` is one
database per connection, and anyio makes and reaps its worker threads itself, so a connection
per thread could never be closed by its owner. Nothing blocking runs on the event loop.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread

from twostroke.engine.errors import EngineError

__all__ = ["MEMORY", "Database"]

#: The path of a database kept in memory, gone with the server.
MEMORY = ":memory:"

_T = TypeVar("_T")


class Database:
    """A SQLite database that one store calls into, a call at a time, off the event loop.

    No I/O here: the first call opens the file (and makes its schema).

    Args:
        path: The database file, or :data:`MEMORY`.
        schema: SQL that makes its tables where they do not exist.
        name: What the store is called in errors (``"the response store"``).
        error: The store's error, raised for SQLite's and the system's failures.
    """

    def __init__(self, path: str, schema: str, *, name: str, error: type[EngineError]) -> None:
        self.path = path
        self._schema = schema
        self._name = name
        self._error = error
        self._connection: sqlite3.Connection | None = None
        self._limiter = anyio.CapacityLimiter(1)

    async def run(self, action: str, call: Callable[[sqlite3.Connection], _T]) -> _T:
        """``call(connection)`` in a worker thread, after the calls before it. A cancelled
        caller waits for it to finish: a write is never abandoned halfway.

        Raises:
            EngineError: the store's ``error``, naming the file, ``action`` (``"read"``,
                ``"write"``) and SQLite's or the system's error.
        """

        def run() -> _T:
            try:
                return call(self._open())
            except (sqlite3.Error, OSError) as exc:  # a folder or file it cannot make too
                raise self._error(
                    f"{self._name} {self.path!r} could not {action}: {type(exc).__name__}: {exc}"
                ) from exc

        return await anyio.to_thread.run_sync(run, limiter=self._limiter)

    async def aclose(self) -> None:
        """Close the connection (a later call opens it again). Shielded: it always closes."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._close, limiter=self._limiter)

    def _open(self) -> sqlite3.Connection:
        if self._connection is not None:
            return self._connection
        if self.path != MEMORY:
            file = Path(self.path)
            file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not file.exists():  # created private: it holds prompts and answers
                os.close(os.open(file, os.O_CREAT | os.O_WRONLY, 0o600))
        connection = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            connection.executescript(self._schema)
            if self.path != MEMORY:
                connection.execute("PRAGMA journal_mode = WAL")
            connection.isolation_level = "DEFERRED"  # `with db:` commits what DML opened
        except BaseException:
            connection.close()
            raise
        self._connection = connection
        return connection

    def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
