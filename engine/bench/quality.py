"""Quality beside speed: does each system compute the model the run names?

A fast row can be fast because it computes another model: weights re-encoded by a peer (a
Q4_1 file rounded to another 4-bit grid), activations rounded to 8 bits, or a bug. So the
bench puts, beside every system's speed, its **greedy agreement with the file's own
reference**: the first few requests of the workload (those without a JSON schema or tools,
whose outputs are plain greedy text) generated once more by twostroke with the model's
weights in float32 and transformers' exact arithmetic (``dtype="float32"``,
``quantization=None``: for a GGUF file, its blocks dequantized by the ``gguf`` package), and
each system's output tokens for the same requests compared with them, request by request.

:class:`Agreement` counts the requests whose outputs are identical and the tokens that agree
before each request's first difference. Greedy decoding amplifies a small difference at a
near tie into a different continuation, so agreement below 100 % is expected of any reduced
precision (docs/models.md measures it over 20 prompts); a system far below the others, or
diverging at the first token of most requests, computes something else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import BenchRequest, Workload
from twostroke.states.validators import int_at_least

__all__ = [
    "QUALITY_REQUESTS",
    "Agreement",
    "QualityReference",
    "agreement",
    "compared_requests",
    "reference_outputs",
]

#: Requests compared by default: a few, so the reference's own generation stays short.
QUALITY_REQUESTS = 4


@attrs.frozen
class Agreement:
    """One system's greedy outputs against the reference's, over the compared requests.

    Attributes:
        num_requests: Requests compared.
        identical: Those whose outputs equal the reference's, token for token.
        tokens_agreeing: Tokens equal to the reference's before each request's first
            difference, summed.
        tokens: The reference's tokens, summed (what ``tokens_agreeing`` is out of).
    """

    num_requests: int = attrs.field(validator=int_at_least(1))
    identical: int = attrs.field(validator=int_at_least(0))
    tokens_agreeing: int = attrs.field(validator=int_at_least(0))
    tokens: int = attrs.field(validator=int_at_least(1))

    @property
    def fraction(self) -> float:
        """The share of the reference's tokens agreed on before the first differences."""
        return self.tokens_agreeing / self.tokens

    def cell(self) -> str:
        """The table's cell: identical requests, and the share of tokens agreed on."""
        return f"{self.identical}/{self.num_requests} ({100 * self.fraction:.0f}%)"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        document = attrs.asdict(self)
        document["fraction"] = self.fraction
        return document


def _indices(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _outputs(values: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(output) for output in values)


@attrs.frozen
class QualityReference:
    """The reference's outputs for some of a run's requests.

    Attributes:
        indices: The workload indices of the requests compared.
        outputs: The reference's output tokens for each, in that order.
        description: What the reference computes, for the report.
    """

    indices: tuple[int, ...] = attrs.field(converter=_indices)
    outputs: tuple[tuple[int, ...], ...] = attrs.field(converter=_outputs)
    description: str = (
        "greedy agreement with the model's float32 weights in transformers' exact "
        "arithmetic (a GGUF file dequantized)"
    )

    def __attrs_post_init__(self) -> None:
        if len(self.indices) != len(self.outputs):
            raise ValueError(
                f"the reference needs one output per compared request: {len(self.indices)} "
                f"requests, {len(self.outputs)} outputs"
            )

    def of(self, outputs: Sequence[Sequence[int]]) -> Agreement | None:
        """A system's agreement with the reference (see :func:`agreement`)."""
        return agreement(outputs, self.outputs, self.indices)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "description": self.description,
            "requests": list(self.indices),
            "outputs": [list(output) for output in self.outputs],
        }


def compared_requests(workload: Workload, count: int) -> list[int]:
    """The workload indices of the first ``count`` requests without a JSON schema or tools
    (their outputs are the model's plain greedy text)."""
    plain = [
        index
        for index, request in enumerate(workload.requests)
        if request.json_schema is None and not request.tools
    ]
    return plain[:count]


def agreement(
    outputs: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    indices: Sequence[int],
) -> Agreement | None:
    """A system's outputs (every request's, in workload order) against the reference's
    (those of ``indices``, in that order); ``None`` where the system did not report its
    tokens or nothing is compared.

    A system's output may be shorter than the reference's (a peer that stops at EOS
    although asked to ignore it): it agrees up to where it ends and is not identical.
    """
    if not outputs or not indices or len(reference) != len(indices):
        return None
    identical = agreeing = total = 0
    for index, expected in zip(indices, reference, strict=True):
        if index >= len(outputs):
            return None
        got = outputs[index]
        same = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
            min(len(got), len(expected)),
        )
        identical += tuple(got) == tuple(expected)
        agreeing += same
        total += len(expected)
    if total == 0:
        return None
    return Agreement(len(indices), identical, agreeing, total)


def reference_outputs(
    model: ModelSpec, requests: Sequence[BenchRequest]
) -> tuple[tuple[int, ...], ...]:
    """The requests' greedy outputs (EOS ignored, ``max_tokens`` each) from the model's
    weights in float32 with transformers' exact arithmetic, on the run's threads."""
    from twostroke.engine.llm import LLM
    from twostroke.states.params import SamplingParams

    if not requests:
        return ()
    prompts = [list(request.prompt_token_ids) for request in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        for request in requests
    ]
    with LLM(
        str(model.source), dtype="float32", quantization=None, torch_threads=model.threads
    ) as llm:
        outputs = llm.generate(prompts, params, progress=False)
    return tuple(tuple(output.token_ids) for output in outputs)
