"""The in-process Hugging Face peers: ``generate`` with static batching, and continuous batching.

Both load the dense model of :func:`~twostroke.engine.bench.model.load_hf_model` (the GGUF
dequantized to the run's dtype, as twostroke computes with it), pin torch to the run's thread
count for the duration of the run, generate greedily and ignore EOS, so every system does the
same work. Loading and a short warm-up count as start-up, not as serving time.

Token times: static batching records the time of every decode step through a ``generate``
streamer (the time a streaming client would see each token); continuous batching uses the
manager's per-token timestamps.
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import inspect
import time
from collections.abc import Sequence
from typing import Any

from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec, load_hf_model, save_hf_dir
from twostroke.engine.bench.workload import BenchRequest, Workload
from twostroke.states.validators import is_int

__all__ = ["HFContinuousDriver", "HFStaticDriver"]

#: Why transformers' generation runs no structured workload.
NO_SCHEMAS = (
    "transformers' generate has no JSON-schema or tool-call constraint (it needs an outside "
    "logits processor)"
)


def _missing_hf_packages() -> str | None:
    missing = [
        name
        for name in ("torch", "transformers", "accelerate")
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        return (
            f"{', '.join(missing)} not installed (install the bench extra: "
            "pip install 'twostroke[bench]')"
        )
    return None


def _versions() -> dict[str, str]:
    return {
        name: importlib.metadata.version(name) for name in ("torch", "transformers", "accelerate")
    }


class _TokenClock:
    """A ``generate`` streamer that records when each decode step's tokens exist.

    ``generate`` calls ``put`` once with the prompt, then once per step with that step's
    tokens (already on the host, so the step is complete).
    """

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        del value
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.origin)

    def end(self) -> None:
        """Nothing to flush."""


def _left_pad(batch: Sequence[BenchRequest], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        length = len(request.prompt_token_ids)
        ids[row, width - length :] = torch.tensor(request.prompt_token_ids, dtype=torch.long)
        mask[row, width - length :] = 1
    return ids, mask


def _pad_id(model: Any) -> int:
    config = model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


class HFStaticDriver:
    """Hugging Face ``generate`` over fixed batches of up to ``batch_size`` requests.

    Requests are batched in workload order and left-padded; a batch generates until its
    longest request is done (``min_new_tokens = max_new_tokens``, so EOS never ends one
    early) and the next batch starts only then. Tokens a request generates beyond its own
    ``max_tokens`` are the price of static batching and are not counted.

    Offline workloads only: ``generate`` takes no new requests while it runs.
    """

    def __init__(self, *, batch_size: int = 32, name: str = "hf-static") -> None:
        """Args:
        batch_size: Most requests per ``generate`` call (``--hf-batch``), >= 1.
        name: The system's name in reports.

        Raises:
            ValueError: ``batch_size`` < 1.
        """
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.name = name
        self.batch_size = batch_size

    def check(self) -> str | None:
        """``None`` if torch, transformers and accelerate are installed, else what is missing."""
        return _missing_hf_packages()

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Generate every request of an offline workload, batch after batch.

        Returns:
            The timings, or an unavailable result for a serving workload or one with JSON
            schemas.
        """
        if not workload.is_offline:
            return SystemResult.unavailable(
                self.name, "static batching runs offline workloads only (generate is a batch call)"
            )
        if workload.num_constrained:
            return SystemResult.unavailable(self.name, NO_SCHEMAS)
        import torch

        from twostroke.gpu.threads import torch_threads

        with torch_threads(model.threads), torch.inference_mode():
            started = time.perf_counter()
            hf_model = load_hf_model(model)
            pad_id = _pad_id(hf_model)
            warm = BenchRequest(
                prompt_token_ids=workload.requests[0].prompt_token_ids[:8], max_tokens=2
            )
            self._generate(hf_model, [warm], pad_id, _TokenClock(time.perf_counter()))
            startup = time.perf_counter() - started
            save_hf_dir(model, hf_model)

            timings: list[RequestTiming] = []
            origin = time.perf_counter()
            for first in range(0, len(workload.requests), self.batch_size):
                batch = workload.requests[first : first + self.batch_size]
                clock = _TokenClock(origin)
                self._generate(hf_model, batch, pad_id, clock)
                for request in batch:
                    chunks = tuple(clock.times[: request.max_tokens])
                    timings.append(
                        RequestTiming(
                            prompt_tokens=len(request.prompt_token_ids),
                            output_tokens=len(chunks),
                            start=0.0,
                            first_token=chunks[0],
                            end=chunks[-1],
                            chunk_times=chunks,
                        )
                    )
            wall = time.perf_counter() - origin
            del hf_model
            gc.collect()
        return SystemResult(
            name=self.name,
            available=True,
            startup_seconds=startup,
            wall_seconds=wall,
            timings=tuple(timings),
            extra={
                **_versions(),
                "dtype": model.dtype,
                "threads": model.threads,
                "batch_size": self.batch_size,
                "weights": "GGUF dequantized (dense)" if model.is_gguf else "HF directory",
            },
        )

    @staticmethod
    def _generate(
        hf_model: Any, batch: Sequence[BenchRequest], pad_id: int, clock: _TokenClock
    ) -> None:
        ids, mask = _left_pad(batch, pad_id)
        longest = max(r.max_tokens for r in batch)
        hf_model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=clock,
        )
        if len(clock.times) != longest:
            raise RuntimeError(
                f"generate produced {len(clock.times)} steps, expected max_new_tokens={longest}"
            )


class HFContinuousDriver:
    """Hugging Face continuous batching (``generate_batch``'s manager), where installed.

    Drives the manager that ``model.generate_batch`` uses, directly, because ``generate_batch``
    takes one ``max_new_tokens`` for all requests and no arrival times; the manager takes
    requests one by one, each with its own length, while its thread generates. So this peer
    runs offline and serving workloads alike.
    """

    def __init__(self, *, name: str = "hf-continuous") -> None:
        """Args:
        name: The system's name in reports.
        """
        self.name = name

    def check(self) -> str | None:
        """``None`` if the installed transformers has continuous batching, else why not."""
        missing = _missing_hf_packages()
        if missing is not None:
            return missing
        from transformers import GenerationMixin

        version = importlib.metadata.version("transformers")
        if not hasattr(GenerationMixin, "generate_batch"):
            return f"transformers {version} has no continuous batching (generate_batch)"
        manager = getattr(GenerationMixin, "continuous_batching_context_manager", None)
        hints = importlib.util.find_spec("transformers.generation.continuous_batching.utils")
        if (
            manager is None
            or hints is None
            or "workload_hints" not in inspect.signature(manager).parameters
        ):
            return (
                f"transformers {version} has continuous batching without the manager API "
                "this driver uses (workload hints); upgrade transformers"
            )
        return None

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Feed the workload's requests to the manager at their arrival times.

        Returns:
            The timings, or an unavailable result for a workload with JSON schemas.

        Raises:
            RuntimeError: the manager's thread died or a request failed.
        """
        if workload.num_constrained:
            return SystemResult.unavailable(self.name, NO_SCHEMAS)
        import torch
        import transformers
        from transformers.generation.continuous_batching.utils import WorkloadHints

        from twostroke.gpu.threads import torch_threads

        generation_config: Any = transformers.GenerationConfig

        with torch_threads(model.threads), torch.inference_mode():
            started = time.perf_counter()
            hf_model = load_hf_model(model)
            load_seconds = time.perf_counter() - started
            save_hf_dir(model, hf_model)
            setup_started = time.perf_counter()
            config = generation_config(
                do_sample=False,
                eos_token_id=-1,
                max_new_tokens=max(r.max_tokens for r in workload.requests),
            )
            hints = WorkloadHints(
                max_prompt_length=max(len(r.prompt_token_ids) for r in workload.requests),
                max_generated_length=max(r.max_tokens for r in workload.requests),
                num_requests=len(workload.requests),
            )
            with hf_model.continuous_batching_context_manager(
                generation_config=config, block=True, timeout=5, workload_hints=hints
            ) as manager:
                origin = time.perf_counter()
                # Loading plus the manager's set-up; writing the copy for vLLM excluded.
                startup = load_seconds + (origin - setup_started)
                outputs = _serve(manager, workload, origin)
                wall = time.perf_counter() - origin
            del hf_model, manager
            gc.collect()
        timings = []
        for index, output in enumerate(outputs):
            request = workload.requests[index]
            stamps = tuple(t - origin for t in output.timestamps or ())
            if len(output.generated_tokens) != request.max_tokens or not stamps:
                raise RuntimeError(
                    f"request {index} generated {len(output.generated_tokens)} tokens, expected "
                    f"{request.max_tokens}"
                )
            timings.append(
                RequestTiming(
                    prompt_tokens=len(request.prompt_token_ids),
                    output_tokens=len(output.generated_tokens),
                    start=workload.arrival(index),
                    first_token=stamps[0],
                    end=stamps[-1],
                    chunk_times=stamps,
                )
            )
        return SystemResult(
            name=self.name,
            available=True,
            startup_seconds=startup,
            wall_seconds=wall,
            timings=tuple(timings),
            extra={**_versions(), "dtype": model.dtype, "threads": model.threads},
        )


def _serve(manager: Any, workload: Workload, origin: float) -> list[Any]:
    """Add each request at its arrival time and collect every finished output, in order."""
    count = len(workload.requests)
    outputs: dict[int, Any] = {}
    added = 0
    while len(outputs) < count:
        now = time.perf_counter() - origin
        while added < count and workload.arrival(added) <= now:
            request = workload.requests[added]
            manager.add_request(
                input_ids=list(request.prompt_token_ids),
                request_id=str(added),
                max_new_tokens=request.max_tokens,
                record_timestamps=True,
                eos_token_id=-1,
            )
            added += 1
        wait = workload.arrival(added) - now if added < count else 1.0
        result = manager.get_result(timeout=max(wait, 0.001))
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped before all requests")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            outputs[int(result.request_id)] = result
    return [outputs[index] for index in range(count)]
