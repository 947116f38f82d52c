"""``twostroke serve`` as a command: it serves, and SIGTERM or Ctrl-C stop it cleanly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "stop", "extra"),
    [
        ("asyncio", signal.SIGTERM, []),
        ("trio", signal.SIGINT, []),
        ("trio", signal.SIGTERM, ["--replicas", "2", "--placement", "process"]),
    ],
)
def test_serve_command_serves_and_stops_on_a_signal(
    backend: str, stop: signal.Signals, extra: list[str]
) -> None:
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
            reply = httpx.post(
                f"{match.group(1)}/completions",
                json={"model": "toy", "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                headers={"authorization": "Bearer sk-cli"},
                timeout=30,
            )
            assert reply.status_code == 200
            assert reply.json()["usage"]["completion_tokens"] == 3
            process.send_signal(stop)
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
