"""What every request passes first: Host without a key, Content-Type on POSTs, shutdown refusals.

A web page can make a browser send requests to a server on loopback: cross-origin "simple"
POSTs (``text/plain``, no preflight) and, through DNS rebinding, same-origin ones whose
``Host`` is the attacker's name. Without an API key the server answers only to the names on
its allow-list, and a POST must say ``application/json``, which no page can send cross-origin
without a preflight this server never grants.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx
import pytest

from twostroke.engine import Engine
from twostroke.engine.config import LOOPBACK_HOST_NAMES, ServerConfig
from twostroke.engine.server import build_app, serve
from twostroke.engine.server.guards import ServerShutdown

from .conftest import API_KEY, OPENAI_STREAMS_ON_TRIO, Served, http_client, served

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

COMPLETION = {"model": "toy", "prompt": "hi", "max_tokens": 2}
POST_ROUTES = {
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": {"model": "toy", "messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"model": "toy", "prompt": "hi"},
    "/detokenize": {"model": "toy", "tokens": [104, 105]},
}


def error_of(reply: httpx.Response) -> dict[str, Any]:
    error = reply.json()["error"]
    assert isinstance(error, dict)
    assert reply.headers["connection"] == "close"  # the body, if any, was left unread
    return error


async def get_with_host(server: Served, host: str | None, path: str = "/v1/models") -> Any:
    headers = {} if host is None else {"host": host}
    return await server.http.get(path, headers=headers)


async def test_without_a_key_only_allowed_hosts_are_answered() -> None:
    async with served(api_key=None) as server:
        port = httpx.URL(server.base_url).port
        for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "LOCALHOST"):
            reply = await get_with_host(server, host)
            assert reply.status_code == 200, (host, reply.text)
        for host in (f"attacker.example:{port}", "127.0.0.2", "localhost.attacker.example"):
            for path in ("/v1/models", "/v1/nowhere"):
                reply = await get_with_host(server, host, path)
                assert reply.status_code == 403, (host, path)
                assert error_of(reply) == {
                    "message": f"Host {host!r} is not allowed: a server without an API key "
                    "answers only to 127.0.0.1, [::1], localhost (give it --allowed-hosts or "
                    "an API key).",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "host_not_allowed",
                }
        # HTTP/1.0 may leave Host out; without one there is nothing to allow.
        async with await anyio.connect_tcp("127.0.0.1", port or 0) as stream:
            await stream.send(b"GET /v1/models HTTP/1.0\r\n\r\n")
            assert (await stream.receive()).startswith(b"HTTP/1.1 403 ")
        for path in ("/health", "/metrics"):  # open, as with a key: probes use any name
            assert (await get_with_host(server, "10.1.2.3:8000", path)).status_code == 200
        rebound = await server.http.post(
            "/v1/completions", json=COMPLETION, headers={"host": "attacker.example"}
        )
        assert rebound.status_code == 403
        assert server.engine.submitted == []


async def test_the_allow_list_is_configurable_and_a_key_turns_the_check_off() -> None:
    allowed = ["LLM.internal", "fd00::5"]
    async with served(api_key=None, server_config=ServerConfig(allowed_hosts=allowed)) as server:
        assert (await get_with_host(server, "llm.internal:8000")).status_code == 200
        assert (await get_with_host(server, "[fd00::5]:8000")).status_code == 200
        assert (await get_with_host(server, "localhost")).status_code == 403
    async with served(api_key=None, server_config=ServerConfig(allowed_hosts=["*"])) as server:
        assert (await get_with_host(server, "anything.example")).status_code == 200
    async with served(api_key=API_KEY) as server:  # the key is what protects it then
        assert (await get_with_host(server, "attacker.example")).status_code == 200


async def test_the_bound_host_is_allowed_by_default() -> None:
    async with Engine.open(model="toy", device="cpu") as engine:
        async with anyio.create_task_group() as task_group:
            port = await task_group.start(lambda task_status: serve(
                engine, "127.0.0.1", 0, task_status=task_status
            ))  # fmt: skip
            async with http_client(f"http://127.0.0.1:{port}") as http:
                assert (await http.get("/v1/models")).status_code == 200
            task_group.cancel_scope.cancel()
    assert {"localhost", "127.0.0.1", "[::1]"} == LOOPBACK_HOST_NAMES


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "json"]
)
async def test_a_post_that_is_not_json_is_a_415(content_type: str | None) -> None:
    async with served() as server:
        for path, body in POST_ROUTES.items():
            headers = {} if content_type is None else {"content-type": content_type}
            content = httpx.Request("POST", "/", json=body).content
            reply = await server.http.post(path, content=content, headers=headers)
            assert reply.status_code == 415, (path, reply.text)
            assert error_of(reply) == {
                "message": f"Content-Type must be application/json, got {content_type!r}.",
                "type": "invalid_request_error",
                "param": None,
                "code": "unsupported_media_type",
            }
        assert server.engine.submitted == []
        for content_type in ("application/json", "Application/JSON; charset=utf-8"):
            reply = await server.http.post(
                "/v1/completions",
                content=httpx.Request("POST", "/", json=COMPLETION).content,
                headers={"content-type": content_type},
            )
            assert reply.status_code == 200, reply.text


async def test_new_requests_are_refused_once_the_shutdown_began() -> None:
    async with Engine.open(model="toy", device="cpu") as engine:
        shutdown = ServerShutdown()
        app = build_app(engine, shutdown=shutdown)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            assert (await http.get("/v1/models")).status_code == 200
            shutdown.begin()
            assert repr(shutdown) == "<ServerShutdown began>"
            reply = await http.post("/v1/completions", json=COMPLETION)
            assert reply.status_code == 503
            assert error_of(reply) == {
                "message": "The server is shutting down: it takes no new requests.",
                "type": "server_error",
                "param": None,
                "code": "server_shutting_down",
            }


async def test_binding_beyond_loopback_without_a_key_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface: the warning comes before the bind fails,
    # and nothing is ever reachable from the network.
    async with Engine.open(model="toy", device="cpu") as engine:
        with caplog.at_level(logging.WARNING, logger="twostroke.server"):
            with pytest.raises(OSError, match=r"192\.0\.2\.1"):
                await serve(engine, "192.0.2.1", 0)
            with pytest.raises(OSError, match=r"192\.0\.2\.1"):
                await serve(engine, "192.0.2.1", 0, api_key="sk-x")
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert [record.getMessage() for record in warnings] == [
        "serving 192.0.2.1 without an API key: anyone who can reach it may use it (pass "
        "--api-key or set TWOSTROKE_API_KEY)"
    ]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"allowed_hosts": "localhost"}, TypeError, "allowed_hosts must be a list of host "
         "names, got str 'localhost'"),
        ({"allowed_hosts": ["localhost:8000"]}, ValueError, "allowed_hosts entries must be "
         "host names without a port, got 'localhost:8000'"),
        ({"allowed_hosts": [""]}, ValueError, "allowed_hosts entries must be host names "
         "without a port, got ''"),
        ({"allowed_hosts": [7]}, TypeError, "allowed_hosts entries must be str, got int 7"),
        ({"body_timeout": 0}, ValueError, "body_timeout must be > 0 seconds and finite, got 0"),
        ({"body_timeout": "5"}, TypeError, "body_timeout must be a number of seconds, got "
         "str '5'"),
        ({"header_timeout": float("inf")}, ValueError, "header_timeout must be > 0 seconds "
         "and finite, got inf"),
        ({"max_connections": 0}, ValueError, "max_connections must be >= 1, got 0"),
        ({"max_connections": True}, TypeError, "max_connections must be an int, got bool "
         "True"),
        ({"shutdown_timeout": -1}, ValueError, "shutdown_timeout must be >= 0 seconds and "
         "finite, got -1"),
    ],
)  # fmt: skip
async def test_bad_limits_are_refused_where_they_are_configured(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    # In ServerConfig, before serve() is called: it takes the limits whole, already checked.
    with pytest.raises(error) as caught:
        ServerConfig(**options)
    assert str(caught.value) == message
