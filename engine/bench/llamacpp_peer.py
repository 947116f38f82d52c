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

import abc
from pathlib import Path
from typing import Any, ClassVar

import attrs

from twostroke.engine.bench.child import ChildPeer
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import Workload
from twostroke.states.scheduler_config import SchedulingPolicy
from twostroke.states.validators import int_at_least

__all__ = [
    "BATCHED_PROTOCOL",
    "CHILD_SCRIPT",
    "PROTOCOL",
    "BatchedGGUFPeer",
    "GGUFPeer",
    "GGUFWeights",
    "LlamaCppDriver",
    "PromptLookup",
    "batched_job_document",
    "gguf_weights",
    "job_document",
]

#: The script the child process runs, by path.
CHILD_SCRIPT = Path(__file__).with_name("_llamacpp_child.py")

#: The version of the JSON job and result documents (the child's ``PROTOCOL``).
PROTOCOL = 1


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


@attrs.define(eq=False, kw_only=True)
class GGUFPeer(ChildPeer):
    """A child peer that reads the model's GGUF file itself and samples without a grammar
    here (llama.cpp, OpenVINO GenAI): the report names the file's weight format beside its
    row (:func:`gguf_weights`), and how the peer computes with them and batches."""

    #: Why it does not run a model that is not a GGUF file (``{source}``: the model's).
    not_gguf: ClassVar[str]
    #: Why it does not run a workload with JSON schemas or tools.
    not_constrained: ClassVar[str]
    #: What it does with the file's weights (``"computed as stored"``).
    weights_note: ClassVar[str]

    def refusal(self, workload: Workload, model: ModelSpec) -> str | None:
        """A model that is not a GGUF file; JSON schemas and tools."""
        if not model.is_gguf:
            return self.not_gguf.format(source=model.source)
        if workload.num_constrained:
            return self.not_constrained
        return None

    def own_extra(self, model: ModelSpec) -> dict[str, Any]:
        """The GGUF file's weight format, what the peer does with it, and its batching.

        Raises:
            ValueError: the model's GGUF file cannot be read.
        """
        weights = gguf_weights(model.source)
        return {
            "weight_format": weights.file_type,
            "weights": f"{weights.describe()}, {self.weights_note}",
            "batching": self.batching(),
        }

    @abc.abstractmethod
    def batching(self) -> str:
        """How it batches requests, for the report (``"none: one request at a time"``)."""


#: The version of the job and result documents of the batched GGUF peers' children
#: (:class:`BatchedGGUFPeer`; each child's ``PROTOCOL``).
BATCHED_PROTOCOL = 1


def batched_job_document(
    workload: Workload, *, model: ModelSpec, max_num_seqs: int
) -> dict[str, Any]:
    """The JSON job a :class:`BatchedGGUFPeer`'s child runs: the workload's token ids,
    lengths and arrivals, and the most requests it runs at once."""
    arrivals = workload.arrival_times
    return {
        "protocol": BATCHED_PROTOCOL,
        "model_path": str(model.source),
        "threads": model.threads,
        "max_num_seqs": max_num_seqs,
        "requests": [
            {"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens}
            for r in workload.requests
        ],
        "arrival_times": None if arrivals is None else list(arrivals),
    }


@attrs.define(eq=False, kw_only=True)
class BatchedGGUFPeer(GGUFPeer):
    """A GGUF peer whose own scheduler batches at most ``max_num_seqs`` requests at once
    (OpenVINO GenAI, mistral.rs): its child takes :func:`batched_job_document`'s job and
    works in :attr:`work_folder` of the run's folder.

    Attributes:
        max_num_seqs: The most requests its scheduler runs at once (the bench's
            ``--max-num-seqs``, as twostroke's): an int >= 1, else ``TypeError`` or
            ``ValueError``.
    """

    #: Its folder inside the run's folder.
    work_folder: ClassVar[str]

    max_num_seqs: int = attrs.field(
        default=SchedulingPolicy().max_num_seqs, validator=int_at_least(1)
    )

    def job(self, workload: Workload, model: ModelSpec) -> dict[str, Any]:
        """:func:`batched_job_document` with this driver's ``max_num_seqs``."""
        return batched_job_document(workload, model=model, max_num_seqs=self.max_num_seqs)

    def folder(self, model: ModelSpec) -> Path:
        """:attr:`work_folder` in the run's folder."""
        return model.work_dir / self.work_folder

    def batching(self) -> str:
        """Continuous, up to ``max_num_seqs`` requests at once."""
        return f"continuous, up to {self.max_num_seqs} requests"


def _default_name(driver: LlamaCppDriver) -> str:
    return "llama.cpp" if driver.prompt_lookup is None else "llama.cpp-prompt-lookup"


@attrs.define(eq=False, kw_only=True)
class LlamaCppDriver(GGUFPeer):
    """llama.cpp on the model's GGUF file, one request at a time, greedy, in a child process.

    Attributes:
        python: The Python of a venv with ``llama-cpp-python`` (``--llamacpp-python``);
            ``None``: this one, if it can import ``llama_cpp``.
        prompt_lookup: Decode with the binding's prompt lookup decoding (``None``: plain
            decoding).
        name: The system's name in reports (default ``llama.cpp``, or with
            ``prompt_lookup`` ``llama.cpp-prompt-lookup``).
        batch: Prompt tokens per llama.cpp batch (``n_batch``).
        timeout, child_script, env: As :class:`~twostroke.engine.bench.child.ChildPeer`'s.
    """

    system = "llama.cpp"
    module = "llama_cpp"
    option = "--llamacpp-python"
    setup_hint = (
        "build it with `make bench-peers` (.venv-llamacpp), then pass "
        "--llamacpp-python .venv-llamacpp/bin/python"
    )
    script = CHILD_SCRIPT
    installed_as = "llama-cpp-python"
    not_gguf = "llama.cpp needs a GGUF file; {source} is a directory"
    not_constrained = "JSON schemas and tools are not run through llama.cpp's grammar sampler here"
    weights_note = "computed as stored"

    prompt_lookup: PromptLookup | None = None
    name: str = attrs.field(default=attrs.Factory(_default_name, takes_self=True))
    batch: int = 512

    def job(self, workload: Workload, model: ModelSpec) -> dict[str, Any]:
        """:func:`job_document` with this driver's batch and prompt lookup."""
        return job_document(
            workload, model=model, batch=self.batch, prompt_lookup=self.prompt_lookup
        )

    def folder(self, model: ModelSpec) -> Path:
        """``llamacpp`` (or ``llamacpp-prompt-lookup``) in the run's folder."""
        return model.work_dir / (
            "llamacpp" if self.prompt_lookup is None else "llamacpp-prompt-lookup"
        )

    def batching(self) -> str:
        """None: the binding serves one sequence at a time."""
        return "none: one request at a time"

    def own_extra(self, model: ModelSpec) -> dict[str, Any]:
        """:class:`GGUFPeer`'s; for prompt lookup also how it drafts, and the row its greedy
        outputs must equal (the binding counts no drafts, so the row has no acceptance
        length).

        Raises:
            ValueError: the model's GGUF file cannot be read.
        """
        extra = super().own_extra(model)
        if self.prompt_lookup is not None:
            extra["speculation_off"] = "llama.cpp"
            extra["prompt_lookup"] = self.prompt_lookup.describe()
        return extra
