"""Reading a request body under a size limit, so that no client can make the server buffer more.

Starlette's ``request.body()`` buffers whatever the client sends. Here a declared
``Content-Length`` over the limit is refused before a byte of the body is read, and a body
without one (``Transfer-Encoding: chunked``) is refused as soon as what was read passes the
limit; either way the answer is a 413 in OpenAI's error shape, and the server closes that
connection after it (as Go's ``MaxBytesReader`` and nginx's ``client_max_body_size`` do): the
rest of the body is never read. The limit is the server's
:attr:`~twostroke.engine.config.ServerConfig.max_body_bytes`.
"""

from __future__ import annotations

import contextlib
import re

from starlette.datastructures import Headers
from starlette.requests import Request

from twostroke.engine.server.errors import ApiError

__all__ = ["body_too_large", "read_body"]

_DIGITS = re.compile(r"[0-9]+")


def body_too_large(limit: int, sent: str) -> ApiError:
    """The 413 for a body over ``limit`` bytes; ``sent`` says what the client sent.

    The answer asks the server to close the connection: the rest of the body is left unread,
    so the connection cannot carry another request.
    """
    return ApiError(
        413,
        f"Request body too large: the limit is {limit} bytes, {sent}.",
        type="invalid_request_error",
        code="request_too_large",
        headers=((b"connection", b"close"),),
    )


def _declared_length(headers: Headers) -> int | None:
    """The body's declared ``Content-Length``, or None when there is none.

    The HTTP server has already refused a malformed or conflicting ``Content-Length`` (h11
    answers 400); anything but digits here is left to the byte count while reading.
    """
    value = headers.get("content-length")
    if value is None or not _DIGITS.fullmatch(value.strip()):
        return None
    return int(value)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of ``request``, refused once it would be more than ``limit`` bytes.

    Args:
        request: The request, whose body has not been read yet.
        limit: The most bytes the body may have.

    Returns:
        The body.

    Raises:
        ApiError: a 413 (``request_too_large``), before anything is read when the declared
            ``Content-Length`` is over ``limit``, else as soon as what was read passes it.
        starlette.requests.ClientDisconnect: the client left before the body ended.

    Cancelling it leaves the body partly read; the request cannot be answered after that.
    """
    declared = _declared_length(request.headers)
    if declared is not None and declared > limit:
        raise body_too_large(limit, f"and the request declares Content-Length: {declared}")
    chunks: list[bytes] = []
    size = 0
    # aclosing: leaving the stream early must not leave its generator to the garbage collector.
    async with contextlib.aclosing(request.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit, f"and the body sent at least {size} bytes")
            chunks.append(chunk)
    return b"".join(chunks)
