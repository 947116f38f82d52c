"""Benchmark workloads: which prompts, how many tokens each, and when each request arrives.

A workload is data, fixed by its seed, so every system in a run (and every run with the same
seed) gets the same token ids and the same lengths. Prompts are windows of real English text
encoded by the model's own tokenizer, not random ids: attention over real text has the shape a
user's prompt has, and random ids can hit tokens a model never saw in training. The text is
built in, so making a workload needs no network and no data set.

Two shapes, after vLLM's benchmarks: **offline** (every request submitted at t = 0; the figure
is throughput) and **serving** (requests arrive over time, gaps drawn from a gamma
distribution; the figures are latencies at a given load). Either may carry **structured
output**: :func:`with_json_schemas` gives a fraction of its requests a JSON schema their
output must follow (:func:`~twostroke.engine.bench.schemas.bench_schema`), for the cost of
the token masks; :func:`with_tools` has a fraction of them offer tools with ``tool_choice``
``"auto"`` (:data:`~twostroke.engine.bench.schemas.BENCH_TOOLS`: text until the format's
trigger, then calls), for the cost of the lazy constraint on answers that are mostly text.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Sequence

import attrs

from twostroke.engine.bench.schemas import bench_schema
from twostroke.states.validators import boolean, check_int_at_least, int_at_least, is_int

__all__ = [
    "CORPUS",
    "BenchRequest",
    "Workload",
    "offline_workload",
    "serving_workload",
    "with_json_schemas",
    "with_tools",
    "without_json_schemas",
    "without_tools",
]

#: English prose the prompt windows are cut from (written for this project, no licence).
CORPUS = """\
The first engines that moved a vehicle on a road were loud, heavy and wasteful, and the people
who built them spent most of their lives making them a little less so. A two-stroke engine does
in one turn of the crankshaft what a four-stroke engine does in two: as the piston rises it
compresses the charge above it and draws a fresh one into the crankcase below; as it falls, the
burning charge drives it down, the exhaust port opens, and the fresh charge rushes in to sweep
the cylinder clean. Nothing waits. Every downward stroke is a power stroke, which is why small
motorcycles, chainsaws and outboard motors used the design for a century.

Engineers who measure such machines learn early that a single number hides more than it shows.
Peak power says nothing about how the engine pulls at low speed, and fuel consumption measured
on a test bench says little about a delivery van that stops at every second house. So they
measure curves rather than points, run the same cycle on every engine they compare, and write
down the temperature, the fuel and the altitude, because a result that cannot be repeated is
only a story.

The same habits serve anyone who measures software. A benchmark should state what was run, on
which machine, with which versions, and how many times. It should give the same work to every
system it compares, and it should report the slow requests as well as the average ones, since
the user who waited ten seconds does not care that the mean was fast. When a system cannot run
a test, the report should say so and say why, instead of leaving an empty line that a reader
might mistake for a zero.

Libraries keep their old books in rooms where the air is dry and cool. A librarian once
explained that paper made before the middle of the nineteenth century often lasts longer than
paper made after it, because the older sheets were made from rags, while the newer ones were
made from wood pulp treated with acid that slowly eats the fibres. Some of the cheapest novels
of that era now crumble when their pages are turned, while a parish register three hundred
years older can still be read by candlelight.

In the mountains the weather changes faster than the forecast. Walkers are told to turn back at
a fixed hour whatever the view ahead promises, to carry more water than they think they need,
and to tell someone where they are going. Most accidents happen on the way down, when people are
tired, the light is going, and the path that looked obvious in the morning has turned into a
field of identical stones. A compass and a paper map weigh little and never run out of battery.

A good kitchen runs on preparation. Before service begins every cook has cut, measured and
arranged what the evening will need, so that when the orders arrive the work is assembly rather
than invention. The head chef calls the orders, the cooks answer, and each plate leaves the pass
only when every part of it is ready at the same moment. It is, in its way, a scheduler: many
requests, a few shared burners, and a strict rule that nothing waiting may be forgotten.

Rivers carry more than water. They move sand and gravel from the hills to the sea, cut valleys
through rock, and build plains where they slow down and spread out. A river in flood can move
boulders the size of a car, and the same river in late summer may be too shallow to float a
canoe. People have settled beside rivers for as long as there have been people, for the water,
the fish, the fertile soil and the easy road they offer to anyone with a boat.
"""


def _ids(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _requests(values: Iterable[BenchRequest]) -> tuple[BenchRequest, ...]:
    return tuple(values)


@attrs.frozen
class BenchRequest:
    """One request of a workload: the prompt as token ids and how many tokens to generate.

    Every system generates exactly ``max_tokens`` tokens (EOS ignored), so the work is fixed.

    Attributes:
        prompt_token_ids: The prompt, at least one token.
        max_tokens: Tokens to generate, at least one.
        json_schema: A JSON schema (its JSON text) the output must follow, or ``None``. The
            bench's schema (:func:`~twostroke.engine.bench.schemas.bench_schema`) cannot
            complete in fewer than ``max_tokens`` tokens, so the work stays fixed under it.
        tools: The request offers the bench's tools with ``tool_choice`` ``"auto"`` (with
            a JSON schema too, the schema constrains the text branch, as ``response_format``
            does). The output is text unless the model writes the format's trigger, which
            prose prompts hardly lead to; a call that completes ends the request early, and
            the report counts the tokens it got.
    """

    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_ids)
    max_tokens: int = attrs.field(validator=int_at_least(1))
    json_schema: str | None = attrs.field(default=None, kw_only=True)
    tools: bool = attrs.field(default=False, kw_only=True, validator=boolean)

    @json_schema.validator
    def _check_schema(self, attribute: object, value: str | None) -> None:
        if value is None:
            return
        if not isinstance(value, str):
            raise TypeError(f"json_schema must be JSON text or None, got {type(value).__name__}")
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"json_schema must be JSON text, got {value[:40]!r}: {exc}") from exc
        if not isinstance(parsed, dict):  # the text is the wrong value, not the wrong type
            raise ValueError(  # noqa: TRY004
                f"json_schema must be a JSON object, got {type(parsed).__name__}"
            )

    @prompt_token_ids.validator
    def _check_prompt(self, attribute: object, value: tuple[int, ...]) -> None:
        if not value:
            raise ValueError("prompt_token_ids must hold at least one token, got none")
        for token in value:
            if not is_int(token) or token < 0:
                raise ValueError(f"prompt_token_ids must be ids >= 0, got {token!r}")


@attrs.frozen
class Workload:
    """The requests every system in a run receives, and when.

    Attributes:
        requests: The requests, in arrival order.
        arrival_times: Seconds from the start of the run at which each request arrives,
            non-decreasing; ``None`` for an offline workload (all at t = 0, submitted at once).
        seed: The seed the workload was drawn with.
        description: One line for reports ("offline: 64 requests, prompts 16-512, ...").
        shared_prefix_len: Tokens every prompt shares with others (0: prompts are distinct,
            so a prefix cache finds nothing).
    """

    requests: tuple[BenchRequest, ...] = attrs.field(converter=_requests)
    arrival_times: tuple[float, ...] | None = attrs.field()
    seed: int
    description: str
    shared_prefix_len: int = attrs.field(default=0, validator=int_at_least(0))

    @requests.validator
    def _check_requests(self, attribute: object, value: tuple[BenchRequest, ...]) -> None:
        if not value:
            raise ValueError("a workload must hold at least one request, got none")

    @arrival_times.validator
    def _check_arrivals(self, attribute: object, value: tuple[float, ...] | None) -> None:
        if value is None:
            return
        if len(value) != len(self.requests):
            raise ValueError(
                f"arrival_times must give one time per request ({len(self.requests)}), "
                f"got {len(value)}"
            )
        previous = 0.0
        for time in value:
            if not math.isfinite(time) or time < previous:
                raise ValueError(
                    f"arrival_times must be finite, >= 0 and non-decreasing, got {time} "
                    f"after {previous}"
                )
            previous = time

    @property
    def is_offline(self) -> bool:
        """Whether every request is submitted at once, at t = 0."""
        return self.arrival_times is None

    def arrival(self, index: int) -> float:
        """When request ``index`` arrives, in seconds from the start of the run."""
        return 0.0 if self.arrival_times is None else self.arrival_times[index]

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(request.prompt_token_ids) for request in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Tokens all systems must generate, over all requests."""
        return sum(request.max_tokens for request in self.requests)

    @property
    def num_constrained(self) -> int:
        """Requests whose output is constrained: by a JSON schema, or by tools."""
        return sum(request.json_schema is not None or request.tools for request in self.requests)

    @property
    def num_with_tools(self) -> int:
        """Requests that offer tools."""
        return sum(request.tools for request in self.requests)


def with_json_schemas(workload: Workload, fraction: float) -> Workload:
    """``workload`` with ``round(fraction * n)`` of its requests carrying
    :func:`~twostroke.engine.bench.schemas.bench_schema`.

    Which requests is drawn from the workload's seed, so the choice is repeatable and spread
    over the lengths; each gets the schema with ``minItems`` equal to its ``max_tokens``.
    Everything else (prompts, lengths, arrivals) is unchanged: :func:`without_json_schemas`
    of the result has the workload's requests again.

    Raises:
        ValueError: ``fraction`` is not a number in [0, 1].
    """
    chosen = _chosen(workload, fraction, "schemas")
    if not chosen:
        return workload
    count = len(chosen)
    requests = [
        attrs.evolve(request, json_schema=json.dumps(bench_schema(request.max_tokens)))
        if index in chosen
        else request
        for index, request in enumerate(workload.requests)
    ]
    description = (
        f"{workload.description}; {count} of {len(requests)} with a JSON schema ({fraction:.0%})"
    )
    return attrs.evolve(workload, requests=requests, description=description)


def _chosen(workload: Workload, fraction: float, stream: str) -> set[int]:
    """``round(fraction * n)`` request indices drawn from the workload's seed, in a stream of
    their own (``stream``), so that each kind's choice is independent of the others.

    Raises:
        ValueError: ``fraction`` is not a number in [0, 1].
    """
    if isinstance(fraction, bool) or not (isinstance(fraction, int | float) and 0 <= fraction <= 1):
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    count = round(fraction * len(workload.requests))
    draw = random.Random(f"{stream}-{workload.seed}")
    return set(draw.sample(range(len(workload.requests)), count)) if count else set()


def without_json_schemas(workload: Workload) -> Workload:
    """``workload`` with every JSON schema taken off: the same work, unconstrained."""
    if not workload.num_constrained:
        return workload
    return attrs.evolve(
        workload,
        requests=[attrs.evolve(request, json_schema=None) for request in workload.requests],
        description=f"{workload.description}, the schemas taken off",
    )


def with_tools(workload: Workload, fraction: float) -> Workload:
    """``workload`` with ``round(fraction * n)`` of its requests offering the bench's tools
    with ``tool_choice`` ``"auto"`` (:attr:`BenchRequest.tools`).

    Which requests is drawn from the workload's seed (a stream of its own, so the choice does
    not depend on :func:`with_json_schemas`'); prompts, lengths and arrivals are unchanged:
    :func:`without_tools` of the result has the workload's requests again.

    Raises:
        ValueError: ``fraction`` is not a number in [0, 1].
    """
    chosen = _chosen(workload, fraction, "tools")
    if not chosen:
        return workload
    count = len(chosen)
    requests = [
        attrs.evolve(request, tools=index in chosen or request.tools)
        for index, request in enumerate(workload.requests)
    ]
    description = (
        f"{workload.description}; {count} of {len(requests)} offer tools, tool_choice auto "
        f"({fraction:.0%})"
    )
    return attrs.evolve(workload, requests=requests, description=description)


def without_tools(workload: Workload) -> Workload:
    """``workload`` with every request's tools taken off: the same prompts, unconstrained
    (but for JSON schemas)."""
    if not workload.num_with_tools:
        return workload
    return attrs.evolve(
        workload,
        requests=[attrs.evolve(request, tools=False) for request in workload.requests],
        description=f"{workload.description}, the tools taken off",
    )


def offline_workload(
    encode: Callable[[str], Sequence[int]],
    *,
    n: int = 64,
    prompt_len: tuple[int, int] = (16, 512),
    output_len: tuple[int, int] = (16, 256),
    seed: int = 0,
    text: str = CORPUS,
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
) -> Workload:
    """``n`` requests submitted at once, lengths uniform in the given ranges.

    The figure it is made for is throughput: total output tokens over wall time, as in vLLM's
    and nano-vllm's offline benchmarks.

    Args:
        encode: The model's tokenizer, text to ids (e.g. ``Tokenizer.encode``).
        n: How many requests.
        prompt_len: Inclusive range of prompt lengths, in tokens.
        output_len: Inclusive range of tokens to generate per request.
        seed: Fixes the lengths and the windows.
        text: The prose prompts are cut from; the built-in :data:`CORPUS` by default.
        shared_prefix_len: With > 0, each prompt is one of ``num_prefixes`` shared prefixes
            of this many tokens (request ``i`` takes prefix ``i % num_prefixes``) followed by
            its own window of ``prompt_len`` tokens: a system prompt shared by many users,
            which a prefix cache computes once per prefix.
        num_prefixes: How many distinct shared prefixes.

    Returns:
        The workload, with ``arrival_times`` ``None``.

    Raises:
        ValueError: ``n`` < 1, a range is empty or starts below 1, ``text`` encodes to
            no tokens, ``shared_prefix_len`` < 0 or ``num_prefixes`` < 1.
        TypeError: ``shared_prefix_len`` or ``num_prefixes`` is not an int.
    """
    requests = _draw_requests(encode, n, prompt_len, output_len, random.Random(seed), text)
    requests = _share_prefixes(encode, requests, shared_prefix_len, num_prefixes, seed, text)
    return Workload(
        requests=requests,
        arrival_times=None,
        seed=seed,
        description=(
            f"offline: {n} requests at once, prompts {prompt_len[0]}-{prompt_len[1]} tokens"
            f"{_sharing(shared_prefix_len, num_prefixes)}, "
            f"outputs {output_len[0]}-{output_len[1]} tokens, seed {seed}"
        ),
        shared_prefix_len=shared_prefix_len,
    )


def serving_workload(
    encode: Callable[[str], Sequence[int]],
    *,
    rate: float,
    burstiness: float = 1.0,
    n: int = 64,
    prompt_len: tuple[int, int] = (16, 512),
    output_len: tuple[int, int] = (16, 256),
    seed: int = 0,
    text: str = CORPUS,
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
) -> Workload:
    """``n`` requests arriving at ``rate`` per second, with gamma-distributed gaps.

    vLLM's definition: the gap between two arrivals is drawn from a gamma distribution of
    shape ``burstiness`` and mean ``1 / rate``; shape 1 is a Poisson process, below 1 burstier,
    above 1 more regular. The first request arrives at t = 0. Prompts and lengths are drawn
    exactly as in :func:`offline_workload` with the same seed, so the two workloads differ
    only in the arrivals.

    Args:
        encode: The model's tokenizer, text to ids.
        rate: Mean arrivals per second, > 0 and finite.
        burstiness: Gamma shape, > 0.
        n: How many requests.
        prompt_len: Inclusive range of prompt lengths, in tokens.
        output_len: Inclusive range of tokens to generate per request.
        seed: Fixes the lengths, the windows and the arrivals.
        text: The prose prompts are cut from.
        shared_prefix_len: As for :func:`offline_workload`.
        num_prefixes: As for :func:`offline_workload`.

    Returns:
        The workload, with one arrival time per request.

    Raises:
        ValueError: ``rate`` or ``burstiness`` is not a positive finite number, or an
            argument :func:`offline_workload` refuses.
    """
    if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number of requests per second > 0, got {rate}")
    if not (isinstance(burstiness, int | float) and math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a finite gamma shape > 0, got {burstiness}")
    rng = random.Random(seed)
    requests = _draw_requests(encode, n, prompt_len, output_len, rng, text)
    requests = _share_prefixes(encode, requests, shared_prefix_len, num_prefixes, seed, text)
    # A separate stream for the gaps, so the prompts equal the offline workload's.
    gaps = random.Random(f"arrivals-{seed}")
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + gaps.gammavariate(burstiness, 1.0 / (rate * burstiness)))
    shape = "Poisson" if burstiness == 1.0 else f"gamma shape {burstiness:g}"
    return Workload(
        requests=requests,
        arrival_times=tuple(times),
        seed=seed,
        description=(
            f"serving: {n} requests at {rate:g}/s ({shape}), prompts "
            f"{prompt_len[0]}-{prompt_len[1]} tokens{_sharing(shared_prefix_len, num_prefixes)}, "
            f"outputs {output_len[0]}-{output_len[1]} tokens, seed {seed}"
        ),
        shared_prefix_len=shared_prefix_len,
    )


def _sharing(shared_prefix_len: int, num_prefixes: int) -> str:
    if not shared_prefix_len:
        return ""
    return f" after one of {num_prefixes} shared {shared_prefix_len}-token prefixes"


def _share_prefixes(
    encode: Callable[[str], Sequence[int]],
    requests: tuple[BenchRequest, ...],
    shared_prefix_len: int,
    num_prefixes: int,
    seed: int,
    text: str,
) -> tuple[BenchRequest, ...]:
    """Put one of ``num_prefixes`` shared prefixes before each prompt, round robin.

    The prefixes are windows of the text at distinct offsets, drawn from a stream of their
    own, so the requests' own windows and lengths equal the workload without sharing.
    """
    check_int_at_least("shared_prefix_len", shared_prefix_len, 0)
    check_int_at_least("num_prefixes", num_prefixes, 1)
    if not shared_prefix_len:
        return requests
    base = [int(token) for token in encode(text)]
    stream = base * ((shared_prefix_len + len(base) - 1) // len(base) + 1)
    rng = random.Random(f"prefixes-{seed}")
    offsets = rng.sample(range(len(base)), min(num_prefixes, len(base)))
    prefixes = [tuple(stream[o : o + shared_prefix_len]) for o in offsets]
    return tuple(
        attrs.evolve(
            request, prompt_token_ids=prefixes[index % len(prefixes)] + request.prompt_token_ids
        )
        for index, request in enumerate(requests)
    )


def _draw_requests(
    encode: Callable[[str], Sequence[int]],
    n: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    rng: random.Random,
    text: str,
) -> tuple[BenchRequest, ...]:
    """Lengths uniform in their ranges; each prompt a window of the text repeated end to end.

    Windows start at distinct offsets where the text is long enough, so no two prompts share
    a prefix (a prefix cache would otherwise make one system look faster for the wrong reason).
    """
    if not is_int(n) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    for name, bounds in (("prompt_len", prompt_len), ("output_len", output_len)):
        low, high = bounds
        if low < 1 or high < low:
            raise ValueError(f"{name} must satisfy 1 <= low <= high, got {bounds}")
    base = [int(token) for token in encode(text)]
    if not base:
        raise ValueError("the prompt text encodes to no tokens")
    prompt_lens = [rng.randint(*prompt_len) for _ in range(n)]
    output_lens = [rng.randint(*output_len) for _ in range(n)]
    if n <= len(base):
        offsets = rng.sample(range(len(base)), n)
    else:
        offsets = [rng.randrange(len(base)) for _ in range(n)]
    copies = (max(prompt_lens) + len(base) - 1) // len(base) + 1
    stream = base * copies
    return tuple(
        BenchRequest(
            prompt_token_ids=tuple(stream[offset : offset + length]), max_tokens=max_tokens
        )
        for offset, length, max_tokens in zip(offsets, prompt_lens, output_lens, strict=True)
    )
