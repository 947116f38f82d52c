"""Serving the application inside the caller's task group: uvicorn on asyncio, Hypercorn on trio.

:func:`serve` runs until it is cancelled, like any other task of the caller's. uvicorn cannot
run on trio, so under trio the server is Hypercorn
(:mod:`~twostroke.engine.server.hypercorn_server`); under asyncio (and uvloop) it is uvicorn
(:mod:`~twostroke.engine.server.uvicorn_server`). Either way the listening socket is bound
before the port is reported through ``task_status``, so ``port=0`` works and a client may
connect as soon as ``start`` returns, and both servers keep the same limits
(:mod:`~twostroke.engine.server.transport`) and end the same way.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
from collections.abc import Iterable

import anyio
import anyio.abc

from twostroke.engine.server.app import (
    DEFAULT_MAX_WAITING_REQUESTS,
    KEEPALIVE_SECONDS,
    build_app,
)
from twostroke.engine.server.body import DEFAULT_MAX_BODY_BYTES
from twostroke.engine.server.guards import (
    DEFAULT_ALLOWED_HOSTS,
    DEFAULT_BODY_TIMEOUT,
    ServerShutdown,
    check_allowed_hosts,
)
from twostroke.engine.server.protocol import DEFAULT_MAX_CHOICES
from twostroke.engine.server.transport import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    GRACEFUL_SHUTDOWN_SECONDS,
    Transport,
    busy_app,
)
from twostroke.engine.surface import EngineSurface
from twostroke.states.validators import check_int

__all__ = ["GRACEFUL_SHUTDOWN_SECONDS", "serve"]

logger = logging.getLogger("twostroke.server")


async def serve(
    engine: EngineSurface,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    keepalive: float = KEEPALIVE_SECONDS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_choices: int = DEFAULT_MAX_CHOICES,
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
    allowed_hosts: Iterable[str] | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    shutdown_timeout: float = GRACEFUL_SHUTDOWN_SECONDS,
    access_log: bool = False,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` with OpenAI's API over HTTP/1.1 until cancelled.

    Start it in a task group that lives inside the engine's ``async with`` block::

        port = await task_group.start(partial(serve, engine, port=0))

    Args:
        engine: An engine or coordinator (anything with the engine surface).
        host: The address to bind; ``127.0.0.1`` keeps the server off the network. Another
            address without ``api_key`` is logged as a warning.
        port: The TCP port; 0 picks a free one (reported through ``task_status``).
        api_key: If given, requests must carry ``Authorization: Bearer <api_key>``.
        keepalive: Seconds of silence on a stream before a keep-alive comment.
        max_body_bytes: The largest request body accepted, in bytes (default 8 MiB); a
            larger one is a 413, refused before or while it is read (see :func:`build_app`).
        max_choices: The most choices (prompts × ``n``) one request may ask for (default
            128); more is a 400 (see :func:`build_app`).
        max_waiting_requests: The most engine requests waiting for admission (default 1024;
            ``None``: no limit); a request with no room for all its choices is a 503 with
            ``Retry-After`` (see :func:`build_app`).
        allowed_hosts: Without ``api_key``, the ``Host`` names answered (default: ``localhost``,
            ``127.0.0.1``, ``[::1]`` and ``host``; ``*``: any); another is a 403.
        max_connections: Connections served at once (default 512); a request on one more is
            a 503 (``too_many_connections``) and that connection is closed.
        header_timeout: Seconds a connection has to send a request's headers, from its start
            or its previous response (default 10); a later one is closed.
        body_timeout: Seconds a request body may take after its headers (default 60); a
            later one is a 408 (``request_timeout``).
        shutdown_timeout: The grace period of a shutdown, in seconds (default 5).
        access_log: Log one line per request to the ``twostroke.server`` logger.
        task_status: Receives the bound port once the server accepts connections.

    Cancelling the call stops accepting connections and refuses new requests on open ones
    (503), lets open responses finish for up to ``shutdown_timeout`` seconds, then ends each
    (a stream with an ``error`` event and ``data: [DONE]``, a response not yet started with a
    503), which cancels their engine requests. A connection that fails is closed alone.

    Raises:
        TypeError, ValueError: a bad argument (see :func:`build_app`).
        OSError: the address cannot be bound.
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"host must be a non-empty str, got {host!r}")
    if not 0 <= check_int("port", port) <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    if allowed_hosts is None:
        bound = f"[{host}]" if ":" in host else host
        allowed_hosts = (*DEFAULT_ALLOWED_HOSTS, bound)
    transport = Transport(
        host,
        port,
        max_connections=max_connections,
        header_timeout=header_timeout,
        grace=shutdown_timeout,
        access_log=access_log,
    )
    shutdown = ServerShutdown()
    app = build_app(
        engine,
        api_key=api_key,
        keepalive=keepalive,
        max_body_bytes=max_body_bytes,
        max_choices=max_choices,
        max_waiting_requests=max_waiting_requests,
        allowed_hosts=check_allowed_hosts(allowed_hosts),
        body_timeout=body_timeout,
        shutdown=shutdown,
    )
    if api_key is None and not _is_loopback(host):
        logger.warning(
            "serving %s without an API key: anyone who can reach it may use it "
            "(pass --api-key or set TWOSTROKE_API_KEY)",
            host,
        )
    busy = busy_app(transport.max_connections)
    if _running_on_trio():
        from twostroke.engine.server.hypercorn_server import serve_hypercorn

        await serve_hypercorn(app, busy, transport, shutdown, task_status)
    else:
        from twostroke.engine.server.uvicorn_server import serve_uvicorn

        await serve_uvicorn(app, busy, transport, shutdown, task_status)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def _running_on_trio() -> bool:
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True
