"""Serving the application inside the caller's task group: uvicorn on asyncio, Hypercorn on trio.

:func:`serve` runs until it is cancelled, like any other task of the caller's. uvicorn cannot
run on trio, so under trio the server is Hypercorn's trio worker; under asyncio (and uvloop)
it is uvicorn. Either way the listening socket is bound before the port is reported through
``task_status``, so ``port=0`` works and a client may connect as soon as ``start`` returns.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import Any

import anyio
import anyio.abc
from starlette.applications import Starlette

from twostroke.engine.server.app import KEEPALIVE_SECONDS, build_app
from twostroke.engine.server.body import DEFAULT_MAX_BODY_BYTES
from twostroke.engine.surface import EngineSurface

__all__ = ["GRACEFUL_SHUTDOWN_SECONDS", "serve"]

logger = logging.getLogger("twostroke.server")

#: On cancellation, how long open responses may take to finish before they are cancelled.
GRACEFUL_SHUTDOWN_SECONDS = 5.0


async def serve(
    engine: EngineSurface,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    keepalive: float = KEEPALIVE_SECONDS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    access_log: bool = False,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` with OpenAI's API over HTTP until cancelled.

    Start it in a task group that lives inside the engine's ``async with`` block::

        port = await task_group.start(partial(serve, engine, port=0))

    Args:
        engine: An engine or coordinator (anything with the engine surface).
        host: The address to bind; ``127.0.0.1`` keeps the server off the network.
        port: The TCP port; 0 picks a free one (reported through ``task_status``).
        api_key: If given, requests must carry ``Authorization: Bearer <api_key>``.
        keepalive: Seconds of silence on a stream before a keep-alive comment.
        max_body_bytes: The largest request body accepted, in bytes (default 8 MiB); a
            larger one is a 413, refused before or while it is read (see :func:`build_app`).
        access_log: Log one line per request to the ``twostroke.server`` logger.
        task_status: Receives the bound port once the server accepts connections.

    Cancelling the call stops accepting connections, lets open responses finish for up to
    :data:`GRACEFUL_SHUTDOWN_SECONDS`, then cancels them (which cancels their requests).

    Raises:
        TypeError, ValueError: a bad argument (see :func:`build_app`).
        OSError: the address cannot be bound.
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"host must be a non-empty str, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int, got {type(port).__name__} {port!r}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    app = build_app(engine, api_key=api_key, keepalive=keepalive, max_body_bytes=max_body_bytes)
    if _running_on_trio():
        await _serve_hypercorn(app, host, port, access_log, task_status)
    else:
        await _serve_uvicorn(app, host, port, access_log, task_status)


def _running_on_trio() -> bool:
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


async def _serve_uvicorn(
    app: Starlette,
    host: str,
    port: int,
    access_log: bool,
    task_status: anyio.abc.TaskStatus[int],
) -> None:
    import asyncio

    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="off",  # the engine's lifetime is the caller's business, not the app's
        log_config=None,  # never reconfigure the embedding program's logging
        access_log=access_log,
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_SECONDS),
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    sock = config.bind_socket()
    # uvicorn's own serve() would install signal handlers over the caller's; its parts
    # (startup, main_loop, shutdown) are public and leave signals alone.
    with sock:
        await server.startup(sockets=[sock])
        try:
            task_status.started(sock.getsockname()[1])
            await server.main_loop()
        finally:
            with anyio.CancelScope(shield=True):
                server.should_exit = True
                await server.shutdown(sockets=[sock])
                # shutdown() cancels responses still open after the grace period but does
                # not wait for them; nothing of ours may outlive this call.
                tasks = list(server.server_state.tasks)
                if tasks:
                    await asyncio.wait(tasks)


async def _serve_hypercorn(
    app: Starlette,
    host: str,
    port: int,
    access_log: bool,
    task_status: anyio.abc.TaskStatus[int],
) -> None:
    import hypercorn.trio
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.errorlog = logger
    config.accesslog = logger if access_log else None
    config.graceful_timeout = GRACEFUL_SHUTDOWN_SECONDS
    async with anyio.create_task_group() as task_group:
        binds: list[str] = await task_group.start(
            partial(_hypercorn_worker, hypercorn.trio.serve, app, config)
        )
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


async def _hypercorn_worker(
    run: Any, app: Starlette, config: Any, *, task_status: anyio.abc.TaskStatus[list[str]]
) -> None:
    await run(app, config, mode="asgi", task_status=task_status)
