"""Serving the application inside the caller's task group: uvicorn on asyncio, Hypercorn on trio.

:func:`serve` runs until it is cancelled, like any other task of the caller's. uvicorn cannot
run on trio, so under trio the server is Hypercorn
(:mod:`~twostroke.engine.server.hypercorn_server`); under asyncio (and uvloop) it is uvicorn
(:mod:`~twostroke.engine.server.uvicorn_server`). Either way the listening socket is bound
before the port is reported through ``task_status``, so ``port=0`` works and a client may
connect as soon as ``start`` returns, and both servers keep the same limits (one
:class:`~twostroke.engine.config.ServerConfig`, through
:mod:`~twostroke.engine.server.transport`) and end the same way.
"""

from __future__ import annotations

import ipaddress
import logging
import sys

import anyio
import anyio.abc
import attrs

from twostroke.engine.config import ServerConfig
from twostroke.engine.server.app import build_app
from twostroke.engine.server.batch_store import BatchStore
from twostroke.engine.server.guards import ServerShutdown
from twostroke.engine.server.response_store import ResponseStore
from twostroke.engine.server.transport import Transport, busy_app
from twostroke.engine.surface import EngineSurface
from twostroke.engine.tools.formats import ToolFormat
from twostroke.states.validators import check_int

__all__ = ["serve"]

logger = logging.getLogger("twostroke.server")


async def serve(
    engine: EngineSurface,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    config: ServerConfig | None = None,
    access_log: bool = False,
    tool_format: ToolFormat | str | None = None,
    response_store: ResponseStore | None = None,
    batch_store: BatchStore | None = None,
    reasoning_parser: str | None = None,
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
        config: The server's limits, one value (default: ``ServerConfig()``'s): on request
            bodies, choices, the waiting queue, ``Host`` names (``allowed_hosts=None``: the
            loopback names and ``host``), connections, headers, bodies, the shutdown's grace
            period and keep-alive comments; see :class:`~twostroke.engine.config.ServerConfig`.
        access_log: Log one line per request to the ``twostroke.server`` logger.
        tool_format: The format the model writes tool calls in, or its name (``None``: the
            one the engine's chat template implies; see :func:`build_app`).
        reasoning_parser: How a thinking model's reasoning is read apart from its answer
            (``deepseek_r1``, ``qwen3``, ``think`` or ``none``; ``None``: as the chat
            template implies; see :func:`build_app`).
        response_store: Where ``/v1/responses`` stores responses, which the caller closes;
            ``None``: the one ``config`` names (``responses_store`` and its bounds), closed
            when the server ends.
        batch_store: Where ``/v1/files`` and ``/v1/batches`` keep their files and batches,
            which the caller closes; ``None``: the one ``config`` names (``batches_store``),
            closed when the server ends. Batches run in a task of the server's, cancelled
            with it: a batch it leaves unfinished resumes in the next server on the store.
        task_status: Receives the bound port once the server accepts connections.

    Cancelling the call stops accepting connections and refuses new requests on open ones
    (503), lets open responses finish for up to ``shutdown_timeout`` seconds, then ends each
    (a stream with an ``error`` event and ``data: [DONE]``, a response not yet started with a
    503), which cancels their engine requests. A connection that fails is closed alone.

    Raises:
        TypeError, ValueError: a bad argument, as :func:`build_app` refuses it (``config``
            that is no ``ServerConfig`` among them).
        OSError: the address cannot be bound.
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"host must be a non-empty str, got {host!r}")
    if not 0 <= check_int("port", port) <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    if config is None:
        config = ServerConfig()
    elif not isinstance(config, ServerConfig):
        raise TypeError(
            f"config must be a ServerConfig or None, got {type(config).__name__} {config!r}"
        )
    # The Host names answered are settled here, where the address bound is known.
    config = attrs.evolve(config, allowed_hosts=config.hosts_answered(host))
    transport = Transport(host, port, config, access_log=access_log)
    shutdown = ServerShutdown()
    app = build_app(
        engine,
        api_key=api_key,
        config=config,
        shutdown=shutdown,
        tool_format=tool_format,
        response_store=response_store,
        batch_store=batch_store,
        reasoning_parser=reasoning_parser,
    )
    if api_key is None and not _is_loopback(host):
        logger.warning(
            "serving %s without an API key: anyone who can reach it may use it "
            "(pass --api-key or set TWOSTROKE_API_KEY)",
            host,
        )
    busy = busy_app(config.max_connections)
    try:
        # The batch runner is the server's task: it ends (cancelled) before the stores close.
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(app.state.batches.run)
            if _running_on_trio():
                from twostroke.engine.server.hypercorn_server import serve_hypercorn

                await serve_hypercorn(app, busy, transport, shutdown, task_status)
            else:
                from twostroke.engine.server.uvicorn_server import serve_uvicorn

                await serve_uvicorn(app, busy, transport, shutdown, task_status)
            task_group.cancel_scope.cancel()  # the server ended: so does the runner
    except BaseExceptionGroup as group:
        # The runner never raises (it logs a store's failure and waits): one error is the
        # server's own (an address it cannot bind), raised as such, as before there was a
        # task group.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        if response_store is None:  # the one build_app made for this server
            await app.state.response_store.aclose()
        if batch_store is None:
            await app.state.batch_store.aclose()


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
