"""llama.cpp (through ``llama-cpp-python``) as a benchmark peer, when it is installed.

It reads the GGUF file directly, with its weights still 4-bit (Q4_1 for the default model):
fewer bytes per weight to stream through the cache, integer dot products, so its figures are
not the same arithmetic as the dense bf16 systems, and the report says so. The Python binding
serves one sequence at a time, so requests run one after another, in arrival order (a
single-slot server): its throughput is single-request decode speed.

``Llama.generate`` never stops by itself (EOS is the completion API's business), so the driver
ignores EOS as the other systems do by stopping at ``max_tokens``. The KV cache is reset
between requests so no request reuses another's prefix.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from typing import Any

from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import Workload

__all__ = ["LlamaCppDriver"]


class LlamaCppDriver:
    """llama.cpp on the model's GGUF file, one request at a time, greedy."""

    def __init__(self, *, name: str = "llama.cpp", batch: int = 512) -> None:
        """Args:
        name: The system's name in reports.
        batch: Prompt tokens per llama.cpp batch (``n_batch``).
        """
        self.name = name
        self.batch = batch

    def check(self) -> str | None:
        """``None`` if ``llama-cpp-python`` is installed, else how to install it."""
        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python is not installed (pip install llama-cpp-python)"
        return None

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Run each request to ``max_tokens`` in turn, waiting for arrivals when idle.

        Returns:
            The timings, or an unavailable result when the model is not a GGUF file or the
            workload has JSON schemas.
        """
        if not model.is_gguf:
            return SystemResult.unavailable(
                self.name, f"llama.cpp needs a GGUF file; {model.source} is a directory"
            )
        if workload.num_constrained:
            return SystemResult.unavailable(
                self.name, "JSON schemas are not run through llama.cpp's grammar sampler here"
            )
        from llama_cpp import Llama

        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
        started = time.perf_counter()
        llm = Llama(
            model_path=str(model.source),
            n_ctx=longest,
            n_batch=min(self.batch, longest),
            n_threads=model.threads,
            n_threads_batch=model.threads,
            seed=model.seed,
            verbose=False,
        )
        # Warm-up: the first decode allocates compute buffers.
        self._generate(llm, workload.requests[0].prompt_token_ids[:8], 2, time.perf_counter())
        startup = time.perf_counter() - started

        timings = []
        origin = time.perf_counter()
        for index, request in enumerate(workload.requests):
            arrival = workload.arrival(index)
            idle = arrival - (time.perf_counter() - origin)
            if idle > 0:
                time.sleep(idle)
            chunks = self._generate(llm, request.prompt_token_ids, request.max_tokens, origin)
            timings.append(
                RequestTiming(
                    prompt_tokens=len(request.prompt_token_ids),
                    output_tokens=len(chunks),
                    start=arrival,
                    first_token=chunks[0],
                    end=chunks[-1],
                    chunk_times=chunks,
                )
            )
        wall = time.perf_counter() - origin
        llm.close()
        return SystemResult(
            name=self.name,
            available=True,
            startup_seconds=startup,
            wall_seconds=wall,
            timings=tuple(timings),
            extra={
                "llama-cpp-python": importlib.metadata.version("llama-cpp-python"),
                "threads": model.threads,
                "weights": f"{model.source.name} as stored (quantized, not {model.dtype})",
                "batching": "none: one request at a time",
            },
        )

    @staticmethod
    def _generate(
        llm: Any, prompt: tuple[int, ...], max_tokens: int, origin: float
    ) -> tuple[float, ...]:
        llm.reset()
        times = []
        for _ in llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter() - origin)
            if len(times) == max_tokens:
                break
        return tuple(times)
