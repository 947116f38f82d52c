"""What both HTTP servers share: the connection limits, the refusals they answer with, the grace.

:func:`~twostroke.engine.server.serve.serve` runs uvicorn on asyncio
(:mod:`~twostroke.engine.server.uvicorn_server`) and Hypercorn on trio
(:mod:`~twostroke.engine.server.hypercorn_server`); both take their limits from one
:class:`Transport` and refuse what they do not serve the same way.
"""

from __future__ import annotations

import socket

import anyio
import attrs
from starlette.types import ASGIApp, Receive, Scope, Send

from twostroke.engine.config import ServerConfig
from twostroke.engine.server.errors import ApiError
from twostroke.engine.server.guards import ServerShutdown
from twostroke.engine.server.sse import send_json

__all__ = [
    "CLOSING_SECONDS",
    "HTTP2_REFUSAL",
    "Transport",
    "bind_socket",
    "busy_app",
    "expire_after",
    "too_many_connections",
]

#: After the grace period, how long ending the open responses may take (a client that does
#: not read holds its last write) before their connections are cut.
CLOSING_SECONDS = 1.0

# A server connection preface (an empty SETTINGS frame) and a GOAWAY with the error code
# HTTP_1_1_REQUIRED (RFC 9113, 7): an HTTP/2 client learns to retry with HTTP/1.1.
_GOAWAY_DETAIL = b"this server speaks HTTP/1.1 only"
HTTP2_REFUSAL = (
    b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    + (8 + len(_GOAWAY_DETAIL)).to_bytes(3, "big")
    + b"\x07\x00\x00\x00\x00\x00"
    + b"\x00\x00\x00\x00"  # last stream id: none was processed
    + (0xD).to_bytes(4, "big")  # HTTP_1_1_REQUIRED
    + _GOAWAY_DETAIL
)


@attrs.frozen
class Transport:
    """Where a server listens and the limits on its connections.

    Attributes:
        host: The address to bind.
        port: The TCP port (0: any free one).
        config: The server's limits; a server reads its connections' there:
            ``max_connections`` (served at once), ``header_timeout`` (to send a request's
            headers, from a connection's start or its previous response; idle keep-alive
            connections are closed after the same time) and ``shutdown_timeout`` (the grace
            open responses have once the server is cancelled).
        access_log: Log one line per request.
        closing: Seconds ending the open responses may take after the grace period.
    """

    host: str
    port: int
    config: ServerConfig
    access_log: bool = False
    closing: float = CLOSING_SECONDS


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host`` and ``port`` (not yet listening), for either server.

    uvicorn's own binding exits the process on failure (``SystemExit``), and both servers
    leave the failed socket to the garbage collector.

    Raises:
        OSError: the address cannot be bound; the message names it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {host} port {port}: {exc.strerror}") from exc
    return sock


def too_many_connections(limit: int) -> ApiError:
    """The 503 for a connection over ``limit``."""
    return ApiError(
        503,
        f"Too many connections: the server serves at most {limit} at once; retry later.",
        type="server_error",
        code="too_many_connections",
        headers=((b"connection", b"close"), (b"retry-after", b"1")),
    )


def busy_app(limit: int) -> ASGIApp:
    """An ASGI application that answers every request with :func:`too_many_connections`."""
    error = too_many_connections(limit)

    async def busy(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await send_json(send, error.status, error.body(), error.headers)

    return busy


async def expire_after(shutdown: ServerShutdown, seconds: float) -> None:
    """Expire ``shutdown`` after ``seconds``."""
    await anyio.sleep(seconds)
    shutdown.expire()
