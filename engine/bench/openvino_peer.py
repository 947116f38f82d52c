"""OpenVINO GenAI as a benchmark peer, in a child process.

OpenVINO GenAI is the other CPU engine with continuous batching over a paged KV cache (and a
prefix cache, off by default): its ``ContinuousBatchingPipeline`` reads the model's GGUF file
itself, with no conversion step (it converts the weights to its own forms at load). The
bench's greedy check shows whether the row computes the same model: on SmolLM2's Q4_1 file it
re-encodes the blocks as its own int4 with an integer zero point per group, so its greedy
outputs leave the file's early (docs/performance.md). The report names the file's format
beside the row (:func:`~twostroke.engine.bench.llamacpp_peer.gguf_weights`).

``make bench-peers`` installs ``openvino-genai`` into a venv of its own (``.venv-openvino``;
``make test``'s venv never has it), and ``make bench`` passes its Python as
``--openvino-python``; without that option, the bench's own Python is used when it can import
``openvino_genai``. Either way it runs in a child process
(:mod:`~twostroke.engine.bench.child`, script ``_openvino_child.py``), apart from torch's thread
pools and OpenMP runtime (OpenVINO brings its own, TBB).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from twostroke.engine.bench import child
from twostroke.engine.bench.child import ChildError
from twostroke.engine.bench.llamacpp_peer import gguf_weights
from twostroke.engine.bench.metrics import SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import Workload
from twostroke.states.scheduler_config import SchedulingPolicy
from twostroke.states.validators import check_int_at_least

__all__ = ["CHILD_SCRIPT", "PROTOCOL", "VERSION", "OpenVinoDriver", "job_document"]

#: The script the child process runs, by path.
CHILD_SCRIPT = Path(__file__).with_name("_openvino_child.py")

#: The version of the JSON job and result documents (the child's ``PROTOCOL``).
PROTOCOL = 1

#: The ``openvino-genai`` release ``make bench-peers`` installs.
VERSION = "2026.4.1"

_SETUP_HINT = (
    "install it with `make bench-peers` (.venv-openvino), then pass "
    "--openvino-python .venv-openvino/bin/python"
)


def job_document(workload: Workload, *, model: ModelSpec, max_num_seqs: int) -> dict[str, Any]:
    """The JSON job the child runs: the workload's token ids, lengths and arrivals."""
    return {
        "protocol": PROTOCOL,
        "model_path": str(model.source),
        "threads": model.threads,
        "max_num_seqs": max_num_seqs,
        "requests": [
            {"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens}
            for r in workload.requests
        ],
        "arrival_times": None if workload.arrival_times is None else list(workload.arrival_times),
    }


class OpenVinoDriver:
    """OpenVINO GenAI's continuous batching on the model's GGUF file, greedy, in a child
    process."""

    name = "openvino-genai"

    def __init__(
        self,
        python: str | os.PathLike[str] | None = None,
        *,
        max_num_seqs: int = SchedulingPolicy().max_num_seqs,
        timeout: float = 1800.0,
        child_script: Path = CHILD_SCRIPT,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Args:
        python: The Python of a venv with ``openvino-genai`` (``--openvino-python``);
            ``None``: this one, if it can import ``openvino_genai``.
        max_num_seqs: The most requests its scheduler runs at once (the bench's
            ``--max-num-seqs``, as twostroke's).
        timeout: Seconds the child may take in all, start-up included.
        child_script: The script to run (tests substitute a fake module, not the script).
        env: Extra environment for the child (tests point ``PYTHONPATH`` at a fake
            ``openvino_genai``).

        Raises:
            TypeError, ValueError: ``max_num_seqs`` is not an int >= 1.
        """
        check_int_at_least("max_num_seqs", max_num_seqs, 1)
        self.python = None if python is None else Path(python)
        self.max_num_seqs = max_num_seqs
        self.timeout = timeout
        self.child_script = child_script
        self.env = dict(env or {})

    def check(self) -> str | None:
        """``None`` if the child's Python can import ``openvino_genai``, else why not."""
        python = child.child_python(self.python, "openvino_genai")
        if python is None:
            return (
                "openvino-genai is not installed here and no --openvino-python given; "
                + _SETUP_HINT
            )
        return child.check_python(
            python,
            "openvino_genai",
            option="--openvino-python",
            hint=_SETUP_HINT,
            env=self._environment(),
        )

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Run the workload through the child's pipeline, adding requests as they arrive.

        Returns:
            The timings, or an unavailable result when the model is not a GGUF file, the
            workload has JSON schemas, or the child failed (naming its log).

        Raises:
            ValueError: the model's GGUF file cannot be read.
        """
        if not model.is_gguf:
            return SystemResult.unavailable(
                self.name, f"OpenVINO GenAI is run on a GGUF file here; {model.source} is not one"
            )
        if workload.num_constrained:
            return SystemResult.unavailable(
                self.name, "JSON schemas and tools are not run through OpenVINO GenAI here"
            )
        python = child.child_python(self.python, "openvino_genai")
        if python is None:
            return SystemResult.unavailable(self.name, f"no --openvino-python given; {_SETUP_HINT}")
        weights = gguf_weights(model.source)
        try:
            result, elapsed = child.run_child(
                python,
                self.child_script,
                job_document(workload, model=model, max_num_seqs=self.max_num_seqs),
                folder=model.work_dir / "openvino",
                env=self._environment(),
                timeout=self.timeout,
                name=self.name,
                workload=workload,
                system="OpenVINO GenAI",
            )
        except ChildError as error:
            return SystemResult.unavailable(self.name, str(error))
        return attrs.evolve(
            result,
            extra={
                **result.extra,
                "threads": model.threads,
                "process_seconds": elapsed,
                "weight_format": weights.file_type,
                "weights": f"{weights.describe()}, converted by OpenVINO GenAI at load",
                "batching": f"continuous, up to {self.max_num_seqs} requests",
            },
        )

    def _environment(self) -> dict[str, str]:
        return child.child_environment(self.env)
