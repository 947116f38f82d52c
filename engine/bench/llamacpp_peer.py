"""llama.cpp (through ``llama-cpp-python``) as a benchmark peer, in a child process.

llama.cpp reads the model's GGUF file itself, with its weights as stored: quantized for the
default model (Q4_1 layers, a Q8_0 embedding), so fewer bytes per weight to stream and integer
dot products, not the arithmetic of the dense systems beside it. :func:`gguf_weights` reads the
format from the file's header and tensor records, and the report shows it beside the row. The
Python binding serves one sequence at a time, so requests run one after another, in arrival
order (a single-slot server): its throughput is single-request decode speed.

``make bench-peers`` compiles ``llama-cpp-python`` for this machine's CPU into a venv of its
own (``.venv-llamacpp``; ``make test``'s venv never builds it), and ``make bench`` passes its
Python as ``--llamacpp-python``; without that option, the bench's own Python is used when it
can import ``llama_cpp``. Either way llama.cpp runs in a child process
(:mod:`~twostroke.engine.bench.child`, script ``_llamacpp_child.py``), apart from the torch
thread pools and OpenMP runtime of the systems that ran before it.

With a :class:`PromptLookup`, the binding's own speculative n-gram mode runs: prompt lookup
decoding (``llama_cpp.llama_speculative.LlamaPromptLookupDecoding`` passed as
``draft_model``, which drafts the tokens that followed the latest n-gram's earliest match in
the request's tokens and verifies them in one batch). ``twostroke bench
--speculative-config`` adds that row (``llama.cpp-prompt-lookup``) beside plain llama.cpp,
and the bench's greedy check compares their outputs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from twostroke.engine.bench import child
from twostroke.engine.bench.child import ChildError
from twostroke.engine.bench.metrics import SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import Workload
from twostroke.states.validators import int_at_least

__all__ = [
    "CHILD_SCRIPT",
    "PROTOCOL",
    "GGUFWeights",
    "LlamaCppDriver",
    "PromptLookup",
    "gguf_weights",
    "job_document",
]

#: The script the child process runs, by path.
CHILD_SCRIPT = Path(__file__).with_name("_llamacpp_child.py")

#: The version of the JSON job and result documents (the child's ``PROTOCOL``).
PROTOCOL = 1

_SETUP_HINT = (
    "build it with `make bench-peers` (.venv-llamacpp), then pass "
    "--llamacpp-python .venv-llamacpp/bin/python"
)


@attrs.frozen
class GGUFWeights:
    """The weight format of a GGUF file: what llama.cpp computes with.

    Attributes:
        file_type: The file's ``general.file_type`` without its ``MOSTLY_`` / ``ALL_`` prefix
            (``"Q4_1"``), or, when the file has none, the tensor type holding most weights.
        weights: Tensor type name to the number of weights stored in it, most first.
    """

    file_type: str
    weights: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        """Weights in the file, all types together."""
        return sum(count for _, count in self.weights)

    def describe(self) -> str:
        """``"GGUF Q4_1: Q4_1 79 %, Q8_0 21 %, F32 <1 % of 134.5 M weights"``."""
        total = self.total
        shares = ", ".join(f"{name} {_percent(count, total)}" for name, count in self.weights)
        return f"GGUF {self.file_type}: {shares} of {_count(total)} weights"


def _count(count: int) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return str(count)


def _percent(count: int, total: int) -> str:
    share = 100 * count / total
    return "<1 %" if 0 < share < 1 else f"{share:.0f} %"


def gguf_weights(path: Path) -> GGUFWeights:
    """Read a GGUF file's weight format from its header and tensor records (no tensor data).

    Raises:
        ValueError: the file is not a readable GGUF file, or it holds no tensors.
    """
    from gguf import GGML_QUANT_SIZES, LlamaFileType

    from twostroke.engine.checkpoints.gguf import read_gguf

    contents = read_gguf(path)
    counts: dict[str, int] = {}
    for tensor in contents.tensors.values():
        block, size = GGML_QUANT_SIZES[tensor.tensor_type]
        # The data is the tensor's bytes: blocks of ``size`` bytes, ``block`` weights each.
        counts[tensor.tensor_type.name] = (
            counts.get(tensor.tensor_type.name, 0) + tensor.data.nbytes // size * block
        )
    if not counts:
        raise ValueError(f"{path} holds no tensors")
    weights = tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))
    # Absent, or a type this gguf package does not know: the type holding the most weights.
    known = {member.value: member.name for member in LlamaFileType}
    raw = contents.metadata.get("general.file_type")
    file_type = (
        known[raw].removeprefix("MOSTLY_").removeprefix("ALL_") if raw in known else weights[0][0]
    )
    return GGUFWeights(file_type=file_type, weights=weights)


@attrs.frozen
class PromptLookup:
    """llama-cpp-python's prompt lookup decoding, with its own parameter names.

    Attributes:
        num_pred_tokens: Tokens drafted at a match (``num_speculative_tokens``).
        max_ngram_size: The longest n-gram matched; it tries every size down to 1
            (``prompt_lookup_max``; the binding has no minimum).
    """

    num_pred_tokens: int = attrs.field(default=10, validator=int_at_least(1))
    max_ngram_size: int = attrs.field(default=2, validator=int_at_least(1))

    def describe(self) -> str:
        """``"LlamaPromptLookupDecoding(max_ngram_size=5, num_pred_tokens=5)"``."""
        return (
            f"LlamaPromptLookupDecoding(max_ngram_size={self.max_ngram_size}, "
            f"num_pred_tokens={self.num_pred_tokens})"
        )


def job_document(
    workload: Workload, *, model: ModelSpec, batch: int, prompt_lookup: PromptLookup | None = None
) -> dict[str, Any]:
    """The JSON job the child runs: the workload's token ids, lengths and arrivals.

    The context holds the longest request whole, and a prompt is evaluated ``batch`` tokens at
    a time (no more than the context). With ``prompt_lookup``, the job says how to draft.
    """
    requests = workload.requests
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    return {
        "protocol": PROTOCOL,
        "model_path": str(model.source),
        "threads": model.threads,
        "seed": model.seed,
        "n_ctx": longest,
        "n_batch": min(batch, longest),
        "requests": [
            {"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens}
            for r in requests
        ],
        "arrival_times": None if workload.arrival_times is None else list(workload.arrival_times),
    } | ({} if prompt_lookup is None else {"prompt_lookup": attrs.asdict(prompt_lookup)})


class LlamaCppDriver:
    """llama.cpp on the model's GGUF file, one request at a time, greedy, in a child process."""

    def __init__(
        self,
        python: str | os.PathLike[str] | None = None,
        *,
        name: str | None = None,
        prompt_lookup: PromptLookup | None = None,
        batch: int = 512,
        timeout: float = 1800.0,
        child_script: Path = CHILD_SCRIPT,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Args:
        python: The Python of a venv with ``llama-cpp-python`` (``--llamacpp-python``);
            ``None``: this one, if it can import ``llama_cpp``.
        name: The system's name in reports (default ``llama.cpp``, or with
            ``prompt_lookup`` ``llama.cpp-prompt-lookup``).
        prompt_lookup: Decode with the binding's prompt lookup decoding (``None``: plain
            decoding).
        batch: Prompt tokens per llama.cpp batch (``n_batch``).
        timeout: Seconds the child may take in all, start-up included.
        child_script: The script to run (tests substitute a fake).
        env: Extra environment for the child (tests point ``PYTHONPATH`` at a fake llama_cpp).
        """
        self.name = name or ("llama.cpp" if prompt_lookup is None else "llama.cpp-prompt-lookup")
        self.prompt_lookup = prompt_lookup
        self.python = None if python is None else Path(python)
        self.batch = batch
        self.timeout = timeout
        self.child_script = child_script
        self.env = dict(env or {})

    def check(self) -> str | None:
        """``None`` if the child's Python can import ``llama_cpp``, else why not."""
        python = child.child_python(self.python, "llama_cpp")
        if python is None:
            return (
                "llama-cpp-python is not installed here and no --llamacpp-python given; "
                + _SETUP_HINT
            )
        return child.check_python(
            python,
            "llama_cpp",
            option="--llamacpp-python",
            hint=_SETUP_HINT,
            env=self._environment(),
        )

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Run each request to ``max_tokens`` in turn in the child, waiting for arrivals.

        Returns:
            The timings, or an unavailable result when the model is not a GGUF file, the
            workload has JSON schemas, or the child failed (naming its log).

        Raises:
            ValueError: the model's GGUF file cannot be read.
        """
        if not model.is_gguf:
            return SystemResult.unavailable(
                self.name, f"llama.cpp needs a GGUF file; {model.source} is a directory"
            )
        if workload.num_constrained:
            return SystemResult.unavailable(
                self.name,
                "JSON schemas and tools are not run through llama.cpp's grammar sampler here",
            )
        python = child.child_python(self.python, "llama_cpp")
        if python is None:
            return SystemResult.unavailable(self.name, f"no --llamacpp-python given; {_SETUP_HINT}")
        weights = gguf_weights(model.source)
        try:
            result, elapsed = child.run_child(
                python,
                self.child_script,
                job_document(
                    workload, model=model, batch=self.batch, prompt_lookup=self.prompt_lookup
                ),
                folder=model.work_dir
                / ("llamacpp" if self.prompt_lookup is None else "llamacpp-prompt-lookup"),
                env=self._environment(),
                timeout=self.timeout,
                name=self.name,
                workload=workload,
                system="llama.cpp",
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
                "weights": f"{weights.describe()}, computed as stored",
                "batching": "none: one request at a time",
                **self._speculation(),
            },
        )

    def _speculation(self) -> dict[str, Any]:
        """For prompt lookup: how it drafts, and the row its greedy outputs must equal (the
        binding counts no drafts, so the row has no acceptance length)."""
        if self.prompt_lookup is None:
            return {}
        return {"speculation_off": "llama.cpp", "prompt_lookup": self.prompt_lookup.describe()}

    def _environment(self) -> dict[str, str]:
        return child.child_environment(self.env)
