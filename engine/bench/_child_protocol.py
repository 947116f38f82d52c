"""The child's half of a peer's protocol, shared by the peers' child scripts.

A peer's script (``_vllm_child.py``, ``_llamacpp_child.py``, ``_openvino_child.py``) runs by
path with its own venv's Python, where twostroke is not installed, so this module imports
nothing but the standard library, and the scripts import it from their own folder (the first
entry of ``sys.path`` for a script run by path), or from twostroke where they are imported as
its modules (``__package__`` set: the type checker, the tests that import every module)::

    if TYPE_CHECKING or __package__:
        from twostroke.engine.bench import _child_protocol as protocol
    else:
        import _child_protocol as protocol

The parent's half, and the result document, are :mod:`twostroke.engine.bench.child`'s.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["arrivals", "main", "startup_seconds", "timing"]

# The scripts import this module before anything of their peer's: their start.
_STARTED = time.perf_counter()


def startup_seconds() -> float:
    """Seconds since the script started (its import of this module): the result's start-up."""
    return time.perf_counter() - _STARTED


def arrivals(job: dict[str, Any]) -> list[float]:
    """Each request's arrival, in seconds from the start (all 0 for an offline job)."""
    return list(job.get("arrival_times") or [0.0] * len(job["requests"]))


def timing(
    prompt_tokens: int,
    start: float,
    chunk_times: Sequence[float],
    output_tokens: int | None = None,
) -> dict[str, Any]:
    """One request's timings, as the result document holds them.

    Args:
        prompt_tokens: The prompt's length.
        start: When the request arrived.
        chunk_times: When each chunk of new tokens came (first token and end: its first and
            last; ``start`` for a request that generated nothing, which the parent refuses).
        output_tokens: Tokens generated (default: one a chunk).
    """
    return {
        "prompt_tokens": prompt_tokens,
        "output_tokens": len(chunk_times) if output_tokens is None else output_tokens,
        "start": start,
        "first_token": chunk_times[0] if chunk_times else start,
        "end": chunk_times[-1] if chunk_times else start,
        "chunk_times": list(chunk_times),
    }


def main(
    argv: Sequence[str], run_job: Callable[[dict[str, Any]], dict[str, Any]], protocol: int
) -> int:
    """``SCRIPT JOB.json RESULT.json``: run the job and write its result, versioned.

    Args:
        argv: The script's ``sys.argv``.
        run_job: The peer's own part: the job in, the result document out (without its
            ``"protocol"``, which this adds).
        protocol: The version the script speaks; a job of another is refused.

    Returns:
        The exit status: 0 with a result, 1 with an error document (the traceback goes to
        stderr, the parent's log of the child), 2 for a wrong command line.
    """
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json RESULT.json", file=sys.stderr)
        return 2
    try:
        with open(argv[1]) as file:
            job = json.load(file)
        if job.get("protocol") != protocol:
            raise ValueError(f"job protocol must be {protocol}, got {job.get('protocol')!r}")
        result = run_job(job)
    except Exception as error:
        traceback.print_exc()
        _write(argv[2], {"protocol": protocol, "error": f"{type(error).__name__}: {error}"})
        return 1
    _write(argv[2], {"protocol": protocol, **result})
    return 0


def _write(path: str, document: dict[str, Any]) -> None:
    """Write atomically, so the parent never reads half a result."""
    partial = path + ".partial"
    with open(partial, "w") as file:
        json.dump(document, file)
    os.replace(partial, path)
