"""The server on trio: Hypercorn's HTTP/1.1 protocol under an accept loop of our own.

``hypercorn.trio.serve`` runs every connection in one nursery: an exception in any connection
(Hypercorn #329: its HTTP/2 handler raises ``KeyError`` on DATA for a stream it has already
answered, which any client without a key can trigger) ends the whole server. It also cuts
open responses at once when cancelled without a ``shutdown_trigger``. So this module accepts
connections itself and hands each to Hypercorn's per-connection ``TCPServer``:

* a connection that fails is logged and closed; the others and the server go on;
* cleartext HTTP/2 is refused: a prior-knowledge preface gets a GOAWAY
  (``HTTP_1_1_REQUIRED``) and an ``Upgrade: h2c`` is ignored (answered in HTTP/1.1, as RFC
  9110 allows), so Hypercorn's HTTP/2 handler never runs (uvicorn speaks only HTTP/1.1);
* connections over the limit are answered with a 503;
* a connection's request headers are due within the header timeout of its start or its last
  response (Hypercorn's idle timer, which only a complete request header stops);
* the caller's cancellation does not reach the connections: the shutdown lets them finish,
  then ends them (:func:`~twostroke.engine.server.serve.serve`).

Hypercorn's internals are used here, so pyproject.toml pins its version.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, cast

import anyio
import anyio.abc
from starlette.types import ASGIApp

from twostroke.engine.server.guards import ServerShutdown
from twostroke.engine.server.transport import HTTP2_REFUSAL, Transport, bind_socket

__all__ = ["serve_hypercorn"]

logger = logging.getLogger("twostroke.server")


# What trio's serve_listeners waits out rather than raises.
_ACCEPT_CAPACITY_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


class Http2Refused(Exception):
    """A connection opened with HTTP/2's preface; it was answered with a GOAWAY."""


class _Connections:
    """The open connections, each running under a cancel scope of its own."""

    def __init__(self) -> None:
        self._open: dict[anyio.CancelScope, Any] = {}  # scope -> its trio.SocketStream
        self._empty = anyio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._open)

    def add(self, scope: anyio.CancelScope, stream: Any) -> None:
        self._open[scope] = stream
        if self._empty.is_set():
            self._empty = anyio.Event()

    def discard(self, scope: anyio.CancelScope) -> None:
        self._open.pop(scope, None)
        if not self._open:
            self._empty.set()

    async def wait_empty(self) -> None:
        await self._empty.wait()

    def cut_all(self) -> None:
        """Cancel every connection and close its socket.

        Hypercorn writes under a shield, so a client that does not read holds a write no
        cancellation ends; closing the socket ends it (trio wakes the writer with an error).
        """
        for scope, stream in self._open.items():
            scope.cancel()
            stream.socket.close()


def _connection_class() -> Any:
    """Hypercorn's ``TCPServer`` for cleartext HTTP/1.1 only (built when Hypercorn is imported)."""
    import h11
    from hypercorn.events import RawData
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.trio.task_group import TaskGroup
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import parse_socket_addr

    class Http11(H11Protocol):
        async def _check_protocol(self, event: h11.Request) -> None:
            # Hypercorn's own switches to its HTTP/2 handler; this never does.
            if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
                await self.send(RawData(data=HTTP2_REFUSAL))
                raise Http2Refused

    class Connection(TCPServer):
        async def run(self) -> None:
            # TCPServer.run without TLS and with Http11 for Hypercorn's protocol switch.
            socket = self.stream.socket
            try:
                client = parse_socket_addr(socket.family, socket.getpeername())
                server = parse_socket_addr(socket.family, socket.getsockname())
                async with TaskGroup() as task_group:
                    self._task_group = task_group
                    self.protocol = Http11(  # type: ignore[assignment]
                        self.app,
                        self.config,
                        self.context,
                        task_group,
                        ConnectionState(self.state),
                        False,
                        client,
                        server,
                        self.protocol_send,
                    )
                    await self.protocol.initiate()
                    await self.idle_task.restart(task_group, self._idle_timeout)
                    await self._read_data()
                    # The client is gone: Hypercorn's idle timer would hold the connection
                    # (and its place under the limit) until it fires.
                    await self.idle_task.stop()
            finally:
                await self._close()

        async def _close(self) -> None:
            # Hypercorn closes a connection from inside the application's last send when it
            # is not kept alive; a cancellation of the application at that moment (ours on a
            # disconnect, say) would leave it open until the client closes it.
            with anyio.CancelScope(shield=True):
                await super()._close()

    return Connection


async def serve_hypercorn(
    app: ASGIApp,
    busy_app: ASGIApp,
    transport: Transport,
    shutdown: ServerShutdown,
    task_status: anyio.abc.TaskStatus[int],
) -> None:
    """Serve ``app`` with Hypercorn until cancelled, then shut down as :func:`serve` documents."""
    import trio
    from hypercorn.config import Config
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.utils import wrap_app

    config = Config()
    host, port = transport.host, transport.port
    config.errorlog = logger
    config.accesslog = logger if transport.access_log else None
    # Hypercorn's idle timer runs from a connection's start and from each response to the
    # end of the next request's headers: exactly the header deadline.
    config.keep_alive_timeout = transport.config.header_timeout
    connection_class = _connection_class()
    # cast: Hypercorn types ASGI messages as TypedDicts, Starlette as plain mappings.
    wrapped = wrap_app(cast(Any, app), config.wsgi_max_body_size, "asgi")
    busy = wrap_app(cast(Any, busy_app), config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)
    connections = _Connections()

    async def handle(stream: trio.SocketStream, scope: anyio.CancelScope, over: bool) -> None:
        # The caller's cancellation stops the accept loop, not the connections (``scope`` is
        # shielded): the shutdown below ends them.
        with scope:
            try:
                client = stream.socket.getpeername()
            except OSError:
                client = None  # already gone: the run below ends at once
            try:
                await connection_class(busy if over else wrapped, config, context, {}, stream).run()
            except* (Http2Refused, OSError):
                pass  # refused, or the client reset the connection: no failure of ours
            except* Exception as failure:
                peer = _peer(client)
                logger.warning("connection from %s failed and was closed: %r", peer, failure)
                logger.debug("connection from %s failed", peer, exc_info=failure)
            finally:
                connections.discard(scope)
                await stream.aclose()

    async def accept(listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # out of descriptors or memory: wait, as trio's own loop does
                if exc.errno not in _ACCEPT_CAPACITY_ERRORS:
                    raise
                logger.error("accepting a connection failed (%s); waiting 100 ms", exc)
                await anyio.sleep(0.1)
                continue
            # Counted here, in the order of arrival, not when its task first runs.
            scope = anyio.CancelScope(shield=True)
            over = len(connections) >= transport.config.max_connections
            connections.add(scope, stream)
            nursery.start_soon(handle, stream, scope, over)

    sock = bind_socket(host, port)
    sock.listen(config.backlog)
    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(sock))]
    async with trio.open_nursery() as nursery:
        try:
            task_status.started(sock.getsockname()[1])
            async with trio.open_nursery() as accepting:
                for listener in listeners:
                    accepting.start_soon(accept, listener, nursery)
        finally:
            with anyio.CancelScope(shield=True):
                shutdown.begin()
                for listener in listeners:  # stop accepting
                    await listener.aclose()
                # Idle connections close now, the others after their response.
                await context.terminated.set()
                with anyio.move_on_after(transport.config.shutdown_timeout):
                    await connections.wait_empty()
                shutdown.expire()  # the open responses are ended
                with anyio.move_on_after(transport.closing):
                    await connections.wait_empty()
                connections.cut_all()


def _peer(address: Any) -> str:
    if not address:
        return "a client"
    return f"{address[0]}:{address[1]}"
