"""The ``process`` placement: one child process per replica on this machine.

Each replica is ``python -m twostroke.engine.coordinator.replica_server``, started with
:func:`anyio.open_process` and spoken to in frames over its stdin and stdout (no ports, the
same on asyncio and trio), in a session of its own, so that signals meant for the
coordinator's process group (Ctrl-C) never reach it: the coordinator alone decides when its
children stop. The supervisor task owns the child from start to reaping: it kills
a child that failed at once, gives one that is shutting down ``grace_period`` seconds to exit
before killing it, and always waits for it, also when cancelled, so that no child outlives
the coordinator's ``async with`` block. The child's stderr is forwarded, line by line with a
``[replica N]`` prefix, and its last lines go into the error if it dies; a line longer than
:data:`MAX_STDERR_LINE_BYTES` is cut there, with a marker saying how much was cut, so a child
that writes without newlines costs the coordinator a bounded buffer and time linear in what
it wrote.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

import anyio
import anyio.abc

from twostroke.engine.coordinator.frames import Start
from twostroke.engine.coordinator.replica_client import Relay, RemoteReplica
from twostroke.engine.errors import ReplicaFailed
from twostroke.gpu.openmp import replica_wait_policy

__all__ = [
    "MAX_STDERR_LINE_BYTES",
    "WITHHELD_VARIABLES",
    "ProcessReplica",
    "StderrLines",
    "replica_command",
    "replica_environment",
]

_STDERR_LINES = 20
#: The longest line of a child's stderr that is forwarded whole (the rest is cut).
MAX_STDERR_LINE_BYTES = 8192


def current_backend() -> str:
    """``"trio"`` inside a trio run, else ``"asyncio"`` (anyio's two backends)."""
    trio = sys.modules.get("trio")
    if trio is not None and trio.lowlevel.in_trio_run():
        return "trio"
    return "asyncio"


def replica_command(backend: str | None = None) -> list[str]:
    """The command line of a replica child on this event loop's backend."""
    backend = backend or current_backend()
    module = "twostroke.engine.coordinator.replica_server"
    return [sys.executable, "-m", module, "--backend", backend]


#: Variables of the coordinator's environment its replica children do not get: a replica
#: serves no HTTP, and a secret it never needs is one it cannot leak (a crash report, a
#: ``/proc/<pid>/environ`` readable by the same user).
WITHHELD_VARIABLES = frozenset({"TWOSTROKE_API_KEY"})


def replica_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a replica child.

    It is ``environ`` (default: ``os.environ``) without :data:`WITHHELD_VARIABLES`, and with
    passive OpenMP waits unless the user chose a policy: a process replica runs a fixed share
    of the cores' torch threads, which no thread governor watches
    (:func:`~twostroke.gpu.openmp.replica_wait_policy`).
    """
    source = os.environ if environ is None else environ
    kept = {name: value for name, value in source.items() if name not in WITHHELD_VARIABLES}
    return replica_wait_policy(kept)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "no exit status"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


class ProcessReplica(RemoteReplica):
    """A replica in a child process.

    Args:
        index: The replica's index.
        relay: The coordinator.
        start: The first frame (model and engine options).
        grace_period: Seconds a child that was told to shut down may take to exit.
        command: The child's command line (default: :func:`replica_command`).
    """

    placement = "process"

    def __init__(
        self,
        index: int,
        relay: Relay,
        start: Start,
        *,
        grace_period: float,
        command: Sequence[str] | None = None,
    ) -> None:
        super().__init__(index, relay, start)
        self._grace_period = grace_period
        self._command = list(command) if command is not None else None

    async def run(self) -> None:
        command = self._command or replica_command()
        try:
            # A session of its own: a Ctrl-C at the terminal (SIGINT to the foreground
            # process group) or a hangup reaches the coordinator only, which drains and then
            # stops its children itself; the supervisor reaps the child in every case.
            process = await anyio.open_process(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=replica_environment(),
            )
        except OSError as exc:
            self._start_cause = exc
            self.settle_start(f"its process could not start: {exc!r}")
            return
        self.pid = process.pid
        tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        cause: BaseException | None = None
        try:
            async with anyio.create_task_group() as task_group:
                assert process.stdout is not None
                assert process.stdin is not None
                task_group.start_soon(self._forward_stderr, process, tail)
                task_group.start_soon(self._kill_after_grace, process)
                cause = await self.serve(process.stdout, process.stdin)
                failed = cause is not None or not self._started
                await _stop(process, 0 if failed else self._grace_period)
                task_group.cancel_scope.cancel()
        finally:
            await _reap(process, self._grace_period)
        detail = f"its process {process.pid} ended with {describe_exit(process.returncode)}"
        if tail:
            detail += "; its last output:\n" + "\n".join(tail)
        if not self._started:
            self.settle_start(detail)
            return
        if cause is None:
            return
        error = ReplicaFailed(self.index, f"{cause}; {detail}")
        error.__cause__ = cause
        self.fail(error)

    async def _kill_after_grace(self, process: anyio.abc.Process) -> None:
        """A child told to stop gets ``grace_period`` seconds to close its output."""
        await self.wait_closed(self._grace_period)
        _kill(process)

    async def _forward_stderr(
        self, process: anyio.abc.Process, tail: collections.deque[str]
    ) -> None:
        assert process.stderr is not None
        lines = StderrLines()
        async for chunk in process.stderr:
            for line in lines.feed(chunk):
                tail.append(line)
                print(f"[replica {self.index}] {line}", file=sys.stderr)
        last = lines.close()
        if last is not None:
            tail.append(last)


class StderrLines:
    """Splits a child's stderr into lines, each cut at ``limit`` bytes.

    Each byte is looked at once and at most ``limit`` bytes of a line are kept: a child that
    writes 64 MiB without a newline costs a ``limit``-byte buffer, not a 64 MiB one that is
    copied again for every chunk.

    Args:
        limit: The most bytes of one line kept; the rest is counted and dropped.
    """

    def __init__(self, limit: int = MAX_STDERR_LINE_BYTES) -> None:
        self._limit = limit
        self._line = bytearray()
        self._cut = 0

    def feed(self, data: bytes) -> list[str]:
        """The lines that ``data`` ends (a partial line waits for its newline)."""
        lines: list[str] = []
        view = memoryview(data)
        start = 0
        while True:
            end = data.find(b"\n", start)
            piece = view[start:] if end < 0 else view[start:end]
            room = max(0, self._limit - len(self._line))
            self._line += piece[:room]
            self._cut += max(0, len(piece) - room)
            if end < 0:
                return lines
            lines.append(self._take())
            start = end + 1

    def close(self) -> str | None:
        """The stream ended: the unfinished last line, if any."""
        if not self._line and not self._cut:
            return None
        return self._take()

    def _take(self) -> str:
        line = self._line.decode("utf-8", errors="replace")
        if self._cut:
            line += f"... [{self._cut} more bytes of this line cut]"
        self._line = bytearray()
        self._cut = 0
        return line


def _kill(process: anyio.abc.Process) -> None:
    """SIGKILL the child without reaping it.

    ``Process.kill`` polls first (``subprocess.Popen.send_signal``), and on asyncio that poll
    can reap a child that has just exited before asyncio's own child watcher does, which then
    reports exit status 255 instead of the real one. The pid stays the child's until it is
    reaped, so signalling it directly is safe.
    """
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL)


async def _stop(process: anyio.abc.Process, grace_period: float) -> None:
    """Close the child's input, give it ``grace_period`` seconds, kill it, wait for it."""
    with anyio.CancelScope(shield=True):
        if process.stdin is not None:
            with contextlib.suppress(Exception):
                await process.stdin.aclose()
        if process.returncode is None:
            with anyio.move_on_after(grace_period):
                await process.wait()
        if process.returncode is None:
            _kill(process)
        await process.wait()


async def _reap(process: anyio.abc.Process, grace_period: float) -> None:
    """Stop the child (see :func:`_stop`), then close its pipes; shielded from cancellation."""
    with anyio.CancelScope(shield=True):
        await _stop(process, grace_period)
        await process.aclose()
