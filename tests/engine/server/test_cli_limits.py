"""``twostroke serve``'s limit flags, and SIGTERM letting an open stream finish (on trio too)."""

from __future__ import annotations

import signal

import attrs
import httpx
import msgspec
import pytest

from twostroke.engine.cli import _server_config, build_parser
from twostroke.engine.config import ServerConfig

from .test_cli import serve_command


def test_the_limit_flags_are_parsed_and_absent_ones_keep_the_server_defaults() -> None:
    parser = build_parser()
    given = parser.parse_args(
        ["serve", "--allowed-hosts", "LLM.internal,10.0.0.5", "--max-connections", "100",
         "--header-timeout", "2.5", "--body-timeout", "30", "--shutdown-timeout", "0",
         "--max-body-bytes", "1024", "--max-choices", "8", "--max-waiting-requests", "64",
         "--keepalive", "0.5"]
    )  # fmt: skip
    assert _server_config(given) == ServerConfig(
        allowed_hosts=frozenset({"llm.internal", "10.0.0.5"}),
        max_connections=100,
        header_timeout=2.5,
        body_timeout=30.0,
        shutdown_timeout=0.0,
        max_body_bytes=1024,
        max_choices=8,
        max_waiting_requests=64,
        keepalive=0.5,
    )
    assert _server_config(parser.parse_args(["serve"])) == ServerConfig()


def test_every_field_of_the_server_config_is_a_flag_with_its_default_in_the_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert (
        "--max-body-bytes N the largest request body accepted, in bytes (default: 8388608)" in shown
    )
    assert "--header-timeout SECONDS seconds a connection has to send a request's headers" in shown
    assert "(default: 10)" in shown
    for field in attrs.fields(ServerConfig):
        assert f"--{field.name.replace('_', '-')} " in shown


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--allowed-hosts", "localhost:8000", "allowed_hosts entries must be host names "
         "without a port, got 'localhost:8000'"),
        ("--allowed-hosts", "a,,b", "allowed_hosts entries must be host names without a port, "
         "got ''"),
        ("--max-connections", "0", "max_connections must be >= 1, got 0"),
        ("--max-connections", "many", "max_connections must be an int, got 'many'"),
        ("--header-timeout", "0", "header_timeout must be > 0 seconds and finite, got 0.0"),
        ("--header-timeout", "10s", "header_timeout must be a number of seconds, got '10s'"),
        ("--body-timeout", "inf", "body_timeout must be > 0 seconds and finite, got inf"),
        ("--shutdown-timeout", "-1", "shutdown_timeout must be >= 0 seconds and finite, got "
         "-1.0"),
        ("--keepalive", "0", "keepalive must be > 0 seconds and finite, got 0.0"),
        ("--max-choices", "8.5", "max_choices must be an int, got '8.5'"),
    ],
)  # fmt: skip
def test_a_bad_limit_is_refused_before_anything_loads(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--model", "toy", f"{flag}={value}"])
    assert exited.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_sigterm_lets_an_open_stream_finish(backend: str) -> None:
    """The issue's case: on trio a 2.6 s stream was cut at 0.7 s by SIGTERM."""
    with serve_command(backend) as (process, url):
        request = {"model": "toy", "prompt": "hi", "max_tokens": 300, "stream": True,
                   "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        events = []
        with httpx.stream(
            "POST",
            f"{url}/completions",
            json=request,
            headers={"authorization": "Bearer sk-cli"},
            timeout=30,
        ) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else msgspec.json.decode(payload))
                if len(events) == 1:
                    process.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 300  # all of it
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=30) == 0
