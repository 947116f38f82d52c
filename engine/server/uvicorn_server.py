"""The server on asyncio: uvicorn, with a header deadline, a connection limit and a graceful end.

uvicorn gives a connection unlimited time to send its request headers (its keep-alive timer
starts only after a response, and any byte resets it), and its ``limit_concurrency`` answers
``text/plain``. :func:`http_protocol` subclasses its HTTP/1.1 protocol (h11, chosen explicitly
so that the hooks below exist whatever else is installed) to close a connection whose headers
are late and to answer connections over the limit in OpenAI's shape. Hypercorn's side is
:mod:`~twostroke.engine.server.hypercorn_server`; :mod:`~twostroke.engine.server.serve` says
what both guarantee.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import anyio.abc
from starlette.types import ASGIApp

from twostroke.engine.server.guards import ServerShutdown
from twostroke.engine.server.transport import (
    HTTP2_REFUSAL,
    Transport,
    bind_socket,
    expire_after,
)

__all__ = ["http_protocol", "serve_uvicorn"]


def http_protocol(header_timeout: float, max_connections: int, busy_app: ASGIApp) -> type[Any]:
    """uvicorn's h11 protocol with a deadline on request headers and a connection limit.

    Args:
        header_timeout: Seconds from a connection's start, or from its previous response, to
            the end of its next request's headers; later, the connection is closed.
        max_connections: Connections past this many are answered by ``busy_app``.
        busy_app: The application for a connection over the limit.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _answered: object = None  # the cycle whose response completed last
        _fresh = True  # no byte received yet

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.app = busy_app
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._fresh and data.startswith(b"PRI * HTTP/2.0"):
                self.transport.write(HTTP2_REFUSAL)  # cleartext HTTP/2: not spoken here
                self.transport.close()
                return
            self._fresh = False
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self.cycle is not self._answered:
                self._disarm()  # a new request's headers are in

        def on_response_complete(self) -> None:
            self._answered = self.cycle
            self._arm()  # before the next request's events, which super() may handle at once
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return Protocol


async def serve_uvicorn(
    app: ASGIApp,
    busy_app: ASGIApp,
    transport: Transport,
    shutdown: ServerShutdown,
    task_status: anyio.abc.TaskStatus[int],
) -> None:
    """Serve ``app`` with uvicorn until cancelled, then shut down as :func:`serve` documents."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=transport.host,
        port=transport.port,
        http=http_protocol(
            transport.config.header_timeout, transport.config.max_connections, busy_app
        ),
        lifespan="off",  # the engine's lifetime is the caller's business, not the app's
        log_config=None,  # never reconfigure the embedding program's logging
        access_log=transport.access_log,
        timeout_graceful_shutdown=None,  # bounded below, where the grace period ends streams
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    sock = bind_socket(transport.host, transport.port)
    # uvicorn's own serve() would install signal handlers over the caller's; its parts
    # (startup, main_loop, shutdown) are public and leave signals alone.
    with sock:
        await server.startup(sockets=[sock])
        try:
            task_status.started(sock.getsockname()[1])
            await server.main_loop()
        finally:
            with anyio.CancelScope(shield=True):
                shutdown.begin()
                server.should_exit = True
                # shutdown() stops accepting, closes idle connections and waits for the
                # others; at the end of the grace period the open responses are ended.
                grace = transport.config.shutdown_timeout
                with anyio.move_on_after(grace + transport.closing):
                    async with anyio.create_task_group() as task_group:
                        task_group.start_soon(expire_after, shutdown, grace)
                        await server.shutdown(sockets=[sock])
                        task_group.cancel_scope.cancel()
                shutdown.expire()
                # What still runs has a client that does not read: nothing of ours may
                # outlive this call. abort(), not close(): close() waits to flush a buffer
                # that client never takes, holding the socket open.
                for connection in list(server.server_state.connections):
                    connection.transport.abort()
                tasks = list(server.server_state.tasks)
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.wait(tasks)
