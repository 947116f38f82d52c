"""Hypothesis strategies for the scheduling core: parameters, requests, workloads, configs.

Test support: imports hypothesis (the ``test`` extra). Use it through
:mod:`twostroke.states.testing`, which re-exports everything.
"""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import strategies as st

from twostroke.states.constraints import Choice, Constraint, Regex
from twostroke.states.params import MAX_LOGPROBS, SamplingParams
from twostroke.states.request import (
    Request,
)
from twostroke.states.scheduler import SchedulerConfig
from twostroke.states.scheduler_config import PRIORITY_AGING_STEPS
from twostroke.states.testing.workload import RequestSpec, Workload
from twostroke.states.validators import MAX_PIPELINE_DEPTH
from twostroke.states.windowed import WindowedKV, window_pool_blocks

__all__ = [
    "CONSTRAINT_ALPHABET",
    "EOS_TEXT",
    "SCHEDULING_CONSTRAINTS",
    "choices",
    "regexes",
    "request_specs",
    "requests",
    "sampling_params",
    "scheduler_configs",
    "token_vocabularies",
    "windowed_pools",
    "workloads",
]

#: The constraints :func:`request_specs` gives with ``constrained=True``: a few fixed ones
#: (drawing :func:`regexes` per spec would cost the scheduler's machines most of their time),
#: which finish on their own, need EOS, or never finish within a few tokens.
SCHEDULING_CONSTRAINTS: tuple[Constraint, ...] = (
    Choice(["a", "ab", "b0 a"]),
    Choice(["é"]),
    Regex("a(b|0)*"),
    Regex("[ab]+\\.?"),
    Regex("(ab|0)*é"),
    Regex(".*"),
)

Ints = int | st.SearchStrategy[int]
VOCAB_SIZE = 64


def _ints(value: Ints | None, default: st.SearchStrategy[int]) -> st.SearchStrategy[int]:
    """A strategy from a fixed value, a strategy, or ``None`` for the default."""
    if value is None:
        return default
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


# --- strategies ---------------------------------------------------------------------------


@st.composite
def sampling_params(
    draw: st.DrawFn,
    /,
    *,
    max_tokens: Ints | None = None,
    vocab_size: int = VOCAB_SIZE,
    scheduling_only: bool = False,
) -> SamplingParams:
    """Valid sampling parameters, every field drawn from its whole range.

    Stop token ids are drawn from ``range(vocab_size)`` so that they actually occur.

    Args:
        max_tokens: The value, or a strategy, for ``max_tokens`` (default 1 to 16).
        vocab_size: Token ids lie in ``range(vocab_size)``.
        scheduling_only: Draw only what the scheduler reads (``max_tokens``,
            ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``priority``, ``cache_ttl``) and
            leave the rest at their defaults: faster, and failing examples shrink to fewer
            fields.
    """
    most = draw(_ints(max_tokens, st.integers(1, 16)))
    params = SamplingParams(
        max_tokens=most,
        min_tokens=draw(st.integers(0, most) | st.just(0)),
        stop_token_ids=draw(st.lists(st.integers(0, vocab_size - 1), max_size=3)),
        ignore_eos=draw(st.booleans()),
        # Mostly one priority (FIFO), else a few levels: ranks that cross as requests age.
        priority=draw(st.just(0) | st.integers(-2, 2), label="priority"),
        # Mostly none; else pins that end within a run (its clocks tick per event) or outlast it.
        cache_ttl=draw(st.just(0.0) | st.sampled_from([3.0, 40.0, 3600.0]), label="cache_ttl"),
    )
    if scheduling_only:
        return params
    unit = st.floats(0, 1, allow_nan=False)
    penalty = st.floats(-2, 2, allow_nan=False)
    return attrs.evolve(
        params,
        temperature=draw(st.floats(0, 2, allow_nan=False)),
        top_k=draw(st.none() | st.integers(1, vocab_size)),
        top_p=draw(unit.filter(lambda p: p > 0)),
        min_p=draw(unit),
        seed=draw(st.none() | st.integers(0, 2**63 - 1)),
        stop=draw(st.lists(st.text(min_size=1, max_size=4), max_size=2)),
        repetition_penalty=draw(st.floats(0.5, 2, allow_nan=False)),
        presence_penalty=draw(penalty),
        frequency_penalty=draw(penalty),
        logprobs=draw(st.none() | st.integers(0, MAX_LOGPROBS)),
        include_stop_str_in_output=draw(st.booleans()),
    )


@st.composite
def request_specs(
    draw: st.DrawFn,
    /,
    config: SchedulerConfig | None = None,
    *,
    max_prompt_tokens: int = 24,
    max_tokens: int = 12,
    vocab_size: int = VOCAB_SIZE,
    scheduling_only: bool = False,
    constrained: bool = False,
) -> RequestSpec:
    """Request specs (prompt, parameters, EOS ids); with ``config``, only ones it serves.

    Args:
        config: If given, every spec fits it (:meth:`RequestSpec.fits`).
        max_prompt_tokens: Longest prompt.
        max_tokens: Largest ``max_tokens``.
        vocab_size: Token ids lie in ``range(vocab_size)``.
        scheduling_only: As for :func:`sampling_params`.
        constrained: Give some specs a :func:`choices` or :func:`regexes` constraint (the
            harness follows it over its
            :data:`~twostroke.states.testing.workload.SIMULATED_VOCABULARY`).
    """
    capacity = max_prompt_tokens + max_tokens
    if config is not None:
        capacity = min(capacity, config.max_model_len, config.num_blocks * config.block_size + 1)
    num_prompt = draw(st.integers(1, min(max_prompt_tokens, capacity - 1)))
    # Long outputs half of the time: decodes that grow into new blocks make preemption.
    room = min(max_tokens, capacity - num_prompt)
    most = st.integers(1, room) | st.just(room)
    params = draw(
        sampling_params(max_tokens=most, vocab_size=vocab_size, scheduling_only=scheduling_only)
    )
    if constrained:
        constraint: Constraint | None = draw(st.none() | st.sampled_from(SCHEDULING_CONSTRAINTS))
        params = attrs.evolve(params, constraint=constraint)
    return RequestSpec(
        prompt_token_ids=draw(
            st.lists(st.integers(0, vocab_size - 1), min_size=num_prompt, max_size=num_prompt)
        ),
        params=params,
        eos_token_ids=draw(st.frozensets(st.integers(0, vocab_size - 1), max_size=2)),
    )


@st.composite
def requests(
    draw: st.DrawFn,
    /,
    config: SchedulerConfig | None = None,
    *,
    request_id: Ints | None = None,
    **spec_options: Any,
) -> Request:
    """New requests (status WAITING); options as for :func:`request_specs`.

    Args:
        config: If given, the scheduler with this configuration accepts every request.
        request_id: The id, or a strategy for it (default: any non-negative int32).
        spec_options: ``max_prompt_tokens``, ``max_tokens``, ``vocab_size``,
            ``scheduling_only``.
    """
    spec = draw(request_specs(config, **spec_options))
    return spec.build(draw(_ints(request_id, st.integers(0, 2**31 - 1))))


@st.composite
def workloads(
    draw: st.DrawFn,
    /,
    config: SchedulerConfig | None = None,
    *,
    max_requests: int = 8,
    max_gap: int = 3,
    **spec_options: Any,
) -> Workload:
    """Workloads of 1 to ``max_requests`` requests arriving over time.

    Args:
        config: If given, every request fits it.
        max_requests: The most requests.
        max_gap: The most steps between two arrivals.
        spec_options: As for :func:`request_specs`.
    """
    specs = draw(st.lists(request_specs(config, **spec_options), min_size=1, max_size=max_requests))
    gaps = draw(st.lists(st.integers(0, max_gap), min_size=len(specs), max_size=len(specs)))
    arrivals = [sum(gaps[: index + 1]) - gaps[0] for index in range(len(specs))]
    return Workload(requests=specs, arrivals=arrivals)


@st.composite
def scheduler_configs(
    draw: st.DrawFn,
    /,
    *,
    num_blocks: Ints | None = None,
    block_size: Ints | None = None,
    max_num_batched_tokens: Ints | None = None,
    max_num_seqs: Ints | None = None,
    pipeline_depth: Ints | None = None,
    enable_prefix_caching: bool | st.SearchStrategy[bool] | None = None,
    priority_aging_steps: Ints | None = None,
    sliding_window: int | st.SearchStrategy[int | None] | None = None,
) -> SchedulerConfig:
    """Small configurations, so that memory pressure and preemption happen all the time.

    ``max_model_len`` lies between half and all of the pool's capacity (plus the last token,
    which needs no KV), so that some requests are refused by the context length and some by
    the pool.

    Each argument is a fixed value, a strategy, or ``None`` for the default range.

    Args:
        num_blocks: KV blocks in the pool (default 2 to 12).
        block_size: Positions per block (default 1 to 4).
        max_num_batched_tokens: Token budget per step (default 1 to 24).
        max_num_seqs: Request limit (default 1 to 6).
        pipeline_depth: 1 (serial) to ``MAX_PIPELINE_DEPTH`` (lookahead) (default any).
        enable_prefix_caching: Whether the scheduler shares cached prefix blocks
            (default either).
        priority_aging_steps: Steps per level of priority a waiting request gains (default
            1 to 4, so that ranks cross within a run, or the engine's default).
        sliding_window: Positions every layer of the simulated model sees (default none, or
            1 to 9: shorter than most requests, so that blocks are given back as they run);
            ``st.none()`` for none.
    """
    blocks = draw(_ints(num_blocks, st.integers(2, 12)))
    size = draw(_ints(block_size, st.integers(1, 4)))
    capacity = blocks * size + 1  # the last token needs no KV
    return SchedulerConfig(
        num_blocks=blocks,
        block_size=size,
        max_num_batched_tokens=draw(_ints(max_num_batched_tokens, st.integers(1, 24))),
        max_num_seqs=draw(_ints(max_num_seqs, st.integers(1, 6))),
        # Mostly the pool's capacity: a short context would only allow short requests.
        max_model_len=draw(st.just(capacity) | st.integers(max(2, capacity // 2), capacity)),
        pipeline_depth=draw(
            _ints(pipeline_depth, st.sampled_from(range(1, MAX_PIPELINE_DEPTH + 1)))
        ),
        enable_prefix_caching=draw(
            st.booleans()
            if enable_prefix_caching is None
            else enable_prefix_caching
            if isinstance(enable_prefix_caching, st.SearchStrategy)
            else st.just(enable_prefix_caching)
        ),
        priority_aging_steps=draw(
            _ints(priority_aging_steps, st.integers(1, 4) | st.just(PRIORITY_AGING_STEPS))
        ),
        sliding_window=draw(
            st.none() | st.integers(1, 9)
            if sliding_window is None
            else sliding_window
            if isinstance(sliding_window, st.SearchStrategy)
            else st.just(sliding_window)
        ),
    )


@st.composite
def windowed_pools(
    draw: st.DrawFn,
    /,
    *,
    window: int,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_drafts: int,
    totals: list[int],
) -> WindowedKV:
    """Windowed layers' pools (:class:`~twostroke.states.windowed.WindowedKV`) for requests
    of ``totals`` positions: from the fewest blocks the longest needs alone, beside a step's,
    to ``max_num_seqs`` whole windows (:func:`~twostroke.states.windowed.window_pool_blocks`),
    so that admission waits for room all the time at the low end."""
    probe = WindowedKV(window=window, num_blocks=2)
    reserve = probe.step_reserve(
        block_size=block_size, max_num_batched_tokens=max_num_batched_tokens
    )
    fewest = reserve + max(
        probe.reservation(total, block_size=block_size, max_drafts=max_drafts) for total in totals
    )
    most = window_pool_blocks(
        window=window,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_drafts=max_drafts,
    )
    return WindowedKV(window=window, num_blocks=draw(st.integers(fewest, max(fewest, most))))


# --- constraints ------------------------------------------------------------------------------

#: The characters drawn constraints and vocabularies are made of: letters, a digit, a space, a
#: dot (a regex metacharacter, escaped where it is meant) and a two-byte UTF-8 character.
CONSTRAINT_ALPHABET = "ab0 .é"
#: The text :func:`token_vocabularies` gives its EOS token (the last id).
EOS_TEXT = "<eos>"
_REGEX_LITERALS = ("a", "b", "0", " ", "é", "\\.")


def _regex_leaves() -> st.SearchStrategy[str]:
    classes = st.lists(st.sampled_from("ab0é"), min_size=1, max_size=3, unique=True).map(
        lambda chars: "[" + "".join(chars) + "]"
    )
    return st.one_of(
        st.sampled_from(_REGEX_LITERALS), classes, st.sampled_from(["[a-b]", "[^a]", "."])
    )


def _regex_branches(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda parts: "(" + "|".join(parts) + ")"),
        st.tuples(inner, st.sampled_from("*+?")).map(lambda pair: f"({pair[0]}){pair[1]}"),
    )


def regexes() -> st.SearchStrategy[Regex]:
    """Regular expressions over :data:`CONSTRAINT_ALPHABET` in the syntax Python's ``re``,
    Rust's ``regex`` (llguidance) and the reference matcher's parser read alike: literals,
    an escaped dot, classes (with a range and a negation), ``.``, groups, ``|``, ``*``, ``+``
    and ``?``."""
    patterns = st.recursive(_regex_leaves(), _regex_branches, max_leaves=8)
    return patterns.map(Regex)


def choices() -> st.SearchStrategy[Choice]:
    """Choices of one to five strings over :data:`CONSTRAINT_ALPHABET`, some of them prefixes
    of others (so that a matcher must tell a complete choice from a longer one)."""
    words = st.text(alphabet=CONSTRAINT_ALPHABET, min_size=1, max_size=5)

    @st.composite
    def draw_choice(draw: st.DrawFn) -> Choice:
        strings = draw(st.lists(words, min_size=1, max_size=5))
        if draw(st.booleans()):  # a proper prefix of a choice is a choice too
            longest = max(strings, key=len)
            if len(longest) > 1:
                strings.append(longest[: draw(st.integers(1, len(longest) - 1))])
        return Choice(strings)

    return draw_choice()


def token_vocabularies(
    alphabet: str = CONSTRAINT_ALPHABET, *, max_extra: int = 12
) -> st.SearchStrategy[list[str]]:
    """Token texts: every character of ``alphabet`` (so that any text over it can be spelled),
    up to ``max_extra`` longer tokens of two to four characters, in a drawn order, and EOS
    last (its text is :data:`EOS_TEXT`; its id is ``len(vocabulary) - 1``)."""
    longer = st.text(alphabet=alphabet, min_size=2, max_size=4)

    @st.composite
    def draw_vocabulary(draw: st.DrawFn) -> list[str]:
        extra = draw(st.lists(longer, max_size=max_extra, unique=True))
        tokens = draw(st.permutations([*alphabet, *extra]))
        return [*tokens, EOS_TEXT]

    return draw_vocabulary()
