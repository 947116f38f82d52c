"""Runs a benchmark workload in OpenVINO GenAI, inside the venv ``openvino-genai`` lives in.

This script is run by path (``PYTHON _openvino_child.py JOB.json RESULT.json``) with the Python
of the venv ``make bench-peers`` makes (``.venv-openvino``), or of any venv where
``openvino-genai`` is installed; twostroke need not be: it imports nothing but the standard
library, ``numpy``, ``openvino``, ``openvino_genai`` and ``_child_protocol`` beside it (the
protocol's child half, the command line and the result file). The parent
(:mod:`twostroke.engine.bench.openvino_peer`) writes the job and reads the result
(:mod:`twostroke.engine.bench.child` describes the result). The job::

    {"protocol": 1, "model_path": str, "threads": int, "max_num_seqs": int,
     "requests": [{"prompt_token_ids": [int, ...], "max_tokens": int}, ...],
     "arrival_times": [float, ...] | null}

The model runs in a ``ContinuousBatchingPipeline`` on the CPU (continuous batching over a
paged KV cache, the scheduler's defaults but ``max_num_seqs``; ``INFERENCE_NUM_THREADS`` is the
job's threads), which reads a GGUF file itself. Each request is added when it has arrived and
fewer than ``max_num_seqs`` run, as token ids, greedy (``do_sample`` off) and to exactly
``max_tokens`` (``ignore_eos``), as the other systems run; the pipeline is stepped while any
request is unfinished, and each handle's new tokens are timed as the step that made them
returns. The result holds every request's
generated tokens (``output_token_ids``), for the bench's greedy check. Start-up runs from this
script's first line through loading the model and a two-token warm-up request.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # imported as twostroke's (its tests import every module)
    from twostroke.engine.bench import _child_protocol as protocol
else:  # run by path where twostroke is not installed: imported from this script's folder
    import _child_protocol as protocol

PROTOCOL = 1


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Load the model, run the job's requests through the pipeline, and return the result."""
    # Installed in the child's venv only, so the type checker of twostroke's venv cannot see them.
    import numpy  # type: ignore[import-not-found, unused-ignore]
    import openvino  # type: ignore[import-not-found, unused-ignore]
    import openvino_genai  # type: ignore[import-not-found, unused-ignore]

    requests = job["requests"]
    arrivals = protocol.arrivals(job)
    # The scheduler's max_num_seqs does not bound the running requests where it splits and
    # fuses prompts (its default; 4 requests ran at once under max_num_seqs=1, measured), so
    # the loop below admits no more than that many at a time itself, as twostroke's does.
    limit = job["max_num_seqs"]
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.max_num_seqs = limit
    pipeline = openvino_genai.ContinuousBatchingPipeline(
        job["model_path"], scheduler, "CPU", {"INFERENCE_NUM_THREADS": job["threads"]}
    )

    def config(max_tokens: int) -> Any:
        generation = openvino_genai.GenerationConfig()
        generation.max_new_tokens = max_tokens
        generation.ignore_eos = True
        generation.do_sample = False
        return generation

    def ids(tokens: list[int]) -> Any:
        return openvino.Tensor(numpy.array([tokens], dtype=numpy.int64))

    # (Request ids are unsigned: the warm-up's is the one after the workload's.)
    warm = pipeline.add_request(len(requests), ids(requests[0]["prompt_token_ids"][:8]), config(2))
    while pipeline.has_non_finished_requests():
        pipeline.step()
    warm.read_all()
    startup = protocol.startup_seconds()

    times: list[list[float]] = [[] for _ in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    handles: dict[int, Any] = {}
    order = sorted(range(len(requests)), key=lambda index: arrivals[index])
    waiting = 0  # requests of `order` added so far
    origin = time.perf_counter()
    while waiting < len(order) or pipeline.has_non_finished_requests():
        now = time.perf_counter() - origin
        running = sum(len(times[i]) < requests[i]["max_tokens"] for i in handles)
        while waiting < len(order) and arrivals[order[waiting]] <= now and running < limit:
            running += 1
            index = order[waiting]
            request = requests[index]
            handles[index] = pipeline.add_request(
                index, ids(request["prompt_token_ids"]), config(request["max_tokens"])
            )
            waiting += 1
        if not pipeline.has_non_finished_requests():
            if waiting < len(order):  # (else the last request finished as it was read)
                time.sleep(max(0.0, arrivals[order[waiting]] - (time.perf_counter() - origin)))
            continue
        pipeline.step()
        stepped = time.perf_counter() - origin
        for index, handle in handles.items():
            if handle.can_read():
                for output in handle.read().values():  # one sequence: greedy
                    fresh = [int(token) for token in output.generated_ids]
                    outputs[index].extend(fresh)
                    times[index].extend([stepped] * len(fresh))
    wall = time.perf_counter() - origin
    timings = [
        protocol.timing(len(request["prompt_token_ids"]), arrivals[index], times[index])
        for index, request in enumerate(requests)
    ]
    return {
        "startup_seconds": startup,
        "wall_seconds": wall,
        "timings": timings,
        "output_token_ids": outputs,
        "extra": {
            "openvino-genai": openvino_genai.get_version(),
            "scheduler": " ".join(scheduler.to_string().split()),
        },
    }


if __name__ == "__main__":
    sys.exit(protocol.main(sys.argv, run_job, PROTOCOL))
