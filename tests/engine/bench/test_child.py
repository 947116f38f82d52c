"""A peer's child process owns every process it starts: when it ends, fails or is interrupted,
the run ends them all (vLLM's engine core and workers are the child's children).

The fake children below start a grandchild that would sleep for ten minutes, and say its pid;
the peers' own behaviour is tested through their drivers (test_*_peer.py)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from twostroke.engine.bench import child
from twostroke.engine.bench.child import ChildError
from twostroke.engine.bench.workload import BenchRequest, Workload

pytestmark = pytest.mark.skipif(
    not hasattr(os, "pidfd_open"), reason="waits for a grandchild through a pidfd (Linux)"
)

WORKLOAD = Workload(requests=(BenchRequest((1, 2), 1),), arrival_times=None, seed=0, description="")

# Starts a grandchild, writes "CHILD GRANDCHILD" pids to argv[1]'s folder, then runs TAIL.
PARENT_OF_A_SLEEPER = """
import os, subprocess, sys
from pathlib import Path

sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
Path(sys.argv[1]).with_name("pids").write_text(f"{os.getpid()} {sleeper.pid}")
"""


def _write_child(tmp_path: Path, tail: str) -> Path:
    script = tmp_path / "child.py"
    script.write_text(PARENT_OF_A_SLEEPER + tail)
    return script


def _run(script: Path, tmp_path: Path) -> None:
    child.run_child(
        Path(sys.executable),
        script,
        {"protocol": 1},
        folder=tmp_path / "run",
        env=child.child_environment({}),
        timeout=300,
        name="fake",
        workload=WORKLOAD,
        system="Fake",
    )


def _pids(tmp_path: Path) -> tuple[int, int]:
    pid, grandchild = (tmp_path / "run" / "pids").read_text().split()
    return int(pid), int(grandchild)


def _ended(pid: int) -> bool:
    """Whether a process that is not ours ends within half a minute (it may be a zombie until
    whoever adopted it reaps it: ended all the same)."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:  # gone and reaped
        return True
    try:
        readable, _, _ = select.select([handle], [], [], 30)
    finally:
        os.close(handle)
    return bool(readable)


@contextlib.contextmanager
def _no_sleeper_left(tmp_path: Path) -> Iterator[None]:
    """Kill the grandchild after the test, whatever it found (a failing run leaves it)."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(_pids(tmp_path)[1], signal.SIGKILL)


def test_a_child_that_fails_takes_its_children_with_it(tmp_path: Path) -> None:
    script = _write_child(tmp_path, "sys.exit(3)\n")
    with _no_sleeper_left(tmp_path):
        with pytest.raises(ChildError, match=r"^Fake exited with status 3 and no result"):
            _run(script, tmp_path)
        assert _ended(_pids(tmp_path)[1])


class Interrupted(BaseException):
    """What the test's signal handler raises in the parent: a Ctrl-C, as far as it knows."""


def test_an_interrupted_run_ends_and_reaps_the_child_and_its_children(tmp_path: Path) -> None:
    # The child interrupts its parent (this process) once its grandchild runs, then waits.
    script = _write_child(
        tmp_path, "import signal, time\nos.kill(os.getppid(), signal.SIGUSR1)\ntime.sleep(600)\n"
    )

    def interrupt(number: int, frame: FrameType | None) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    with _no_sleeper_left(tmp_path):
        try:
            with pytest.raises(Interrupted):
                _run(script, tmp_path)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        pid, grandchild = _pids(tmp_path)
        # Our own child: reaped, so there is nothing left to wait for.
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        assert _ended(grandchild)
