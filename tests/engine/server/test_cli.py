"""``twostroke serve`` as a command: its options, it serves, and SIGTERM or Ctrl-C stop it."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from twostroke.engine.cli import build_parser
from twostroke.engine.config import ServerConfig


def test_max_body_bytes_is_parsed() -> None:
    parser = build_parser()
    given = parser.parse_args(["serve", "--max-body-bytes", "1048576"])
    assert given.max_body_bytes == 1048576
    # Absent, the server's own default applies (the help says what it is).
    assert parser.parse_args(["serve"]).max_body_bytes == ServerConfig().max_body_bytes


def test_tool_format_is_one_of_the_formats(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).tool_format is None  # the chat template decides
    for name in ("hermes", "generic", "llama3_json", "mistral"):
        assert parser.parse_args(["serve", "--tool-format", name]).tool_format == name
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["serve", "--tool-format", "xml"])
    assert exited.value.code == 2
    assert "argument --tool-format: invalid choice: 'xml'" in capsys.readouterr().err


def test_quantization_is_passed_only_when_given() -> None:
    from twostroke.engine.cli import _engine_options

    parser = build_parser()
    assert _engine_options(parser.parse_args(["generate", "Hi"])) == {}  # the engine's "auto"
    assert _engine_options(parser.parse_args(["generate", "Hi", "-q", "int8"])) == {
        "quantization": "int8"
    }
    serve = parser.parse_args(["serve", "--quantization", "none"])
    assert _engine_options(serve) == {"quantization": None}
    bench = parser.parse_args(["bench", "--quantization", "fp16", "--quantization", "int8"])
    assert bench.quantization == ["fp16", "int8"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "max_body_bytes must be >= 1, got 0"),
        ("-1", "max_body_bytes must be >= 1, got -1"),
        ("8MiB", "max_body_bytes must be an int, got '8MiB'"),
        ("1.5", "max_body_bytes must be an int, got '1.5'"),
    ],
)
def test_a_bad_max_body_bytes_is_refused_before_anything_loads(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--model", "toy", f"--max-body-bytes={value}"])
    assert exited.value.code == 2
    assert f"argument --max-body-bytes: {message}" in capsys.readouterr().err


def post_too_large(base_url: str, limit: int) -> bytes:
    """The status line and headers of a POST declaring a body one byte over ``limit``.

    Only the headers are sent: the server must answer without waiting for the body.
    """
    host, port = base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer sk-cli\r\nContent-Type: application/json\r\n"
            f"Content-Length: {limit + 1}\r\n\r\n".encode()
        )
        answer = b""
        while chunk := connection.recv(65536):  # the server closes after a 413
            answer += chunk
    return answer


@contextlib.contextmanager
def serve_command(backend: str, *extra: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``twostroke serve`` on the toy model (key ``sk-cli``): the process and its ``/v1`` URL.

    The process is killed if the block leaves it running (a failed test).
    """
    command = [sys.executable, "-m", "twostroke.engine.cli", "serve", "--model", "toy", *extra]
    command += ["--device", "cpu", "--port", "0", "--backend", backend, "--api-key", "sk-cli"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        try:
            assert process.stdout is not None
            lines = []
            for line in process.stdout:
                lines.append(line)
                if line.startswith("serving"):
                    break
            match = re.search(r"(http://\S+/v1)", "".join(lines))
            assert match, lines
            yield process, match.group(1)
        finally:
            if process.poll() is None:
                process.kill()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "stop", "extra"),
    [
        ("asyncio", signal.SIGTERM, ["--max-body-bytes", "4096"]),
        ("trio", signal.SIGINT, []),
        ("trio", signal.SIGTERM, ["--replicas", "2", "--placement", "process"]),
    ],
)
def test_serve_command_serves_and_stops_on_a_signal(
    backend: str, stop: signal.Signals, extra: list[str]
) -> None:
    with serve_command(backend, *extra) as (process, url):
        reply = httpx.post(
            f"{url}/completions",
            json={"model": "toy", "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
            headers={"authorization": "Bearer sk-cli"},
            timeout=30,
        )
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] == 3
        if "--max-body-bytes" in extra:
            answer = post_too_large(url, 4096)
            assert answer.startswith(b"HTTP/1.1 413 "), answer
            assert b"the limit is 4096 bytes" in answer, answer
        process.send_signal(stop)
        assert process.wait(timeout=30) == 0
