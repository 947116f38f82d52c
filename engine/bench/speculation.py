"""Speculative decoding in a bench run: each speculating system against itself without it.

A system that speculates (``twostroke-depth2-spec``, ``llama.cpp-prompt-lookup``) names, in
its result's ``extra["speculation_off"]``, the system of the same run that differs from it
only in not speculating. :func:`compare_speculation` pairs them and gives what issue 37's
targets are stated in: the TPOT and throughput ratios of the pair, the mean acceptance length
(1 + accepted / drafts, vLLM's) with the draft counts, and the **greedy check**: every
request's output tokens must be the same with speculation as without (speculation changes
how many tokens a step gives, never which). A difference is an exactness bug (or, between
two arithmetics, a near tie decided the other way) and the report says so loudly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from twostroke.engine.bench.metrics import Metrics, SystemResult
from twostroke.engine.bench.record import BenchRun

__all__ = [
    "GreedyCheck",
    "SpeculationComparison",
    "compare_speculation",
    "greedy_check",
    "mismatched",
]


@attrs.frozen
class GreedyCheck:
    """Whether a system's greedy outputs equal another's, request by request.

    Attributes:
        system: The speculating system.
        baseline: The system it is compared with (the same without speculation).
        num_requests: Requests compared.
        differing: The workload indices of the requests whose outputs differ.
        first_difference: For the first differing request: its index, the output position
            where the two differ first, and the token each system generated there (``None``
            where one output is a prefix of the other); ``None`` when none differs.
    """

    system: str
    baseline: str
    num_requests: int
    differing: tuple[int, ...]
    first_difference: tuple[int, int, int | None, int | None] | None

    @property
    def identical(self) -> bool:
        """Whether every request's outputs are the same."""
        return not self.differing

    def describe(self) -> str:
        """One line for the report."""
        if self.identical:
            return (
                f"greedy outputs identical to {self.baseline}'s "
                f"({self.num_requests} of {self.num_requests} requests)"
            )
        assert self.first_difference is not None
        request, position, token, expected = self.first_difference
        return (
            f"GREEDY OUTPUTS DIFFER from {self.baseline}'s in {len(self.differing)} of "
            f"{self.num_requests} requests (request {request} first at output token "
            f"{position}: {token} against {expected})"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "baseline": self.baseline,
            "identical": self.identical,
            "num_requests": self.num_requests,
            "differing": list(self.differing),
            "first_difference": None
            if self.first_difference is None
            else dict(
                zip(
                    ("request", "position", "token", "baseline_token"),
                    self.first_difference,
                    strict=True,
                )
            ),
        }


def greedy_check(system: SystemResult, baseline: SystemResult) -> GreedyCheck | None:
    """Compare two systems' output tokens, request by request; ``None`` where either did not
    report them."""
    ours, theirs = system.output_token_ids, baseline.output_token_ids
    if not ours or not theirs or len(ours) != len(theirs):
        return None
    pairs = zip(ours, theirs, strict=True)
    differing = tuple(index for index, (a, b) in enumerate(pairs) if a != b)
    first = None
    if differing:
        index = differing[0]
        a, b = ours[index], theirs[index]
        # The first position where they differ; where one is a prefix of the other, its end.
        unequal = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        position = next(unequal, min(len(a), len(b)))
        first = (
            index,
            position,
            a[position] if position < len(a) else None,
            b[position] if position < len(b) else None,
        )
    return GreedyCheck(
        system=system.name,
        baseline=baseline.name,
        num_requests=len(ours),
        differing=differing,
        first_difference=first,
    )


@attrs.frozen
class SpeculationComparison:
    """A speculating system against the same system without speculation, in one run.

    Attributes:
        system: The speculating system.
        baseline: The same without speculation.
        tpot_ratio: Its mean TPOT over the baseline's (below 1: faster); ``None`` where a
            system has no TPOT (one-token requests).
        throughput_ratio: Its output throughput over the baseline's (above 1: faster).
        mean_acceptance_length: 1 + accepted / drafts (``None`` where the system does not
            count them).
        drafts: Rows that verified a draft.
        draft_tokens: Drafted tokens verified.
        accepted_tokens: Drafted tokens accepted.
        greedy: The greedy check, or ``None`` where a system did not report its tokens.
    """

    system: str
    baseline: str
    tpot_ratio: float | None
    throughput_ratio: float
    mean_acceptance_length: float | None
    drafts: int | None
    draft_tokens: int | None
    accepted_tokens: int | None
    greedy: GreedyCheck | None

    @property
    def outputs_differ(self) -> bool:
        """Whether the greedy check ran and found a request whose outputs differ."""
        return self.greedy is not None and not self.greedy.identical

    def describe(self) -> str:
        """One line for the report."""
        parts = [f"{self.system} against {self.baseline}:"]
        if self.tpot_ratio is not None:
            parts.append(f"TPOT {self.tpot_ratio:.2f}x,")
        parts.append(f"throughput {self.throughput_ratio:.2f}x;")
        if self.mean_acceptance_length is not None:
            parts.append(
                f"mean acceptance length {self.mean_acceptance_length:.2f} "
                f"({self.accepted_tokens} of {self.draft_tokens} draft tokens accepted in "
                f"{self.drafts} drafts);"
            )
        parts.append(
            "greedy outputs not compared (not reported)"
            if self.greedy is None
            else self.greedy.describe()
        )
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        document = attrs.asdict(self, recurse=False)
        document["greedy"] = None if self.greedy is None else self.greedy.to_json()
        return document


def compare_speculation(
    run: BenchRun, figures: Mapping[str, Metrics]
) -> list[SpeculationComparison]:
    """Every speculating system of ``run`` that ran beside its baseline, in run order.

    Args:
        run: The run.
        figures: Its systems' metrics, by name (those that ran).
    """
    results = {result.name: result for result in run.results if result.name in figures}
    comparisons = []
    for result in results.values():
        baseline_name = result.extra.get("speculation_off")
        if baseline_name is None or baseline_name not in results:
            continue
        ours, theirs = figures[result.name], figures[baseline_name]
        tpot_ratio = (
            ours.tpot.mean / theirs.tpot.mean
            if ours.tpot is not None and theirs.tpot is not None and theirs.tpot.mean > 0
            else None
        )
        comparisons.append(
            SpeculationComparison(
                system=result.name,
                baseline=baseline_name,
                tpot_ratio=tpot_ratio,
                throughput_ratio=ours.output_throughput / theirs.output_throughput,
                mean_acceptance_length=result.extra.get("spec_decode_mean_acceptance_length"),
                drafts=result.extra.get("spec_decode_drafts"),
                draft_tokens=result.extra.get("spec_decode_draft_tokens"),
                accepted_tokens=result.extra.get("spec_decode_accepted_tokens"),
                greedy=greedy_check(result, results[baseline_name]),
            )
        )
    return comparisons


def mismatched(comparisons: Sequence[SpeculationComparison]) -> list[str]:
    """The speculating systems whose greedy outputs differ from their baselines'."""
    return [comparison.system for comparison in comparisons if comparison.outputs_differ]
