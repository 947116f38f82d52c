"""The request body limit: a body over it is a 413, refused before or while it is read.

These tests speak HTTP/1.1 through h11 (which both servers are built on) over a raw socket,
so that they choose exactly what is sent and when: a ``Content-Length`` with no body behind
it, or a chunked body that never ends. A server that buffered the body before checking it
would wait for the rest, and the test would fail on its deadline instead of getting a 413.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import h11
import httpx
import msgspec
import pytest

from twostroke.engine.config import ServerConfig

from .conftest import API_KEY, OPENAI_STREAMS_ON_TRIO, Served, served

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

LIMIT = 1000
BODY_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


async def post_raw(
    server: Served,
    path: str,
    headers: Sequence[tuple[str, str]],
    chunks: Sequence[bytes] = (),
    *,
    end: bool = True,
) -> tuple[h11.Response, bytes, bool]:
    """POST ``chunks`` to ``path`` on a fresh connection; ``end`` ends the body.

    Returns:
        The response, its body, and whether the server then closed the connection.
    """
    client = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target=path,
        headers=[
            ("host", "127.0.0.1"),
            ("authorization", f"Bearer {API_KEY}"),
            ("content-type", "application/json"),
            *headers,
        ],
    )
    port = httpx.URL(server.base_url).port
    assert port is not None
    with anyio.fail_after(20):
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(client.send(request))
            for chunk in chunks:
                await stream.send(client.send(h11.Data(data=chunk)))
            if end:
                await stream.send(client.send(h11.EndOfMessage()))
            response, body = None, b""
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    try:
                        client.receive_data(await stream.receive())
                    except anyio.EndOfStream:
                        client.receive_data(b"")
                elif isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            assert response is not None
            closed = False
            if client.their_state is h11.MUST_CLOSE:
                try:
                    closed = await stream.receive() == b""
                except anyio.EndOfStream:
                    closed = True
    return response, body, closed


def too_large(response: h11.Response, body: bytes, closed: bool) -> str:
    """The message of a 413 in OpenAI's shape, after checking the rest of it."""
    assert response.status_code == 413, (response, body)
    assert (b"connection", b"close") in list(response.headers)
    assert closed, "the server must close a connection whose body it left unread"
    error = msgspec.json.decode(body)["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", None, "request_too_large"
    )  # fmt: skip
    message = error["message"]
    assert isinstance(message, str)
    return message


def completion_body(size: int) -> bytes:
    """A valid completions request of exactly ``size`` bytes (padded with JSON whitespace)."""
    body = msgspec.json.encode({"model": "toy", "prompt": "hi", "max_tokens": 2})
    assert len(body) <= size
    return body[:-1] + b" " * (size - len(body)) + b"}"


async def still_serving(server: Served) -> None:
    reply = await server.client.completions.create(model="toy", prompt="ok", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


async def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent() -> None:
    async with served(server_config=ServerConfig(max_body_bytes=LIMIT)) as server:
        for path in BODY_ROUTES:
            for declared in (LIMIT + 1, 2**40):
                # Only the headers are sent: the answer cannot have waited for the body.
                answer = await post_raw(
                    server, path, [("content-length", str(declared))], end=False
                )
                assert too_large(*answer) == (
                    f"Request body too large: the limit is {LIMIT} bytes, and the request "
                    f"declares Content-Length: {declared}."
                ), path
        assert server.engine.submitted == []
        await still_serving(server)


async def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit() -> None:
    async with served(server_config=ServerConfig(max_body_bytes=LIMIT)) as server:
        # LIMIT bytes, then one more; the body never ends. The server cannot have read more
        # than was sent, so the 413 names exactly LIMIT + 1 bytes.
        chunks = [b"x" * 400, b"x" * 400, b"x" * 200, b"x"]
        answer = await post_raw(
            server, "/v1/completions", [("transfer-encoding", "chunked")], chunks, end=False
        )
        assert too_large(*answer) == (
            f"Request body too large: the limit is {LIMIT} bytes, and the body sent at least "
            f"{LIMIT + 1} bytes."
        )
        assert server.engine.submitted == []
        await still_serving(server)


async def test_a_body_of_exactly_the_limit_is_served() -> None:
    async with served(server_config=ServerConfig(max_body_bytes=LIMIT)) as server:
        body = completion_body(LIMIT)
        declared = await server.http.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        assert declared.status_code == 200, declared.text
        assert declared.json()["usage"]["prompt_tokens"] == 2
        chunks = [body[:300], body[300:700], body[700:]]
        response, reply, _ = await post_raw(
            server, "/v1/completions", [("transfer-encoding", "chunked")], chunks
        )
        assert response.status_code == 200, reply
        assert msgspec.json.decode(reply)["usage"]["prompt_tokens"] == 2
        assert len(server.engine.submitted) == 2
        await still_serving(server)


async def test_the_limit_is_checked_where_it_is_configured() -> None:
    assert ServerConfig(max_body_bytes=1).max_body_bytes == 1
    assert ServerConfig().max_body_bytes == 8 * 2**20
    bad: list[tuple[object, type[Exception], str]] = [
        (0, ValueError, "max_body_bytes must be >= 1, got 0"),
        (-5, ValueError, "max_body_bytes must be >= 1, got -5"),
        (True, TypeError, "max_body_bytes must be an int, got bool True"),
        (8.0, TypeError, "max_body_bytes must be an int, got float 8.0"),
        ("8", TypeError, "max_body_bytes must be an int, got str '8'"),
    ]
    for value, error, message in bad:
        # Once, in ServerConfig: build_app() and serve() take the limits whole, checked.
        with pytest.raises(error) as caught:
            ServerConfig(max_body_bytes=value)  # type: ignore[arg-type]
        assert str(caught.value) == message
