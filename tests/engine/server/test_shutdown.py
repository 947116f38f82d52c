"""Cancelling ``serve()``: it stops accepting, lets open responses finish within the grace
period, then ends each one (a stream with an OpenAI-shaped ``error`` event and ``[DONE]``).

The engine here is the toy runner with a per-step latency, so that a response is still open
when the server is cancelled; the grace periods are a fraction of a second of real time.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import attrs
import httpx
import msgspec
import pytest

from twostroke.engine import Engine
from twostroke.engine.config import ServerConfig
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.engine.server import serve

from .conftest import API_KEY, ObservedEngine, http_client

pytestmark = pytest.mark.anyio

AUTH = {"authorization": f"Bearer {API_KEY}"}


@attrs.frozen
class Stoppable:
    """A server whose cancel scope the test holds."""

    engine: ObservedEngine
    http: httpx.AsyncClient
    port: int
    scope: anyio.CancelScope
    stopped: anyio.Event


@asynccontextmanager
async def stoppable(latency: float, config: ServerConfig) -> AsyncIterator[Stoppable]:
    runner = ToyRunner(eos_rate=0, latency=latency)
    async with Engine.open(
        runner=runner, tokenizer=ByteTokenizer(), device="cpu", model_name="toy"
    ) as real_engine:
        engine = ObservedEngine(real_engine)
        async with anyio.create_task_group() as task_group:
            scope = anyio.CancelScope()
            stopped = anyio.Event()

            async def run(*, task_status: anyio.abc.TaskStatus[int]) -> None:
                with scope:
                    await serve(
                        engine, port=0, api_key=API_KEY, config=config, task_status=task_status
                    )
                stopped.set()

            port = await task_group.start(run)
            async with http_client(f"http://127.0.0.1:{port}", headers=AUTH, timeout=10) as http:
                yield Stoppable(engine, http, port, scope, stopped)
            scope.cancel()


def completion(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {"model": "toy", "prompt": "hi", "max_tokens": max_tokens, "stream": stream}


async def events_of(response: httpx.Response) -> AsyncIterator[Any]:
    """The ``data:`` payloads of an SSE response, decoded (``[DONE]`` as a string)."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == "[DONE]" else msgspec.json.decode(payload)


async def test_open_responses_finish_within_the_grace_period() -> None:
    """On trio the stream was cut at once: Hypercorn got no ``shutdown_trigger``."""
    async with stoppable(latency=0.01, config=ServerConfig(shutdown_timeout=30)) as server:
        with anyio.fail_after(20):
            async with server.http.stream(
                "POST", "/v1/completions", json=completion(20, stream=True)
            ) as response:
                assert response.status_code == 200
                events = events_of(response)
                received = [await events.__anext__()]
                async with anyio.create_task_group() as task_group:
                    answer: list[httpx.Response] = []

                    async def unstreamed() -> None:
                        answer.append(
                            await server.http.post(
                                "/v1/completions", json=completion(10, stream=False)
                            )
                        )

                    task_group.start_soon(unstreamed)
                    await server.engine.wait_submitted(2)
                    server.scope.cancel()  # the server shuts down with both open
                received += [event async for event in events]
            await server.stopped.wait()
        assert received[-1] == "[DONE]"
        assert received[-2]["choices"][0]["finish_reason"] == "length"
        text = "".join(event["choices"][0]["text"] for event in received[:-1])
        assert len(text) == 20
        assert answer[0].status_code == 200, answer[0].text
        assert answer[0].json()["usage"]["completion_tokens"] == 10
        with pytest.raises(OSError, match="All connection attempts failed"):  # not accepting
            await anyio.connect_tcp("127.0.0.1", server.port)


async def test_responses_open_at_the_end_of_the_grace_period_are_ended() -> None:
    """On uvicorn such a stream ended without an error event or ``[DONE]``."""
    async with stoppable(latency=0.02, config=ServerConfig(shutdown_timeout=0.2)) as server:
        with anyio.fail_after(20):
            async with server.http.stream(
                "POST", "/v1/completions", json=completion(3000, stream=True)
            ) as response:
                events = events_of(response)
                received = [await events.__anext__()]
                async with anyio.create_task_group() as task_group:
                    answer: list[httpx.Response] = []

                    async def unstreamed() -> None:
                        answer.append(
                            await server.http.post(
                                "/v1/completions", json=completion(3000, stream=False)
                            )
                        )

                    task_group.start_soon(unstreamed)
                    await server.engine.wait_submitted(2)
                    server.scope.cancel()
                received += [event async for event in events]
            await server.stopped.wait()
            await server.engine.wait_idle()  # both engine requests were cancelled
        error = {
            "message": "The server is shutting down: the request did not finish within the "
            "grace period.",
            "type": "server_error",
            "param": None,
            "code": "server_shutting_down",
        }
        assert received[-2:] == [{"error": error}, "[DONE]"]
        assert all("choices" in event for event in received[:-2])
        assert answer[0].status_code == 503
        assert answer[0].json() == {"error": error}
        stats = server.engine.statistics()
        assert stats.num_tokens_generated < 3000
        assert stats.num_free_blocks == stats.num_blocks


async def test_a_responses_stream_open_at_the_end_of_the_grace_period_ends_as_one() -> None:
    """A ``/v1/responses`` stream is ended with the Responses API's ``error`` and
    ``response.failed`` events (its sequence numbers continuing), never chat's ``[DONE]``."""
    body = {"model": "toy", "input": "hi", "max_output_tokens": 3000, "stream": True}
    async with stoppable(latency=0.02, config=ServerConfig(shutdown_timeout=0.2)) as server:
        with anyio.fail_after(20):
            async with server.http.stream("POST", "/v1/responses", json=body) as response:
                events = events_of(response)
                received = [await events.__anext__()]
                await server.engine.wait_submitted(1)
                server.scope.cancel()
                received += [event async for event in events]
            await server.stopped.wait()
            await server.engine.wait_idle()
    assert "[DONE]" not in received
    *_, error, failed = received
    message = "The server is shutting down: the request did not finish within the grace period."
    assert (error["type"], error["code"], error["message"]) == (
        "error", "server_shutting_down", message)  # fmt: skip
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_shutting_down", "message": message}
    assert [event["sequence_number"] for event in received] == list(range(len(received)))


async def test_a_client_that_stops_reading_is_cut_off_after_the_grace_period() -> None:
    """Ending its stream needs a write the client never takes: the connection is closed
    ``CLOSING_SECONDS`` after the grace period instead, and the server's call returns."""
    async with stoppable(latency=0, config=ServerConfig(shutdown_timeout=0.2)) as server:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        sock.connect(("127.0.0.1", server.port))
        body = msgspec.json.encode(completion(1500, stream=True) | {"logprobs": 5})
        async with await anyio.abc.SocketStream.from_socket(sock) as stream:
            await stream.send(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                + API_KEY.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            with anyio.fail_after(20):
                await server.engine.wait_submitted(1)
                await server.engine.wait_idle()  # generated; the answer waits on the client
                server.scope.cancel()
                await server.stopped.wait()
                received = await read_all(stream)
        assert received.startswith(b"HTTP/1.1 200 ")
        assert not received.endswith(b"data: [DONE]\n\n"), "the stream was not cut off"


async def read_all(stream: anyio.abc.ByteStream) -> bytes:
    received = b""
    while True:
        try:
            received += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            return received
