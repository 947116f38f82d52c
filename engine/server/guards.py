"""What every request passes before a handler sees it, and how open responses end at shutdown.

:class:`Guards` is ASGI middleware in front of the routes. In order, it refuses:

* any request once the server is shutting down (503 ``server_shutting_down``);
* without an API key, a ``Host`` that is not on the allow-list (403 ``host_not_allowed``): a
  server on loopback without a key is otherwise reachable from any web page the user opens,
  through DNS rebinding (Ollama's CVE-2024-28224). ``/health`` and ``/metrics`` stay open, as
  they do with a key: probes and scrapers reach them by whatever name they have;
* a ``POST`` whose ``Content-Type`` is not ``application/json`` (415 ``unsupported_media_type``):
  a page may send ``text/plain`` cross-origin without asking, but ``application/json`` needs a
  CORS preflight, which this server never grants. ``POST /v1/files`` (:data:`UPLOAD_PATH`)
  takes ``multipart/form-data`` instead, which a page may send without asking: so it must also
  carry an ``Authorization`` or ``x-api-key`` header (any, without an API key; OpenAI's
  clients always send one), which no page sends cross-origin without a preflight;
* a body still arriving ``body_timeout`` seconds after its headers (408 ``request_timeout``;
  :class:`~twostroke.engine.config.ServerConfig`): a client trickling a byte at a time holds
  its connection no longer.

A refusal asks the HTTP server to close the connection, since the body behind it is left unread.

When the server shuts down (:class:`ServerShutdown`), requests still open at the end of the grace
period are cancelled, which cancels their engine requests; a stream that had started gets one
OpenAI-shaped ``error`` event and ``data: [DONE]`` (a ``/v1/responses`` stream ends itself with
the Responses API's ``error`` and ``response.failed`` events instead, a ``/v1/messages`` one
with Anthropic's ``error`` event), a response that had not gets a 503. Refusals of
Anthropic's routes (:data:`ANTHROPIC_PATHS`) are in Anthropic's error shape.
"""

from __future__ import annotations

import contextlib

import anyio
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from twostroke.engine.config import ServerConfig, without_port
from twostroke.engine.server.errors import ApiError, anthropic_error
from twostroke.engine.server.sse import encode, send_json

__all__ = [
    "ANTHROPIC_PATHS",
    "OPEN_PATHS",
    "UPLOAD_PATH",
    "Guards",
    "ServerShutdown",
    "shutting_down",
]

#: Routes answered whatever the ``Host``, as they are without an API key.
OPEN_PATHS = frozenset({"/health", "/metrics"})
#: The path prefix of Anthropic's routes, whose refusals are in Anthropic's error shape.
ANTHROPIC_PATHS = "/v1/messages"
#: The one route that takes ``multipart/form-data`` (a file upload), not JSON.
UPLOAD_PATH = "/v1/files"

_CLOSE = (b"connection", b"close")


def shutting_down(detail: str) -> ApiError:
    """The 503 for a request the server will not finish because it is shutting down."""
    return ApiError(
        503,
        f"The server is shutting down: {detail}.",
        type="server_error",
        code="server_shutting_down",
        headers=(_CLOSE,),
    )


class ServerShutdown:
    """How a server tells its application that it is shutting down, in two steps.

    :meth:`begin`: from now on, new requests are refused with a 503; open ones go on.
    :meth:`expire`: the grace period is over; open requests are cancelled and their responses
    ended (a stream with an ``error`` event and ``[DONE]``).

    Create it inside the event loop that serves (it holds events of that loop).
    """

    def __init__(self) -> None:
        self._began = False
        self._expired = anyio.Event()

    def __repr__(self) -> str:
        state = "expired" if self._expired.is_set() else "began" if self._began else "serving"
        return f"<ServerShutdown {state}>"

    @property
    def began(self) -> bool:
        """Whether new requests are refused."""
        return self._began

    def begin(self) -> None:
        """Refuse new requests from now on. Idempotent."""
        self._began = True

    def expire(self) -> None:
        """End every open request now (implies :meth:`begin`). Idempotent."""
        self._began = True
        self._expired.set()

    @property
    def expired(self) -> bool:
        """Whether open requests are being ended."""
        return self._expired.is_set()

    async def wait_expired(self) -> None:
        """Wait until :meth:`expire` is called."""
        await self._expired.wait()


class _Response:
    """What the application has sent so far of one response."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.event_stream = False
        self.ended = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = Headers(raw=message.get("headers", [])).get("content-type", "")
            self.event_stream = content_type.startswith("text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)


class Guards:
    """ASGI middleware: the checks above, then the application.

    Args:
        app: The application.
        api_key: Whether the server has an API key (then ``Host`` is not checked).
        config: The server's limits: the ``Host`` names answered without a key are its
            :meth:`~twostroke.engine.config.ServerConfig.hosts_answered`, and a body has
            ``body_timeout`` seconds to arrive after its headers.
        shutdown: The server's shutdown signal, if it gives one.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: bool,
        config: ServerConfig,
        shutdown: ServerShutdown | None,
    ) -> None:
        self._app = app
        self._allowed_hosts = config.hosts_answered()
        self._check_host = not api_key and "*" not in self._allowed_hosts
        self._body_timeout = config.body_timeout
        self._shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            status, body = refusal.status, refusal.body()
            if scope["path"].startswith(ANTHROPIC_PATHS):
                status, body = anthropic_error(refusal)
            with contextlib.suppress(OSError):  # a client that left gets no answer
                await send_json(send, status, body, refusal.headers)
            return
        receive = self._timed(receive, anyio.current_time() + self._body_timeout)
        if self._shutdown is None:
            await self._app(scope, receive, send)
        else:
            await self._until_expired(self._shutdown, scope, receive, send)

    def _refusal(self, scope: Scope) -> ApiError | None:
        if self._shutdown is not None and self._shutdown.began:
            return shutting_down("it takes no new requests")
        headers = Headers(scope=scope)
        if self._check_host and scope["path"] not in OPEN_PATHS:
            host = headers.get("host")
            if host is None or without_port(host.strip().lower()) not in self._allowed_hosts:
                allowed = ", ".join(sorted(self._allowed_hosts))
                return ApiError(
                    403,
                    f"Host {host!r} is not allowed: a server without an API key answers only "
                    f"to {allowed} (give it --allowed-hosts or an API key).",
                    type="invalid_request_error",
                    code="host_not_allowed",
                    headers=(_CLOSE,),
                )
        if scope["method"] == "POST":
            content_type = headers.get("content-type")
            media_type = (content_type or "").partition(";")[0].strip().lower()
            if scope["path"] == UPLOAD_PATH:
                return _upload_refusal(media_type, content_type, headers)
            if media_type != "application/json":
                return ApiError(
                    415,
                    f"Content-Type must be application/json, got {content_type!r}.",
                    type="invalid_request_error",
                    code="unsupported_media_type",
                    headers=(_CLOSE,),
                )
        return None

    def _timed(self, receive: Receive, deadline: float) -> Receive:
        """``receive``, failing with a 408 while the body is still due after ``deadline``."""
        body_done = False
        timeout = self._body_timeout

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:  # from here on only a disconnect can come: no deadline
                return await receive()
            with anyio.CancelScope(deadline=deadline) as scope:
                message = await receive()
            if scope.cancelled_caught:
                raise ApiError(
                    408,
                    f"Request body not received in time: the limit is {timeout:g} s from "
                    "the end of the headers.",
                    type="invalid_request_error",
                    code="request_timeout",
                    headers=(_CLOSE,),
                )
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        return timed_receive

    async def _until_expired(
        self, shutdown: ServerShutdown, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Run the application; if the shutdown expires first, cancel it and end its answer."""
        response = _Response(send)
        error: Exception | None = None
        finished = False
        async with anyio.create_task_group() as task_group:

            async def expire() -> None:
                await shutdown.wait_expired()
                task_group.cancel_scope.cancel()

            task_group.start_soon(expire)
            try:
                await self._app(scope, receive, response.send)
                finished = True
            except Exception as exc:  # re-raised below, outside the task group
                error = exc
            task_group.cancel_scope.cancel()
        if error is not None:
            raise error
        if not finished and not response.ended:  # cut short by the expiry, nothing else
            await _end(response, send, anthropic=scope["path"].startswith(ANTHROPIC_PATHS))


async def _end(response: _Response, send: Send, *, anthropic: bool) -> None:
    """End a response the shutdown cut short, as well as what was sent of it allows."""
    error = shutting_down("the request did not finish within the grace period")
    with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        if not response.started:
            status, body = anthropic_error(error) if anthropic else (error.status, error.body())
            await send_json(send, status, body, error.headers)
        elif response.event_stream:
            chunk = b"data: " + encode(error.body()) + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": chunk, "more_body": False})
        # A JSON body cut between its headers and its bytes cannot be completed; the HTTP
        # server closes the connection of a response the application left unfinished.


def _upload_refusal(media_type: str, content_type: str | None, headers: Headers) -> ApiError | None:
    """The refusal of an upload that is not a multipart form, or that a page could have sent
    cross-origin without a preflight (no ``Authorization`` header)."""
    if media_type != "multipart/form-data":
        return ApiError(
            415,
            f"Content-Type must be multipart/form-data for {UPLOAD_PATH}, got {content_type!r}.",
            type="invalid_request_error",
            code="unsupported_media_type",
            headers=(_CLOSE,),
        )
    if "authorization" not in headers and "x-api-key" not in headers:
        return ApiError(
            401,
            f"{UPLOAD_PATH} wants an Authorization (or x-api-key) header, any value without "
            "an API key: a web page cannot send one without a CORS preflight, which this "
            "server never grants.",
            type="invalid_request_error",
            code="missing_authorization",
            headers=(_CLOSE,),
        )
    return None
