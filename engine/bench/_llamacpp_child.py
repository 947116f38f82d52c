"""Runs a benchmark workload in llama.cpp, inside the venv ``llama-cpp-python`` was built in.

This script is run by path (``PYTHON _llamacpp_child.py JOB.json RESULT.json``) with the Python
of the venv ``make bench-peers`` builds (``.venv-llamacpp``), or of any venv where
``llama-cpp-python`` is installed; twostroke need not be: it imports nothing but the standard
library, ``llama_cpp`` and ``_child_protocol`` beside it (the protocol's child half, the
command line and the result file). The parent (:mod:`twostroke.engine.bench.llamacpp_peer`)
writes the job and reads the result (:mod:`twostroke.engine.bench.child` describes the
result). The job::

    {"protocol": 1, "model_path": str, "threads": int, "seed": int, "n_ctx": int,
     "n_batch": int, "requests": [{"prompt_token_ids": [int, ...], "max_tokens": int}, ...],
     "arrival_times": [float, ...] | null,
     "prompt_lookup": {"num_pred_tokens": int, "max_ngram_size": int}}  # optional

With ``prompt_lookup``, the model decodes with the binding's prompt lookup decoding
(``llama_cpp.llama_speculative.LlamaPromptLookupDecoding`` as ``draft_model``: drafted
tokens verified in one batch, the accepted ones yielded one by one). The result holds every
request's generated tokens (``output_token_ids``), for the bench's greedy check.

The Python binding serves one sequence at a time, so requests run one after another, in
arrival order (a single-slot server). ``Llama.generate`` never stops by itself (EOS is the
completion API's business), so each request stops at its ``max_tokens``, as the other systems
do by ignoring EOS; the state is reset before each, so no request reuses another's prefix.
Start-up runs from this script's first line through loading the model and a two-token warm-up
(the first decode allocates the compute buffers).
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
    """Load the model, run the job's requests one at a time, and return the result document."""
    # Installed in the child's venv only, so the type checker of twostroke's venv cannot see it.
    import llama_cpp  # type: ignore[import-not-found, unused-ignore]

    requests = job["requests"]
    arrivals = protocol.arrivals(job)
    options: dict[str, Any] = {}
    lookup = job.get("prompt_lookup")
    if lookup is not None:
        from llama_cpp.llama_speculative import (  # type: ignore[import-not-found, unused-ignore]
            LlamaPromptLookupDecoding,
        )

        options["draft_model"] = LlamaPromptLookupDecoding(
            max_ngram_size=lookup["max_ngram_size"], num_pred_tokens=lookup["num_pred_tokens"]
        )
    # The binding evaluates a step's drafts into a context-sized buffer of ids before it
    # checks them: drafts near the end of the longest request overflowed it ("could not
    # broadcast input array from shape (6,) into shape (5,)"), so the context has room for a
    # draft more; and it verifies them against the logits of every position, which it keeps
    # only with logits_all.
    headroom = 0 if lookup is None else lookup["num_pred_tokens"] + 1
    if lookup is not None:
        options["logits_all"] = True
    llm = llama_cpp.Llama(
        model_path=job["model_path"],
        n_ctx=job["n_ctx"] + headroom,
        n_batch=job["n_batch"],
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        seed=job["seed"],
        verbose=False,
        **options,
    )
    _generate(llm, requests[0]["prompt_token_ids"][:8], 2, time.perf_counter())
    startup = protocol.startup_seconds()

    timings = []
    outputs = []
    origin = time.perf_counter()
    for index, request in enumerate(requests):
        idle = arrivals[index] - (time.perf_counter() - origin)
        if idle > 0:
            time.sleep(idle)
        chunks, tokens = _generate(llm, request["prompt_token_ids"], request["max_tokens"], origin)
        outputs.append(tokens)
        timings.append(protocol.timing(len(request["prompt_token_ids"]), arrivals[index], chunks))
    wall = time.perf_counter() - origin
    llm.close()
    return {
        "startup_seconds": startup,
        "wall_seconds": wall,
        "timings": timings,
        "output_token_ids": outputs,
        "extra": {
            "llama-cpp-python": getattr(llama_cpp, "__version__", "unknown"),
            # The CPU features the build uses (AVX2 = 1, ...) and its threading (OPENMP = 1).
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        },
    }


def _generate(
    llm: Any, prompt: list[int], max_tokens: int, origin: float
) -> tuple[list[float], list[int]]:
    """Generate ``max_tokens`` greedy tokens after ``prompt``: when each was sampled, and
    the tokens."""
    llm.reset()
    times: list[float] = []
    tokens: list[int] = []
    for token in llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter() - origin)
        tokens.append(int(token))
        if len(times) == max_tokens:
            break
    return times, tokens


if __name__ == "__main__":
    sys.exit(protocol.main(sys.argv, run_job, PROTOCOL))
