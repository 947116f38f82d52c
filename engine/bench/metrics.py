"""What a system measured, and the figures computed from it with vLLM's definitions.

A driver reports raw times only (:class:`RequestTiming` per request, in a
:class:`SystemResult`); every figure is computed here, by one function, so no two systems can
differ in how a percentile or a TPOT is defined. The definitions are those of vLLM's
``benchmark_serving``:

* output throughput = total output tokens / wall time; request throughput = requests / wall;
* TTFT = first token − arrival (so queueing counts, as a client sees it);
* TPOT = (end-to-end − TTFT) / (output tokens − 1), over requests with more than one token;
* ITL = every gap between two consecutive streamed chunks, pooled over all requests;
* E2E = last token − arrival;
* goodput = requests that meet every latency target, per second of wall time (a one-token
  request's TPOT counts as 0 there, as in vLLM);
* percentiles interpolate linearly between ranks (``numpy.percentile``'s default).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "Distribution",
    "Metrics",
    "RequestTiming",
    "SystemResult",
    "metrics",
    "percentile",
]


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(values)


@attrs.frozen
class RequestTiming:
    """When one request arrived, produced its tokens and finished.

    Times are seconds from the start of the run (the instant the workload's t = 0 maps to).

    Attributes:
        prompt_tokens: Prompt length in tokens.
        output_tokens: Tokens generated, at least one.
        start: When the request arrived (its workload arrival time).
        first_token: When its first token was delivered.
        end: When its last token was delivered.
        chunk_times: When each streamed chunk was delivered (a chunk holds one or more
            tokens); the first is ``first_token``. Empty when the system cannot stream, and
            then the request adds nothing to ITL.
    """

    prompt_tokens: int
    output_tokens: int
    start: float
    first_token: float
    end: float
    chunk_times: tuple[float, ...] = attrs.field(default=(), converter=_floats)

    def __attrs_post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        for name in ("start", "first_token", "end"):
            _finite(name, getattr(self, name))
        if not self.start <= self.first_token <= self.end:
            raise ValueError(
                "times must satisfy start <= first_token <= end, got "
                f"{self.start} <= {self.first_token} <= {self.end}"
            )
        if self.chunk_times:
            if len(self.chunk_times) > self.output_tokens:
                raise ValueError(
                    f"chunk_times must hold at most output_tokens ({self.output_tokens}) "
                    f"chunks, got {len(self.chunk_times)}"
                )
            if self.chunk_times[0] != self.first_token or self.chunk_times[-1] > self.end:
                raise ValueError(
                    "chunk_times must start at first_token and end by end, got "
                    f"{self.chunk_times[0]}..{self.chunk_times[-1]} for first_token "
                    f"{self.first_token}, end {self.end}"
                )
            if any(b < a for a, b in itertools.pairwise(self.chunk_times)):
                raise ValueError(f"chunk_times must be non-decreasing, got {self.chunk_times}")

    @property
    def ttft(self) -> float:
        """Time to first token, queueing included."""
        return self.first_token - self.start

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival to last token."""
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; ``None`` for a one-token request."""
        if self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_json` reads it back."""
        return attrs.asdict(self, recurse=False) | {"chunk_times": list(self.chunk_times)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestTiming:
        """A timing from :meth:`to_json`'s dict (also the vLLM child's result format).

        Raises:
            ValueError: a key is missing or a value breaks a rule of the class.
        """
        try:
            return cls(
                prompt_tokens=int(data["prompt_tokens"]),
                output_tokens=int(data["output_tokens"]),
                start=float(data["start"]),
                first_token=float(data["first_token"]),
                end=float(data["end"]),
                chunk_times=tuple(float(t) for t in data.get("chunk_times", ())),
            )
        except KeyError as error:
            raise ValueError(
                f"a request timing must have the key {error}, got {dict(data)}"
            ) from None


def _timings(values: Iterable[RequestTiming]) -> tuple[RequestTiming, ...]:
    return tuple(values)


def _token_ids(values: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(token) for token in tokens) for tokens in values)


@attrs.frozen
class SystemResult:
    """Everything one system reported for one workload.

    Attributes:
        name: The system ("hf-static", "vllm-cpu", ...).
        available: Whether it ran; if not, ``reason`` says why and there are no timings.
        reason: Why it did not run (missing package, no ``--vllm-python``, a crash).
        startup_seconds: Loading and warming up, before the first request could be served.
        wall_seconds: From t = 0 of the workload to the last token of the last request.
        timings: One per request, in workload order.
        extra: What a reader needs to interpret the figures: versions, dtype, threads,
            weight format, batch size.
        output_token_ids: The tokens each request generated, in workload order, where the
            system reports them (empty where it does not): what the bench's greedy check
            compares (:mod:`~twostroke.engine.bench.speculation`). Not in :meth:`to_json`.
    """

    name: str
    available: bool
    reason: str | None = None
    startup_seconds: float = 0.0
    wall_seconds: float = 0.0
    timings: tuple[RequestTiming, ...] = attrs.field(default=(), converter=_timings)
    extra: Mapping[str, Any] = attrs.field(factory=dict, eq=False)
    output_token_ids: tuple[tuple[int, ...], ...] = attrs.field(
        default=(), converter=_token_ids, eq=False, kw_only=True
    )

    def __attrs_post_init__(self) -> None:
        if self.available and self.reason is not None:
            raise ValueError(f"an available result has no reason, got {self.reason!r}")
        if not self.available and not self.reason:
            raise ValueError(f"an unavailable result must say why ({self.name})")
        if self.available and not self.timings:
            raise ValueError(f"an available result must hold timings ({self.name})")
        if self.available and not self.wall_seconds > 0:
            raise ValueError(f"wall_seconds must be > 0, got {self.wall_seconds}")
        if self.output_token_ids and len(self.output_token_ids) != len(self.timings):
            raise ValueError(
                f"output_token_ids must hold one sequence per request ({len(self.timings)}), "
                f"got {len(self.output_token_ids)}"
            )

    @classmethod
    def unavailable(
        cls, name: str, reason: str, *, extra: Mapping[str, Any] | None = None
    ) -> SystemResult:
        """A system that did not run, and why."""
        return cls(name=name, available=False, reason=reason, extra=dict(extra or {}))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, timings included."""
        return {
            "name": self.name,
            "available": self.available,
            "reason": self.reason,
            "startup_seconds": self.startup_seconds,
            "wall_seconds": self.wall_seconds,
            "extra": dict(self.extra),
            "timings": [timing.to_json() for timing in self.timings],
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, interpolating linearly between ranks (numpy's default).

    Args:
        values: At least one value, in any order.
        q: In [0, 100].

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@attrs.frozen
class Distribution:
    """Mean and tail of one latency, in seconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution | None:
        """The distribution of ``values``; ``None`` when there are none."""
        if not values:
            return None
        return cls(
            mean=math.fsum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            count=len(values),
        )


@attrs.frozen
class Metrics:
    """One system's figures for one workload.

    Attributes:
        name: The system.
        completed: Requests that finished.
        prompt_tokens: Prompt tokens over all requests.
        output_tokens: Generated tokens over all requests.
        startup_seconds: As reported by the system.
        wall_seconds: As reported by the system.
        output_throughput: Output tokens per second of wall time.
        total_throughput: Prompt plus output tokens per second.
        request_throughput: Requests per second.
        ttft: Time to first token; ``None`` without requests.
        tpot: Time per output token, one-token requests excluded; ``None`` if all had one.
        itl: Gaps between streamed chunks, pooled; ``None`` if nothing streamed.
        e2e: End-to-end latency.
        goodput: Requests per second that met every target; ``None`` without targets.
        ttft_slo: The TTFT target, seconds.
        tpot_slo: The TPOT target, seconds.
    """

    name: str
    completed: int
    prompt_tokens: int
    output_tokens: int
    startup_seconds: float
    wall_seconds: float
    output_throughput: float
    total_throughput: float
    request_throughput: float
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    goodput: float | None = None
    ttft_slo: float | None = None
    tpot_slo: float | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (latencies in seconds)."""
        return attrs.asdict(self)


def metrics(
    result: SystemResult, *, ttft_slo: float | None = None, tpot_slo: float | None = None
) -> Metrics:
    """The figures of an available system's result, with vLLM's definitions.

    Args:
        result: What the system reported; must be available.
        ttft_slo: TTFT target in seconds, or ``None`` for none.
        tpot_slo: TPOT target in seconds, or ``None`` for none.

    Returns:
        The figures; ``goodput`` is ``None`` when neither target is given.

    Raises:
        ValueError: ``result`` is unavailable, or a target is not > 0.
    """
    if not result.available:
        raise ValueError(f"{result.name} did not run ({result.reason}); it has no metrics")
    for name, slo in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
        if slo is not None and not slo > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {slo}")
    timings = result.timings
    wall = result.wall_seconds
    output_tokens = sum(t.output_tokens for t in timings)
    prompt_tokens = sum(t.prompt_tokens for t in timings)
    gaps = [b - a for t in timings for a, b in itertools.pairwise(t.chunk_times)]
    goodput = None
    if ttft_slo is not None or tpot_slo is not None:
        good = sum(
            1
            for t in timings
            if (ttft_slo is None or t.ttft <= ttft_slo)
            and (tpot_slo is None or (t.tpot or 0.0) <= tpot_slo)
        )
        goodput = good / wall
    return Metrics(
        name=result.name,
        completed=len(timings),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        startup_seconds=result.startup_seconds,
        wall_seconds=wall,
        output_throughput=output_tokens / wall,
        total_throughput=(prompt_tokens + output_tokens) / wall,
        request_throughput=len(timings) / wall,
        ttft=Distribution.of([t.ttft for t in timings]),
        tpot=Distribution.of([t.tpot for t in timings if t.tpot is not None]),
        itl=Distribution.of(gaps),
        e2e=Distribution.of([t.e2e for t in timings]),
        goodput=goodput,
        ttft_slo=ttft_slo,
        tpot_slo=tpot_slo,
    )
