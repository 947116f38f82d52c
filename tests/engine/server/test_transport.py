"""Hostile clients at the transport: HTTP/2, failing connections, too many, too slow.

Every client here is on loopback and bounded in count and time; each test ends by checking
that the server still answers (``still_serving``). The slow clients pace their bytes with a
bounded wait for the server to close the connection: on trio the clock is virtual
(``MockClock``), so the default 10 s header deadline is checked against the issue's own client
(a byte every 2 s) at no cost; on asyncio (uvicorn) the deadline is set to a fraction of a
second.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import anyio.abc
import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import msgspec
import pytest
import trio.testing

from twostroke.engine.config import ServerConfig

from .conftest import API_KEY, OPENAI_STREAMS_ON_TRIO, Served, served

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]


def port_of(server: Served) -> int:
    port = httpx.URL(server.base_url).port
    assert port is not None
    return port


async def read_until_closed(stream: anyio.abc.ByteStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while True:
        try:
            received += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            return received


async def still_serving(server: Served) -> None:
    reply = await server.client.completions.create(model="toy", prompt="ok", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


async def still_answering(server: Served) -> None:
    """``still_serving`` without the engine, whose worker thread virtual time would skip."""
    assert (await server.http.get("/v1/models")).status_code == 200


def h2_client() -> h2.connection.H2Connection:
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    return connection


@pytest.mark.parametrize(
    ("authorization", "length"),
    [([], 100_000), ([("authorization", f"Bearer {API_KEY}")], 9_000_000)],
    ids=["401", "413"],
)
async def test_cleartext_http2_is_refused_and_the_server_serves_on(
    authorization: list[tuple[str, str]], length: int
) -> None:
    """``curl --http2-prior-knowledge --data-binary @100KB.bin`` without a key: Hypercorn
    answered 401, then raised ``KeyError`` on the DATA for the answered stream and exited;
    so it did after the 413 for a 9 MB body with the key."""
    async with served() as server:
        client = h2_client()
        client.send_headers(
            1,
            [
                (":method", "POST"),
                (":path", "/v1/completions"),
                (":scheme", "http"),
                (":authority", f"127.0.0.1:{port_of(server)}"),
                ("content-type", "application/json"),
                ("content-length", str(length)),
                *authorization,
            ],
        )
        events: list[h2.events.Event] = []
        with anyio.fail_after(10):
            async with await anyio.connect_tcp("127.0.0.1", port_of(server)) as stream:
                await stream.send(client.data_to_send())
                # Wait for the server's answer to the headers, then send the body behind it.
                while not any(
                    isinstance(event, h2.events.ResponseReceived | h2.events.ConnectionTerminated)
                    for event in events
                ):
                    try:
                        data = await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
                    events += client.receive_data(data)
                try:
                    for _ in range(4):  # the initial flow-control window: 4 frames of 16 KiB
                        client.send_data(1, b"x" * 16_383)
                        await stream.send(client.data_to_send())
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass  # the server has closed the connection, as it should
                except h2.exceptions.ProtocolError:
                    pass  # the client's own state machine knows the connection is closed
        await still_serving(server)
        terminated = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert len(terminated) == 1, events
        assert terminated[0].error_code == h2.errors.ErrorCodes.HTTP_1_1_REQUIRED
        assert terminated[0].additional_data == b"this server speaks HTTP/1.1 only"
        assert len(server.engine.submitted) == 1  # still_serving's


async def test_an_h2c_upgrade_is_answered_in_http_1_1() -> None:
    async with served() as server:
        with anyio.fail_after(10):
            async with await anyio.connect_tcp("127.0.0.1", port_of(server)) as stream:
                await stream.send(
                    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                    b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
                )
                answer = await stream.receive()
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        await still_serving(server)


async def test_a_huge_body_answered_413_leaves_the_server_serving() -> None:
    """A 9 MB POST sent whole, though the server answered 413 after its headers."""
    async with served() as server:
        body = b"x" * 9_000_000
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with anyio.fail_after(20):
            async with await anyio.connect_tcp("127.0.0.1", port_of(server)) as stream:
                try:
                    await stream.send(head)
                    for start in range(0, len(body), 1 << 20):
                        await stream.send(body[start : start + (1 << 20)])
                except (anyio.BrokenResourceError, OSError):
                    pass  # closed by the server after its 413
                answer = await read_until_closed(stream)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        await still_serving(server)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_connection_that_fails_closes_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever raises in one connection's protocol (Hypercorn #329 was one such) closes that
    connection: a stream open on another one goes on, and the server with it."""
    from hypercorn.protocol.h11 import H11Protocol

    create_stream = H11Protocol._create_stream

    async def failing(self: Any, request: Any) -> None:
        if request.target == b"/boom":
            raise KeyError(1)
        await create_stream(self, request)

    monkeypatch.setattr(H11Protocol, "_create_stream", failing)
    async with served() as server:
        stream = await server.client.completions.create(
            model="toy", prompt="go on", max_tokens=20, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [await stream.__anext__()]
        with anyio.fail_after(10):
            async with await anyio.connect_tcp("127.0.0.1", port_of(server)) as boom:
                await boom.send(b"GET /boom HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert await read_until_closed(boom) == b""
        chunks += [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(chunk.choices[0].text for chunk in chunks)
        await still_serving(server)
    failures = [r for r in caplog.records if "failed and was closed" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].levelno == logging.WARNING
    assert "KeyError" in failures[0].getMessage()
    assert failures[0].getMessage().startswith("connection from 127.0.0.1:")


async def test_connections_over_the_limit_are_answered_503() -> None:
    async with served(server_config=ServerConfig(max_connections=2)) as server:
        port = port_of(server)
        request = (
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\n\r\n"
        )
        with anyio.fail_after(10):
            async with (
                await anyio.connect_tcp("127.0.0.1", port) as idle,
                await anyio.connect_tcp("127.0.0.1", port) as second,
            ):
                await second.send(request)
                assert (await second.receive()).startswith(b"HTTP/1.1 200 ")
                async with await anyio.connect_tcp("127.0.0.1", port) as third:
                    await third.send(request)
                    answer = await read_until_closed(third)
                await idle.aclose()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), answer
        assert b"connection: close" in head.lower()
        assert msgspec.json.decode(body)["error"] == {
            "message": "Too many connections: the server serves at most 2 at once; retry later.",
            "type": "server_error",
            "param": None,
            "code": "too_many_connections",
        }
        # Once the others are closed (the server sees it soon after), it serves again.
        with anyio.fail_after(10):
            while (await server.http.get("/v1/models")).status_code == 503:
                pass
        await still_serving(server)


def virtual_time_on_trio() -> list[Any]:
    return [
        pytest.param("asyncio", id="asyncio"),
        pytest.param(
            ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}), id="trio-virtual"
        ),
    ]


def trickle_pace(anyio_backend: Any) -> tuple[ServerConfig, float, float]:
    """The server's limits, the pause between bytes, and the slack the deadline may take.

    In virtual time the deadline is exact. In real time a busy machine may notice it late:
    the slack is 10 s past a deadline of half a second, 20 times the deadline, for a loop
    that a two-core background load keeps waiting (tens of milliseconds a turn at worst
    seen). It still tells a cut from none: the trickles below are over 250 bytes at 0.05 s
    a byte, so a server that let one run would read it for 12.5 s or more past the slack's
    start, then answer it (or the trickle would say it read it all).
    """
    if anyio_backend == "asyncio":  # real time: a deadline of half a second
        return ServerConfig(header_timeout=0.5, body_timeout=0.5), 0.05, 10.0
    return ServerConfig(), 2.0, 2 * 2.0  # virtual time: the defaults against the client


async def trickle(stream: anyio.abc.ByteStream, data: bytes, pause: float) -> bytes:
    """Send ``data`` a byte per ``pause`` seconds until the server closes the connection.

    Returns what the server sent.
    """
    for byte in data:
        try:
            await stream.send(bytes([byte]))
        except (anyio.BrokenResourceError, OSError):
            break
        with anyio.move_on_after(pause):  # a pause that ends early if the server closes
            answer = await read_until_closed(stream)
            return answer
    raise AssertionError("the server read the whole trickle")


@pytest.mark.parametrize("anyio_backend", virtual_time_on_trio())
@pytest.mark.parametrize("after_a_response", [False, True], ids=["first", "next"])
async def test_headers_sent_a_byte_at_a_time_are_cut_at_the_deadline(
    anyio_backend: Any, after_a_response: bool
) -> None:
    """The deadline runs from the connection's start, or from the response before."""
    config, pause, slack = trickle_pace(anyio_backend)
    header_timeout = config.header_timeout
    most = header_timeout + slack
    async with served(server_config=config) as server:
        request = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        request += API_KEY.encode() + b"\r\n"
        with anyio.fail_after(most):
            # Taken before the server's deadline starts (at the connection, or once it
            # answered the request before, which is sent after this): the deadline cannot
            # have passed sooner than ``lasted``, however late this task ran. Taken after the
            # connection, a loaded machine that ran it 50 ms late failed the lower bound.
            started = anyio.current_time()
            async with await anyio.connect_tcp("127.0.0.1", port_of(server)) as stream:
                if after_a_response:
                    await stream.send(request + b"\r\n")
                    answer = b""
                    while not answer.endswith(b"}"):  # the whole JSON answer
                        answer += await stream.receive()
                    assert answer.startswith(b"HTTP/1.1 200 "), answer
                answer = await trickle(stream, request + b"X-Slow: " + b"x" * 200, pause)
                lasted = anyio.current_time() - started
        assert header_timeout - 1e-6 <= lasted < most, lasted  # 1e-6: the clocks' rounding
        assert answer == b""  # closed: a request that never was gets no answer
        await still_answering(server)


@pytest.mark.parametrize("anyio_backend", virtual_time_on_trio())
async def test_a_body_sent_a_byte_at_a_time_is_a_408_at_the_deadline(anyio_backend: Any) -> None:
    config, pause, slack = trickle_pace(anyio_backend)
    timeout = config.body_timeout
    most = timeout + slack
    async with served(server_config=config) as server:
        body = msgspec.json.encode({"model": "toy", "prompt": "x" * 300, "max_tokens": 2})
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            f"{API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with anyio.fail_after(most):
            async with await anyio.connect_tcp("127.0.0.1", port_of(server)) as stream:
                await stream.send(head + body[:10])
                answer = await trickle(stream, body[10:], pause)
        head, _, reply = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), answer
        assert b"connection: close" in head.lower()
        assert msgspec.json.decode(reply)["error"] == {
            "message": f"Request body not received in time: the limit is {timeout:g} s from "
            "the end of the headers.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
        assert server.engine.submitted == []
        await still_answering(server)
