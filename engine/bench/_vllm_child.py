"""Runs a benchmark workload in vLLM, inside vLLM's own virtual environment.

This script is run by path (``PYTHON _vllm_child.py JOB.json RESULT.json``) with the Python of
the venv ``make bench-peers`` sets up, where twostroke is not installed: it imports nothing but
the standard library, vLLM and ``_child_protocol`` beside it (the protocol's child half, the
command line and the result file). The parent (:mod:`twostroke.engine.bench.vllm_peer`) writes
the job and reads the result; the protocol is plain JSON, versioned by ``"protocol"``:

job::

    {"protocol": 2, "model_dir": str, "dtype": str, "seed": int, "max_model_len": int,
     "requests": [{"prompt_token_ids": [int, ...], "max_tokens": int,
                   "json_schema": str | null}, ...],
     "arrival_times": [float, ...] | null, "engine_args": {str: value}}

result (exit status 0)::

    {"protocol": 2, "startup_seconds": float, "wall_seconds": float,
     "timings": [{"prompt_tokens", "output_tokens", "start", "first_token", "end",
                  "chunk_times": [float, ...]}, ...],
     "extra": {"vllm": version, "torch": version, ...}}

or, when anything fails (exit status 1): ``{"protocol": 2, "error": "Type: message"}``.

A request with a ``json_schema`` samples under it through vLLM's structured outputs (its
default backend), as ``SamplingParams(structured_outputs=...)`` from vLLM 0.10.2 on and
``guided_decoding=`` before.

Why ``LLMEngine.step()`` and not ``LLM.generate``: ``generate`` returns when every request is
done, so it shows neither first tokens nor arrivals. Stepping the engine by hand delivers every
request's new tokens after each step (streaming, as its server does) and lets requests join at
their arrival times, so vLLM runs serving workloads as well as offline ones.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # imported as twostroke's (its tests import every module)
    from twostroke.engine.bench import _child_protocol as protocol
else:  # run by path where twostroke is not installed: imported from this script's folder
    import _child_protocol as protocol

PROTOCOL = 2


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Start vLLM, run the job's requests, and return the result document."""
    # Installed in the vLLM venv only, so the type checker of twostroke's venv cannot see it.
    import vllm  # type: ignore[import-not-found, unused-ignore]
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found, unused-ignore]
    from vllm.sampling_params import (  # type: ignore[import-not-found, unused-ignore]
        RequestOutputKind,
    )

    requests = job["requests"]
    arrivals = protocol.arrivals(job)
    llm = LLM(
        model=job["model_dir"],
        dtype=job["dtype"],
        seed=job["seed"],
        max_model_len=job["max_model_len"],
        **job.get("engine_args", {}),
    )
    engine = llm.llm_engine
    startup = protocol.startup_seconds()

    count = len(requests)
    chunks: list[list[float]] = [[] for _ in range(count)]
    tokens = [0] * count
    ends: list[float | None] = [None] * count
    added = 0
    finished = 0
    origin = time.perf_counter()
    while finished < count:
        now = time.perf_counter() - origin
        while added < count and arrivals[added] <= now:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=requests[added]["max_tokens"],
                ignore_eos=True,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
                **_constraint(requests[added].get("json_schema")),
            )
            engine.add_request(
                str(added), {"prompt_token_ids": requests[added]["prompt_token_ids"]}, params
            )
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[added] - now))
            continue
        outputs = engine.step()
        at = time.perf_counter() - origin
        for output in outputs:
            index = int(output.request_id)
            new = len(output.outputs[0].token_ids)
            if new:
                chunks[index].append(at)
                tokens[index] += new
            if output.finished:
                ends[index] = at
                finished += 1
    wall = time.perf_counter() - origin

    timings = []
    for index, request in enumerate(requests):
        end = ends[index]
        if not chunks[index] or end is None:
            raise RuntimeError(f"request {index} finished without tokens")
        timings.append(
            protocol.timing(
                len(request["prompt_token_ids"]), arrivals[index], chunks[index], tokens[index]
            )
        )
    return {
        "startup_seconds": startup,
        "wall_seconds": wall,
        "timings": timings,
        "extra": {
            "vllm": getattr(vllm, "__version__", "unknown"),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "dtype": job["dtype"],
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        },
    }


def _constraint(schema: str | None) -> dict[str, Any]:
    """The ``SamplingParams`` keyword of a JSON-schema constraint in this vLLM (none: ``{}``)."""
    if schema is None:
        return {}
    parsed = json.loads(schema)
    try:
        from vllm.sampling_params import (  # type: ignore[import-not-found, unused-ignore]
            StructuredOutputsParams,
        )
    except ImportError:  # vLLM before 0.10.2
        from vllm.sampling_params import (  # type: ignore[import-not-found, unused-ignore]
            GuidedDecodingParams,
        )

        return {"guided_decoding": GuidedDecodingParams(json=parsed)}
    return {"structured_outputs": StructuredOutputsParams(json=parsed)}


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


# vLLM starts worker processes; without this guard each would rerun the benchmark.
if __name__ == "__main__":
    sys.exit(protocol.main(sys.argv, run_job, PROTOCOL))
