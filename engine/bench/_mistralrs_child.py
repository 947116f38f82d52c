"""Runs a benchmark workload in mistral.rs, inside the venv ``mistralrs`` lives in.

This script is run by path (``PYTHON _mistralrs_child.py JOB.json RESULT.json``) with the Python
of the venv ``make bench-peers`` makes (``.venv-mistralrs``), or of any venv where
``mistralrs`` is installed; twostroke need not be: it imports nothing but the standard library,
``mistralrs`` and ``_child_protocol`` beside it (the protocol's child half, the command line
and the result file). The parent (:mod:`twostroke.engine.bench.mistralrs_peer`) writes the job
and reads the result (:mod:`twostroke.engine.bench.child` describes the result). The job::

    {"protocol": 1, "model_path": str, "threads": int, "max_num_seqs": int,
     "requests": [{"prompt_token_ids": [int, ...], "max_tokens": int}, ...],
     "arrival_times": [float, ...] | null}

The model runs in a ``Runner`` on the CPU, which reads a GGUF file itself: its scheduler runs
at most ``max_num_seqs`` sequences at once (``max_seqs``), its prefix cache off (the bench's
prompts share nothing unless asked to), and its KV cache unpaged (its PagedAttention runs on
CUDA and Metal only; on the CPU the ``Runner`` refuses it). The parent sets
``RAYON_NUM_THREADS`` to the job's threads. Its requests take text, not token ids: each prompt
is the text of its ids in the model's own tokenizer, under a chat template that is that text
alone (no system prompt, no roles), and the result counts the prompts whose text tokenizes to
other ids (``extra["prompts_retokenized"]``). Each request is sent in arrival order when it
has arrived, fewer than ``max_num_seqs`` run and the request sent before it has its first
token (one prompt at a time: the ``Runner`` refuses a request sent while another's prompt is
in, and fails on two prompts of one length prefilled together), greedy (temperature 0,
top-k 1) and to exactly ``max_tokens`` (``ignore_eos``), streamed from a thread of its own;
each chunk carries one token (its top log-probability gives the id) and is timed as it
arrives. The result holds every request's generated tokens (``output_token_ids``), for the
bench's greedy check. Start-up runs from this script's first line through loading the model
and a two-token warm-up request.
"""

from __future__ import annotations

import importlib.metadata
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # imported as twostroke's (its tests import every module)
    from twostroke.engine.bench import _child_protocol as protocol
else:  # run by path where twostroke is not installed: imported from this script's folder
    import _child_protocol as protocol

PROTOCOL = 1

#: The chat template the runner renders a request with: the prompt's text as it is, so that
#: the model sees the bench's prompt and nothing the GGUF's own template would add.
RAW_TEMPLATE = "{{ messages[0]['content'] }}"


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Load the model, stream the job's requests through the runner, and return the result."""
    with tempfile.TemporaryDirectory(prefix="mistralrs-") as folder:
        template = Path(folder) / "raw.jinja"
        template.write_text(RAW_TEMPLATE)
        return _run(job, template)


def _run(job: dict[str, Any], template: Path) -> dict[str, Any]:
    # Installed in the child's venv only, so the type checker of twostroke's venv cannot see it.
    import mistralrs  # type: ignore[import-not-found, unused-ignore]

    requests = job["requests"]
    arrivals = protocol.arrivals(job)
    limit = job["max_num_seqs"]
    path = Path(job["model_path"])
    runner = mistralrs.Runner(
        which=mistralrs.Which.GGUF(
            quantized_model_id=str(path.parent), quantized_filename=path.name
        ),
        max_seqs=limit,
        prefix_cache_n=0,
        jinja_explicit=str(template),
    )
    texts = [runner.detokenize_text(r["prompt_token_ids"], False) for r in requests]
    retokenized = [runner.tokenize_text(text, False, None) for text in texts]
    changed = sum(
        ids != r["prompt_token_ids"] for ids, r in zip(retokenized, requests, strict=True)
    )

    def request(text: str, max_tokens: int) -> Any:
        return mistralrs.ChatCompletionRequest(
            messages=text,
            model="default",
            max_tokens=max_tokens,
            temperature=0.0,
            top_k=1,
            stream=True,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=1,
        )

    def stream(
        text: str, max_tokens: int, tokens: list[int], times: list[float], started: threading.Event
    ) -> None:
        try:
            for chunk in runner.send_chat_completion_request(request(text, max_tokens)):
                arrived = time.perf_counter() - origin
                started.set()
                for choice in chunk.choices:
                    # One token a chunk: a chunk with text but no log-probability would be a
                    # token the result cannot name, and the parent would miss it in the count.
                    if choice.logprobs is None:
                        if choice.delta.content:
                            raise RuntimeError(f"a chunk without its token: {chunk!r}")
                        continue
                    tokens.append(int(choice.logprobs.top_logprobs[0].token))
                    times.append(arrived)
        finally:
            started.set()

    origin = time.perf_counter()
    warm = runner.detokenize_text(requests[0]["prompt_token_ids"][:8], False)
    stream(warm, 2, [], [], threading.Event())
    startup = protocol.startup_seconds()

    times: list[list[float]] = [[] for _ in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    failures: list[BaseException] = []
    # The runner's max_seqs bounds what it runs at once; the child also sends no more than
    # that many, so that the runner's queue never orders the requests instead of their
    # arrivals.
    slots = threading.BoundedSemaphore(limit)
    # And one prompt at a time: a request is sent once the one sent before it has its first
    # token. mistral.rs 0.9.5's Runner refuses a request sent while another's prompt is
    # still in ("RuntimeError: Already borrowed"), and two prompts of one length prefilled
    # in one step fail on the CPU ("input tensor is not contiguous"; both measured).
    previous = threading.Event()
    previous.set()

    def serve(index: int, started: threading.Event) -> None:
        request = requests[index]
        try:
            stream(texts[index], request["max_tokens"], outputs[index], times[index], started)
        except BaseException as error:
            failures.append(error)
        finally:
            slots.release()

    workers: list[threading.Thread] = []
    origin = time.perf_counter()
    for index in sorted(range(len(requests)), key=lambda index: arrivals[index]):
        time.sleep(max(0.0, arrivals[index] - (time.perf_counter() - origin)))
        slots.acquire()
        previous.wait()
        if failures:
            break
        previous = threading.Event()
        worker = threading.Thread(target=serve, args=(index, previous), name=f"request-{index}")
        worker.start()
        workers.append(worker)
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - origin
    if failures:
        raise failures[0]
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
            "mistralrs": importlib.metadata.version("mistralrs"),
            "scheduler": f"max_seqs={limit}, prefix cache off, KV cache unpaged, one prompt "
            "at a time",
            "prompts_retokenized": f"{changed} of {len(requests)}",
        },
    }


if __name__ == "__main__":
    sys.exit(protocol.main(sys.argv, run_job, PROTOCOL))
