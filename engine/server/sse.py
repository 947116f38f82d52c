"""The ASGI side of responses: JSON bodies, server-sent events, and noticing a client leave.

A client that disconnects must cancel its engine request at once, mid-stream or while the
server still waits for a complete answer. The ASGI server says so with an ``http.disconnect``
message on ``receive()``; :func:`until_disconnect` waits for it in a task of its own and
cancels the work. (Polling ``is_disconnected()`` misses disconnects under trio: Hypercorn
#210.) A ``send`` that fails means the same thing, so :class:`EventSender` reports it as a
:class:`Disconnected`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.types import Receive, Send

__all__ = ["Disconnected", "EventSender", "send_json", "until_disconnect"]

_T = TypeVar("_T")

_encoder = msgspec.json.Encoder()


class Disconnected(Exception):
    """The client went away: a send to it failed."""


async def send_json(
    send: Send,
    status: int,
    body: object,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Send a whole JSON response."""
    payload = _encoder.encode(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def until_disconnect(
    receive: Receive, work: Callable[[], Awaitable[_T]]
) -> tuple[bool, _T | None]:
    """Run ``work`` until it returns or the client disconnects, whichever comes first.

    Call it only once the request body has been read: from then on the only message
    ``receive()`` can deliver is ``http.disconnect``.

    Returns:
        ``(True, None)`` if the client disconnected (``work`` was cancelled), else
        ``(False, result)``.

    Raises:
        Whatever ``work`` raised (never wrapped in an exception group).
    """
    disconnected = False
    result: _T | None = None
    error: Exception | None = None
    async with anyio.create_task_group() as task_group:

        async def watch() -> None:
            nonlocal disconnected
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            except Exception:  # a receive that fails has lost the client too
                pass
            disconnected = True
            task_group.cancel_scope.cancel()

        task_group.start_soon(watch)
        try:
            result = await work()
        except Exception as exc:  # re-raised below, outside the task group
            error = exc
        task_group.cancel_scope.cancel()
    if error is not None:
        raise error
    return disconnected, (None if disconnected else result)


class EventSender:
    """Writes one ``text/event-stream`` response.

    Raises:
        Disconnected: from any write, once a send to the client fails.
    """

    def __init__(self, send: Send) -> None:
        self._send = send

    async def _write(self, message: dict[str, Any]) -> None:
        try:
            await self._send(message)
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise Disconnected from exc

    async def start(self) -> None:
        """Send the status and headers."""
        await self._write(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),  # tell nginx not to buffer the stream
                ],
            }
        )

    async def data(self, payload: object) -> None:
        """Send ``payload`` as one ``data:`` event (JSON, or raw bytes as given)."""
        encoded = payload if isinstance(payload, bytes) else _encoder.encode(payload)
        await self._body(b"data: " + encoded + b"\n\n")

    async def comment(self, text: str) -> None:
        """Send an SSE comment (clients ignore it; proxies see traffic)."""
        await self._body(b": " + text.encode() + b"\n\n")

    async def done(self) -> None:
        """Send ``data: [DONE]`` and end the response."""
        await self._write(
            {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
        )

    async def raw(self, chunk: bytes) -> None:
        """Send ``chunk`` as it is (events of the endpoint's own shape)."""
        await self._body(chunk)

    async def end(self) -> None:
        """End the response, with nothing more (an event stream that has no ``[DONE]``)."""
        await self._write({"type": "http.response.body", "body": b"", "more_body": False})

    async def _body(self, chunk: bytes) -> None:
        await self._write({"type": "http.response.body", "body": chunk, "more_body": True})


def encode(payload: object) -> bytes:
    """``payload`` as JSON bytes."""
    return _encoder.encode(payload)
