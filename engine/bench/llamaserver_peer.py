"""llama.cpp's own server (``llama-server``) as a benchmark peer: the batched llama.cpp.

The ``llama.cpp`` peer (:mod:`.llamacpp_peer`) runs the Python binding, which serves one
sequence at a time. ``llama-server`` is what users run to serve many: ``-np`` slots decoded
together, continuous batching (``--cont-batching``) taking a new request into a slot that
frees. ``make bench-peers`` builds it from the llama.cpp that the same llama-cpp-python source
distribution vendors (``scripts/setup_llamaserver_peer.sh``), for this machine's CPU, as
``.venv-llamacpp/bin/llama-server``; ``make bench`` passes it as ``--llamaserver-binary``.

The driver starts the binary as a child process it owns, in a process group of its own, bound
to ``127.0.0.1`` on a free port, on the model's GGUF file with its weights as stored; waits
for ``GET /health`` (bounded by :attr:`LlamaServerDriver.startup_timeout`); then sends the
workload exactly as :class:`~twostroke.engine.bench.http_peer.EndpointDriver` sends it to any
OpenAI-compatible server (streamed ``/v1/completions`` with the workload's token ids, greedy,
EOS ignored, usage asked for), and reads a client's timings. The group is killed and the server
reaped when the run ends, fails, times out or is interrupted. Start-up (loading the file) is
the time to the first healthy answer.

Its slots hold whole requests: the context is ``slots x`` the workload's longest request
(prompt and output; rounded up to 256 tokens a slot, as the server rounds it), which the server
splits evenly among its slots. The server reports no
token ids over ``/v1/completions``, so the row has no greedy check.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import attrs

from twostroke.engine.bench.child import ChildError, child_environment, end_group, last_line
from twostroke.engine.bench.http_peer import EndpointDriver
from twostroke.engine.bench.llamacpp_peer import gguf_weights
from twostroke.engine.bench.metrics import SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import Workload
from twostroke.states.scheduler_config import SchedulingPolicy
from twostroke.states.validators import int_at_least

__all__ = ["DEFAULT_BINARY", "SETUP_HINT", "LlamaServerDriver", "default_binary", "server_command"]

#: Where ``make bench-peers`` installs the native build, relative to the repository root.
DEFAULT_BINARY = Path(".venv-llamacpp/bin/llama-server")

#: How to build it, appended to the messages that say it is missing.
SETUP_HINT = (
    "build it with make bench-peers (.venv-llamacpp/bin/llama-server), then pass "
    "--llamaserver-binary .venv-llamacpp/bin/llama-server"
)

#: The server rounds each slot's context up to a multiple of this many tokens (GGML_PAD in
#: ``llama_context``), and warns where ``-c`` was not one already.
SLOT_CONTEXT_STEP = 256

#: Seconds between two ``GET /health`` while the server loads the file.
_HEALTH_POLL = 0.1
# How long a request whose connection broke waits for the server's exit before it counts
# as the request's own failure: a server that dies closes its sockets a moment before its
# parent can see its status, so a bare ``poll()`` races the client's "server disconnected".
_EXIT_GRACE = 5.0


def default_binary() -> Path | None:
    """:data:`DEFAULT_BINARY` where it exists (``--llamaserver-binary``'s default), else
    ``None``."""
    return DEFAULT_BINARY if DEFAULT_BINARY.exists() else None


def _optional_path(value: str | os.PathLike[str] | None) -> Path | None:
    return None if value is None else Path(value)


def _variables(value: dict[str, str] | None) -> dict[str, str]:
    return dict(value or {})


def server_command(
    binary: Path, workload: Workload, *, model: ModelSpec, slots: int, port: int
) -> list[str]:
    """The command line that serves ``model`` for ``workload``.

    Args:
        binary: The ``llama-server`` executable.
        workload: What it will serve: its longest request sizes each slot's context.
        model: The GGUF file and the thread count.
        slots: Requests decoded together (``-np``).
        port: Where it listens, on ``127.0.0.1``.

    Returns:
        ``[binary, "-m", FILE, ...]``: the context ``slots x`` the longest request (prompt and
        output) rounded up to :data:`SLOT_CONTEXT_STEP` tokens, as the server would round it,
        continuous batching, ``model.threads`` threads for decoding and prompts alike, and no
        web page.
    """
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
    per_slot = -(-longest // SLOT_CONTEXT_STEP) * SLOT_CONTEXT_STEP
    return [
        str(binary),
        "-m",
        str(model.source),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * per_slot),
        "--threads",
        str(model.threads),
        "--threads-batch",
        str(model.threads),
        "--cont-batching",
        "--no-webui",
    ]


def _free_port() -> int:
    """A port nothing on ``127.0.0.1`` listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@attrs.define(eq=False, kw_only=True)
class LlamaServerDriver:
    """``llama-server`` on the model's GGUF file, its slots continuously batched, greedy, in a
    child process this driver starts and ends.

    Attributes:
        binary: The ``llama-server`` executable (``--llamaserver-binary``); ``None``: not
            built (every run says how to build it).
        max_num_seqs: Slots (``-np``), as the bench's ``--max-num-seqs`` bounds twostroke:
            an int >= 1, else ``TypeError`` or ``ValueError``. A run takes no more slots than
            it has requests, since a slot's context is allocated whether or not a request
            fills it.
        name: The system's name in reports.
        startup_timeout: Seconds the server may take to answer ``GET /health``.
        request_timeout: Seconds a request may wait for the server's next bytes.
        env: Extra environment for the server (tests pass a fake's settings).
    """

    binary: Path | None = attrs.field(default=None, converter=_optional_path)
    max_num_seqs: int = attrs.field(
        default=SchedulingPolicy().max_num_seqs, validator=int_at_least(1)
    )
    name: str = "llama-server"
    startup_timeout: float = 600.0
    request_timeout: float = 600.0
    env: dict[str, str] = attrs.field(factory=dict, converter=_variables)

    def check(self) -> str | None:
        """``None`` if :attr:`binary` runs (``--version`` succeeds), else why not."""
        if self.binary is None:
            return f"llama-server is not available: {SETUP_HINT}"
        if not self.binary.exists():
            return f"--llamaserver-binary {self.binary} does not exist: {SETUP_HINT}"
        try:
            self._version()
        except ChildError as error:
            return str(error)
        return None

    def _version(self) -> str:
        """What ``binary --version`` says (``version: 0 (llama-cpp-python-0.3.36-native)``).

        Raises:
            ChildError: it cannot be run, or fails.
        """
        assert self.binary is not None  # check() and run() ask first
        try:
            completed = subprocess.run(
                [str(self.binary), "--version"],
                env=child_environment(self.env),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise ChildError(f"cannot run {self.binary} --version: {error}") from None
        # It prints its build to stderr, after any backend's start-up lines.
        lines = (completed.stdout + completed.stderr).splitlines()
        if completed.returncode != 0:
            raise ChildError(
                f"{self.binary} --version failed ({completed.returncode}): "
                f"{last_line(completed.stderr + completed.stdout)}"
            )
        return next((line for line in lines if line.startswith("version:")), "unknown")

    def slots(self, workload: Workload) -> int:
        """``-np`` for ``workload``: :attr:`max_num_seqs`, no more than its requests."""
        return min(self.max_num_seqs, len(workload.requests))

    def refusal(self, workload: Workload, model: ModelSpec) -> str | None:
        """Why it does not run ``workload`` on ``model``: a model that is not a GGUF file; JSON
        schemas and tools (the driver sends vLLM's ``structured_outputs``, which this server
        would ignore and run unconstrained)."""
        if not model.is_gguf:
            return f"llama-server needs a GGUF file; {model.source} is not one"
        if workload.num_constrained:
            return "JSON schemas and tools are not run through llama-server's grammar here"
        return None

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Start the server, send the workload to it, end the server.

        Returns:
            A client's timings, with the server's start-up as ``startup_seconds`` and in
            ``extra`` its weights (:func:`~.llamacpp_peer.gguf_weights`), batching, command
            line, version and log; or an unavailable result when the workload or model is
            refused, the binary is missing, or the server exits or stays unhealthy before it
            is ready, or exits during the run (naming its log).

        Raises:
            ValueError: the model's GGUF file cannot be read.
            Exception: a request failed while the server still ran (what
                :class:`~.http_peer.EndpointDriver` raises; the bench records it).

        Whatever ends the run, an interrupt (``KeyboardInterrupt``) included, the server's
        process group is killed and the server reaped before this returns or raises.
        """
        refusal = self.refusal(workload, model)
        if refusal is not None:
            return SystemResult.unavailable(self.name, refusal)
        reason = self.check()
        if reason is not None:
            return SystemResult.unavailable(self.name, reason)
        assert self.binary is not None  # check() said so
        weights = gguf_weights(model.source)  # before the server: a bad file is not worth it
        version = self._version()
        slots = self.slots(workload)
        port = _free_port()
        command = server_command(self.binary, workload, model=model, slots=slots, port=port)
        folder = model.work_dir / "llamaserver"
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / "server.log"
        base = f"http://127.0.0.1:{port}"
        started = time.perf_counter()
        with log_path.open("w") as log:
            process = subprocess.Popen(
                command,
                env=child_environment(self.env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # A group of its own, so that whatever it starts ends with it (end_group).
                start_new_session=True,
            )
            try:
                self._wait_until_healthy(process, base, log_path)
                startup = time.perf_counter() - started
                driver = EndpointDriver(
                    name=self.name, base_url=f"{base}/v1", timeout=self.request_timeout
                )
                try:
                    result = driver.run(workload, model=model)
                except Exception as error:
                    if not _has_exited(process, error):
                        raise
                    raise ChildError(
                        f"llama-server exited with status {process.returncode} during the run "
                        f"({last_line(log_path.read_text(errors='replace'))}); see {log_path}"
                    ) from error
            except ChildError as error:
                return SystemResult.unavailable(self.name, str(error))
            finally:
                end_group(process)
        if not result.available:
            return result
        extra: dict[str, Any] = {
            **result.extra,
            "weight_format": weights.file_type,
            "weights": f"{weights.describe()}, computed as stored",
            "batching": f"continuous, {slots} slots (-np {slots})",
            "threads": model.threads,
            "version": version,
            "command": " ".join(command),
            "log": str(log_path),
        }
        return attrs.evolve(result, startup_seconds=startup, extra=extra)

    def _wait_until_healthy(
        self, process: subprocess.Popen[bytes], base: str, log_path: Path
    ) -> None:
        """Return once ``GET /health`` answers 200 (503 while the file loads).

        Raises:
            ChildError: the server exited first, or did not answer 200 within
                :attr:`startup_timeout` seconds.
        """
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        while True:
            if process.poll() is not None:
                raise ChildError(
                    f"llama-server exited with status {process.returncode} before it was ready "
                    f"({last_line(log_path.read_text(errors='replace'))}); see {log_path}"
                )
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() >= deadline:
                raise ChildError(
                    f"llama-server was not healthy within startup_timeout="
                    f"{self.startup_timeout:g} s; see {log_path}"
                )
            time.sleep(_HEALTH_POLL)


def _has_exited(process: subprocess.Popen[bytes], error: Exception) -> bool:
    """Whether the server has exited, given that a request failed with ``error``.

    An answer (a 500, a stream's error) comes from a live server and is not waited on; a
    broken connection waits up to :data:`_EXIT_GRACE` seconds for the exit it may be.
    """
    import httpx

    broken = (
        error.subgroup(httpx.TransportError) is not None
        if isinstance(error, ExceptionGroup)
        else isinstance(error, httpx.TransportError)
    )
    try:
        process.wait(timeout=_EXIT_GRACE if broken else 0)
    except subprocess.TimeoutExpired:
        return False
    return True
