"""Speculative decoding in the core: the proposers, the adaptation, and what drafts do to
the scheduler (budgets, blocks, the prefix cache, preemption) and to outputs (nothing)."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.states.constraints import Choice
from twostroke.states.errors import InvalidTransition, SchedulerError
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, TokenLogprobs, verify_draft
from twostroke.states.request import (
    Admitted,
    ConstraintCompiled,
    DraftVerified,
    Preempted,
    Request,
    RequestStatus,
    SampleDiscarded,
    SampleScheduled,
    TokenSampled,
)
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.scheduler_config import SchedulerStatistics
from twostroke.states.simulation import SimulatedKV, toy_next_token
from twostroke.states.speculation import (
    MAX_PROMPT_LOOKUP,
    MAX_SPECULATIVE_TOKENS,
    PROBE_AFTER,
    NgramIndex,
    SpeculativeConfig,
    Speculator,
    SuffixTrie,
    draft_length,
    speculative_config,
)
from twostroke.states.statistics import total
from twostroke.states.testing import (
    DraftingSchedulerMachine,
    ReferenceMatcher,
    SimulatedEngine,
    drive,
    reference_output,
    scheduler_configs,
    workloads,
)
from twostroke.states.testing.strategies import VOCAB_SIZE
from twostroke.states.testing.workload import SIMULATED_VOCABULARY

# --- stateful -------------------------------------------------------------------------------

TestDraftingScheduler = DraftingSchedulerMachine.for_config(scheduler_configs()).TestCase
#: The lookahead under memory pressure: preemption with drafts in flight, all the time.
TestDraftingSchedulerTinyPool = DraftingSchedulerMachine.for_config(
    scheduler_configs(
        num_blocks=st.integers(2, 6),
        block_size=st.integers(1, 3),
        max_num_seqs=st.integers(2, 4),
        max_num_batched_tokens=st.integers(2, 16),
        pipeline_depth=2,
    )
).TestCase

# --- helpers --------------------------------------------------------------------------------

NGRAM = SpeculativeConfig(method="ngram", adaptive=False, disable_by_batch_size=None)


def perfect(
    request_id: int, known: Sequence[int], wanted: int, window: int | None = None
) -> list[int]:
    """The toy model's own greedy continuation (seeing the last ``window`` tokens, as the
    simulated device of a windowed model does): every draft holds."""
    sequence = list(known)
    for _ in range(wanted):
        sequence.append(toy_next_token(sequence if window is None else sequence[-window:]))
    return sequence[len(known) :]


def wrong(
    request_id: int, known: Sequence[int], wanted: int, window: int | None = None
) -> list[int]:
    """The continuation with every token changed: no draft holds."""
    return [(token + 1) % VOCAB_SIZE for token in perfect(request_id, known, wanted, window)]


def scheduler(
    propose: object = perfect,
    spec: SpeculativeConfig = NGRAM,
    **options: object,
) -> Scheduler:
    fields: dict[str, object] = {"num_blocks": 32, "block_size": 4, "max_model_len": 128}
    fields.update(options)
    config = SchedulerConfig(speculative_config=spec, **fields)  # type: ignore[arg-type]
    speculator = Speculator(spec, propose=propose) if callable(propose) else None  # type: ignore[arg-type]
    return Scheduler(config, clock=lambda: 0.0, speculator=speculator)


def request(request_id: int = 0, prompt: Sequence[int] = (1, 2, 3), **params: object) -> Request:
    fields: dict[str, object] = {"max_tokens": 8, "ignore_eos": True}
    fields.update(params)
    return Request(request_id, prompt, SamplingParams(**fields), arrival_time=0.0)  # type: ignore[arg-type]


def step(scheduler: Scheduler, kv: SimulatedKV) -> RunnerOutput:
    plan = scheduler.schedule()
    assert plan is not None
    output = kv.execute(plan)
    scheduler.apply(output)
    scheduler.check_invariants()
    return output


# --- exactness ------------------------------------------------------------------------------


@given(
    config=scheduler_configs(),
    data=st.data(),
    kind=st.sampled_from(["perfect", "wrong", "random", "method"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_drafts_give_the_outputs_without_drafts(
    config: SchedulerConfig, data: st.DataObject, kind: str, seed: int
) -> None:
    """Greedy outputs are token for token those without speculation, whatever the drafts
    (the harness compares every output with the reference and checks every guarantee)."""
    workload = data.draw(workloads(config, scheduling_only=True))
    rng = random.Random(seed)

    def chosen(request_id: int, known: Sequence[int], wanted: int) -> list[int]:
        if kind == "random":
            return [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(wanted + 1))]
        guess = perfect if kind == "perfect" else wrong
        return guess(request_id, known, wanted, config.sliding_window)

    spec = SpeculativeConfig(
        method="ngram", prompt_lookup_min=1, adaptive=False, disable_by_batch_size=None
    )
    speculator = Speculator(spec, propose=None if kind == "method" else chosen)
    speculating = Scheduler(
        attrs.evolve(config, speculative_config=spec), clock=lambda: 0.0, speculator=speculator
    )
    result = drive(speculating, workload)
    assert all(status is not RequestStatus.FAILED for status in result.statuses.values())
    stats = speculating.statistics()
    assert stats.num_spec_decode_accepted_tokens <= stats.num_spec_decode_draft_tokens
    if kind == "wrong":
        assert stats.num_spec_decode_accepted_tokens == 0


def test_perfect_drafts_take_fewer_steps_and_count_every_position() -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    speculating = scheduler(perfect, spec)
    prompt = [5, 6, 7]
    speculating.add_request(request(prompt=prompt, max_tokens=12))
    kv = SimulatedKV(32, 4)
    outputs: list[int] = []
    while not speculating.is_idle():
        plan = speculating.schedule()
        assert plan is not None
        report = speculating.apply(kv.execute(plan))
        outputs.extend(token for _, token in report.new_tokens)
        speculating.check_invariants()
    expected, _ = reference_output(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert outputs == expected
    stats = speculating.statistics()
    # 4 tokens a step: 3 drafts (the prompt's row drafts too) and the token after them.
    assert stats.num_steps == 3
    assert stats.num_spec_decode_drafts == 3
    assert stats.num_spec_decode_accepted_tokens == 9
    assert stats.spec_decode_accepted_tokens_per_pos[:4] == (3, 3, 3, 0)
    assert stats.spec_decode_mean_acceptance_length == pytest.approx(1 + 9 / 3)
    assert stats.num_tokens_generated == 12


# --- the scheduler's rules ------------------------------------------------------------------


def test_drafts_count_against_the_budget_and_stop_at_max_tokens() -> None:
    sched = scheduler(perfect, max_num_batched_tokens=5)
    sched.add_request(request(max_tokens=4))
    kv = SimulatedKV(32, 4)
    first = sched.schedule()
    assert first is not None
    # The prompt's 3 positions leave 2 of the budget: the admission row drafts 2.
    assert len(first.requests[0].draft_token_ids) == 2
    assert first.num_tokens == 5
    sched.apply(kv.execute(first))
    second = sched.schedule()
    assert second is not None
    (row,) = second.requests
    # max_tokens 4, three generated: one token and no draft.
    assert row.draft_token_ids == ()
    assert row.num_samples == 1
    sched.apply(kv.execute(second))
    assert sched.get(0) is None  # finished: 4 tokens
    assert sched.is_idle()


def test_a_budget_left_for_no_draft_drafts_nothing() -> None:
    sched = scheduler(perfect, max_num_batched_tokens=1)
    sched.add_request(request(prompt=[1]))
    kv = SimulatedKV(32, 4)
    step(sched, kv)
    plan = sched.schedule()
    assert plan is not None
    assert plan.requests[0].draft_token_ids == ()


def test_a_request_verifying_drafts_is_not_planned_until_they_settle() -> None:
    sched = scheduler(perfect, pipeline_depth=2)
    sched.add_request(request(max_tokens=30))
    kv = SimulatedKV(32, 4)
    step(sched, kv)
    plan = sched.schedule()
    assert plan is not None
    assert plan.requests[0].draft_token_ids
    record = sched.get(0)
    assert record is not None
    assert record.num_drafts == len(plan.requests[0].draft_token_ids)
    assert sched.can_schedule
    assert sched.schedule() is None  # its next positions are not known yet
    sched.apply(kv.execute(plan))
    assert record.num_drafts == 0
    sched.check_invariants()


def test_rejected_drafts_roll_back_the_computed_count() -> None:
    sched = scheduler(wrong)
    sched.add_request(request(prompt=[1, 2, 3, 4, 5]))
    kv = SimulatedKV(32, 4)
    step(sched, kv)
    record = sched.get(0)
    assert record is not None
    plan = sched.schedule()
    assert plan is not None
    drafts = plan.requests[0].draft_token_ids
    assert record.num_computed_tokens == 5 + 1 + len(drafts)
    output = kv.execute(plan)
    assert output.tokens(0) == (output.sampled[0],)  # the first draft was wrong
    sched.apply(output)
    assert record.num_computed_tokens == 6
    assert record.num_placeholders == 0
    assert len(record.output_token_ids) == 2
    sched.check_invariants()


def test_drafts_never_preempt_or_wait_for_blocks() -> None:
    """A pool with exactly the blocks the tokens need: the drafts are dropped."""
    sched = scheduler(perfect, num_blocks=2, block_size=2, max_model_len=4)
    sched.add_request(request(prompt=[1, 2], max_tokens=2))
    kv = SimulatedKV(2, 2)
    step(sched, kv)
    sched.add_request(request(1, prompt=[3], max_tokens=1))
    plan = sched.schedule()
    assert plan is not None
    assert all(not entry.draft_token_ids for entry in plan.requests)
    assert sched.statistics().num_preemptions == 0


def test_a_decoding_request_whose_drafts_need_a_block_none_has_decodes_without_them() -> None:
    """A running request whose next token fits its last block but whose drafts would need a
    new one, with the pool empty: it decodes that token alone, and no one is preempted."""

    def late(request_id: int, known: Sequence[int], wanted: int) -> list[int]:
        return perfect(request_id, known, wanted) if len(known) > 3 else []

    sched = scheduler(late, num_blocks=3, block_size=2, max_model_len=6)
    sched.add_request(request(0, prompt=[1, 2, 3], max_tokens=3))  # two blocks
    sched.add_request(request(1, prompt=[7], max_tokens=3))  # the third
    kv = SimulatedKV(3, 2)
    step(sched, kv)
    assert sched.pool.num_free == 0
    plan = sched.schedule()
    assert plan is not None
    [first] = [entry for entry in plan.requests if entry.request_id == 0]
    assert first.num_tokens == 1
    assert not first.draft_token_ids
    assert sched.statistics().num_preemptions == 0


def test_penalized_requests_do_not_draft() -> None:
    sched = scheduler(perfect)
    sched.add_request(request(0, repetition_penalty=1.2))
    plan = sched.schedule()
    assert plan is not None
    assert plan.requests[0].draft_token_ids == ()


def _constrained(
    choice: str, request_id: int = 0, matcher: type[ReferenceMatcher] | None = None
) -> Request:
    target = request(request_id, constraint=Choice([choice]), max_tokens=12)
    assert target.params.constraint is not None
    kind = matcher or ReferenceMatcher
    matcher = kind(target.params.constraint, SIMULATED_VOCABULARY, frozenset())
    target.apply(ConstraintCompiled(matcher))
    return target


def _spelling(text: str) -> list[int]:
    return [SIMULATED_VOCABULARY.index(letter) for letter in text]


def test_a_constrained_draft_ends_before_the_first_token_its_constraint_refuses() -> None:
    """Drafts "abx...": the constraint wants "abcdef", so the draft is "ab"; the masks of
    the drafted positions are the constraint's after each draft (the simulated device
    samples under them), and the output is the reference's."""

    def propose(request_id: int, known: Sequence[int], wanted: int) -> list[int]:
        return _spelling("abxyz")[:wanted]

    engine = SimulatedEngine(scheduler(propose))
    target = _constrained("abcdef")
    engine.submit(target)
    plan = engine.plan()
    assert plan is not None
    assert plan.requests[0].draft_token_ids == tuple(_spelling("ab"))
    engine.complete()
    assert target.matcher is not None
    assert target.matcher.num_tokens >= 1
    engine.run_until_idle()


def test_a_constrained_draft_the_constraint_takes_whole_is_kept_whole() -> None:
    engine = SimulatedEngine(scheduler(lambda rid, known, wanted: _spelling("abc")))
    target = _constrained("abcdef")
    engine.submit(target)
    plan = engine.plan()
    assert plan is not None
    assert plan.requests[0].draft_token_ids == tuple(_spelling("abc"))
    assert target.matcher is not None
    assert target.matcher.num_tokens == 0
    engine.run_until_idle()


def test_a_constrained_draft_stops_at_the_end_of_its_language() -> None:
    engine = SimulatedEngine(scheduler(lambda rid, known, wanted: _spelling("abcd")))
    engine.submit(_constrained("ab"))
    plan = engine.plan()
    assert plan is not None
    assert plan.requests[0].draft_token_ids == tuple(_spelling("ab"))  # nothing after "ab"
    engine.run_until_idle()


def test_a_constrained_request_with_a_token_in_flight_drafts_and_its_masks_end_the_draft() -> None:
    """Its matcher is behind the token in flight, so the draft is not cut when planned: the
    masks of the drafted positions, filled once that token is applied, forbid "x", so the
    draft ends there and the output is the reference's."""
    engine = SimulatedEngine(scheduler(lambda rid, known, wanted: [], pipeline_depth=2))
    engine.submit(_constrained("abcdef"))
    engine.plan()
    sched = engine.scheduler
    proposals = Speculator(NGRAM, propose=lambda rid, known, wanted: _spelling("abxz"))
    sched._speculator = proposals
    plan = engine.plan()
    assert plan is not None
    assert plan.requests[0].draft_token_ids == tuple(_spelling("bxz"))
    engine.complete()
    report = engine.complete()
    assert [token for _, token in report.new_tokens] == _spelling("bc")  # "x" refused
    engine.run_until_idle()


class _Unforkable(ReferenceMatcher):
    def fork(self) -> ReferenceMatcher:
        raise RuntimeError("the backend gave up")


def test_a_matcher_that_cannot_follow_drafts_drafts_nothing() -> None:
    sched = scheduler(lambda rid, known, wanted: _spelling("abc"))
    sched.add_request(_constrained("abcdef", matcher=_Unforkable))
    plan = sched.schedule()
    assert plan is not None
    assert plan.requests[0].draft_token_ids == ()


def test_disable_by_batch_size_switches_drafting_off_for_the_step() -> None:
    spec = attrs.evolve(NGRAM, disable_by_batch_size=2)
    sched = scheduler(perfect, spec)
    for request_id in range(2):
        sched.add_request(request(request_id))
    kv = SimulatedKV(32, 4)
    step(sched, kv)
    plan = sched.schedule()
    assert plan is not None
    assert all(not entry.draft_token_ids for entry in plan.requests)
    assert Speculator(spec).enabled_for(1)
    assert not Speculator(spec).enabled_for(2)
    assert Speculator(attrs.evolve(spec, disable_by_batch_size=None)).enabled_for(1000)


def test_an_output_that_does_not_verify_its_drafts_is_refused() -> None:
    sched = scheduler(perfect)
    sched.add_request(request(max_tokens=30))
    kv = SimulatedKV(32, 4)
    step(sched, kv)
    plan = sched.schedule()
    assert plan is not None
    drafts = plan.requests[0].draft_token_ids
    bad = RunnerOutput(plan.step_id, {0: drafts[0] + 1}, speculated={0: (drafts[1],)})
    with pytest.raises(SchedulerError, match=re.escape("do not verify the drafts")):
        sched.apply(bad)
    too_long = RunnerOutput(plan.step_id, {0: drafts[0]}, speculated={0: drafts})
    with pytest.raises(SchedulerError, match="do not verify"):
        sched.apply(too_long)
    sched.apply(kv.execute(plan))  # nothing was applied: the real outcome still fits
    sched.check_invariants()


def test_a_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    prompt = [9, 8, 7]
    continuation = perfect(0, prompt, 6)
    stop = continuation[2]
    sched = scheduler(perfect)
    sched.add_request(request(prompt=prompt, max_tokens=10, stop_token_ids=[stop]))
    kv = SimulatedKV(32, 4)
    tokens: list[int] = []
    while not sched.is_idle():
        plan = sched.schedule()
        assert plan is not None
        tokens.extend(token for _, token in sched.apply(kv.execute(plan)).new_tokens)
    expected, reason = reference_output(
        prompt, SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop])
    )
    assert tokens == expected
    assert reason == "stop"


def test_preempted_with_drafts_in_flight_resumes_identically() -> None:
    sched = scheduler(perfect, pipeline_depth=2)
    engine = SimulatedEngine(sched)
    engine.submit(request(prompt=[4, 4, 4], max_tokens=10))
    engine.plan()
    engine.complete()
    plan = engine.plan()
    assert plan is not None
    assert plan.requests[0].draft_token_ids
    record = sched.get(0)
    assert record is not None
    sched._preempt(record)
    sched.check_invariants()
    while not sched.is_idle():
        while sched.can_schedule and engine.plan() is not None:
            pass
        engine.complete()
    expected, _ = reference_output([4, 4, 4], SamplingParams(max_tokens=10, ignore_eos=True))
    assert engine.streams[0] == expected


# --- the request's events -------------------------------------------------------------------


def _decoding(max_tokens: int = 8) -> Request:
    target = request(max_tokens=max_tokens)
    target.apply(Admitted(0.0))
    target.apply(SampleScheduled(0, 3))
    target.apply(TokenSampled(5, 0.0))
    return target


def test_draft_events_check_their_counts() -> None:
    target = _decoding(max_tokens=4)
    with pytest.raises(InvalidTransition, match="would pass max_tokens"):
        target.apply(SampleScheduled(1, 1, num_drafts=3))
    with pytest.raises(InvalidTransition, match="may not have -1 drafts"):
        target.apply(SampleScheduled(1, 1, num_drafts=-1))
    with pytest.raises(InvalidTransition, match="no drafts to settle"):
        target.apply(DraftVerified(1, 0))
    target.apply(SampleScheduled(1, 1, num_drafts=2))
    assert (target.num_placeholders, target.num_drafts, target.num_computed_tokens) == (3, 2, 6)
    with pytest.raises(InvalidTransition, match="comes while a step verifies 2 drafts"):
        target.apply(SampleScheduled(2, 1))
    with pytest.raises(InvalidTransition, match=re.escape("must be in [0, 2]")):
        target.apply(DraftVerified(1, 3))
    with pytest.raises(InvalidTransition, match="must follow one TokenSampled per token"):
        target.apply(DraftVerified(1, 0))
    target.apply(TokenSampled(6, 0.0))
    target.apply(DraftVerified(1, 0))
    assert (target.num_placeholders, target.num_drafts, target.num_computed_tokens) == (0, 0, 4)


def test_a_preempted_request_settles_its_drafts_without_a_computed_count() -> None:
    target = _decoding()
    target.apply(SampleScheduled(1, 1, num_drafts=2))
    target.apply(Preempted())
    target.apply(TokenSampled(6, 0.0))
    target.apply(TokenSampled(7, 0.0))
    target.apply(DraftVerified(1, 1))
    assert (target.num_placeholders, target.num_computed_tokens) == (0, 0)


def test_a_discarded_row_with_drafts_drops_all_its_placeholders() -> None:
    target = _decoding()
    target.apply(SampleScheduled(1, 1))  # step 1: a plain row, discarded alone
    target.apply(Preempted())
    target.apply(SampleDiscarded(1))
    assert target.num_placeholders == 0
    other = _decoding()
    other.apply(SampleScheduled(1, 1, num_drafts=2))
    other.apply(Preempted())
    other.apply(SampleDiscarded(1))
    assert (other.num_placeholders, other.num_drafts) == (0, 0)


def test_a_row_with_drafts_is_not_discarded_once_its_tokens_arrive() -> None:
    """The scheduler either delivers a row's tokens or discards the row: a discard after a
    delivery would drop placeholders the row no longer holds (the request machine found
    it: three placeholders dropped of two)."""
    target = _decoding()
    target.apply(SampleScheduled(1, 1, num_drafts=2))
    target.apply(Preempted())
    target.apply(TokenSampled(6, 0.0))
    message = (
        "SampleDiscarded(step_id=1) drops the row verifying 2 drafts whole, 3 placeholders, "
        "but 2 are left: its tokens are being delivered"
    )
    with pytest.raises(InvalidTransition, match=re.escape(message)):
        target.apply(SampleDiscarded(1))
    assert (target.num_placeholders, target.num_drafts) == (2, 2)
    target.apply(TokenSampled(7, 0.0))
    target.apply(DraftVerified(1, 1))
    assert (target.num_placeholders, target.num_drafts) == (0, 0)


# --- the proposers --------------------------------------------------------------------------


def _latest_ngram(tokens: Sequence[int], low: int, high: int, wanted: int) -> tuple[int, ...]:
    """Prompt lookup by brute force."""
    for n in range(min(high, len(tokens)), low - 1, -1):
        suffix = list(tokens[-n:])
        for start in range(len(tokens) - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                return tuple(tokens[start + n : start + n + wanted])
    return ()


@given(
    st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(1, 6),
)
def test_prompt_lookup_is_the_latest_longest_match(
    pieces: list[list[int]], low: int, extra: int, wanted: int
) -> None:
    index = NgramIndex(low, low + extra)
    seen: list[int] = []
    for piece in pieces:  # fed in pieces, as tokens arrive
        index.extend(piece)
        seen.extend(piece)
        assert len(index) == len(seen)
        assert index.propose(wanted) == _latest_ngram(seen, low, low + extra, wanted)


def _counts(sequences: Sequence[Sequence[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for sequence in sequences:
        for start in range(len(sequence)):
            for end in range(start + 1, min(start + depth, len(sequence)) + 1):
                path = tuple(sequence[start:end])
                counts[path] = counts.get(path, 0) + 1
    return counts


@given(
    st.lists(st.lists(st.integers(0, 3), max_size=10), min_size=1, max_size=4),
    st.integers(2, 5),
    st.lists(st.integers(0, 3), max_size=6),
)
def test_the_suffix_trie_counts_every_path_and_proposes_the_most_frequent(
    sequences: list[list[int]], depth: int, context: list[int]
) -> None:
    trie = SuffixTrie(depth)
    for key, sequence in enumerate(sequences):
        half = len(sequence) // 2
        trie.extend(key, sequence[:half])
        trie.extend(key, sequence[half:])
        trie.close(key)
    counts = _counts(sequences, depth)
    assert trie.num_nodes == len(counts)
    draft = trie.propose(context, 3, 0.0)
    # The brute-force answer: the longest suffix with a continuation, then the most
    # frequent child each step (the trie's choice among equals may differ, but not its count).
    for length in range(min(len(context), depth - 1), 0, -1):
        suffix = tuple(context[len(context) - length :])
        children = {
            p[-1]: c for p, c in counts.items() if len(p) == length + 1 and p[:-1] == suffix
        }
        if children:
            assert draft.match_length == length
            assert children[draft.token_ids[0]] == max(children.values())
            break
    else:
        assert draft.token_ids == ()
        assert draft.match_length == 0
    for sequence in sequences:
        trie.remove(sequence)
    assert trie.num_nodes == 0


def test_the_suffix_trie_stops_at_rare_continuations() -> None:
    trie = SuffixTrie(4)
    for key, sequence in enumerate([[1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5, 6]]):
        trie.extend(key, sequence)
    assert trie.propose([1], 3, 0.0).token_ids == (2, 3)
    assert trie.propose([1], 3, 0.8).token_ids == ()  # 2 follows 1 in 3 of 4
    assert trie.propose([1], 3, 0.7).token_ids == (2,)  # 3 follows 1 2 in 2 of 3
    assert trie.propose([7], 3, 0.0).token_ids == ()


# --- adaptation and counters ----------------------------------------------------------------


@given(st.floats(0, 1), st.floats(0, 1), st.integers(1, MAX_SPECULATIVE_TOKENS))
def test_draft_length_grows_with_acceptance(a: float, b: float, most: int) -> None:
    low, high = sorted((a, b))
    assert 0 <= draft_length(low, most) <= draft_length(high, most) <= most
    assert draft_length(0.0, most) == 0
    assert draft_length(1.0, most) == most


def test_a_request_whose_drafts_fail_waits_longer_each_time() -> None:
    spec = SpeculativeConfig(method="ngram", prompt_lookup_min=1)
    speculator = Speculator(spec)
    tokens = [1, 2, 1, 2, 1, 2, 1]
    assert speculator.draft(0, tokens, 0, 5)  # starts hopeful: INITIAL_ACCEPTANCE
    for _ in range(4):
        speculator.verified(0, 5, 0)
    acceptance = speculator.acceptance(0)
    assert acceptance is not None
    assert acceptance < 0.2
    waited = 0
    while not speculator.draft(0, tokens, 0, 5):
        waited += 1
    assert waited >= PROBE_AFTER
    speculator.verified(0, 1, 1)  # the probe held: the wait resets once it pays again
    assert speculator.acceptance(1) is None
    speculator.verified(1, 2, 1)  # a request it does not know is counted, nothing more
    assert speculator.num_drafts == 6
    assert speculator.num_accepted_tokens == 2
    assert speculator.mean_acceptance_length() == pytest.approx(1 + 2 / 6)
    assert Speculator(spec).mean_acceptance_length() == 1.0


def test_without_adaptation_every_proposal_is_drafted_whole() -> None:
    speculator = Speculator(attrs.evolve(NGRAM, prompt_lookup_min=1, num_speculative_tokens=2))
    tokens = [3, 4, 5, 3, 4, 5, 3]
    for _ in range(3):
        speculator.verified(0, 2, 0) if speculator.draft(0, tokens, 0, 9) else None
    assert speculator.draft(0, tokens, 0, 9) == (4, 5)
    assert speculator.draft(0, tokens, 1, 9) == (5, 3)  # the first stands for the pending


def test_the_shared_trie_keeps_recent_outputs_within_its_bound() -> None:
    spec = SpeculativeConfig(method="suffix", suffix_max_depth=4, suffix_cache_tokens=6)
    speculator = Speculator(spec)
    assert speculator.draft(0, [1, 2], 0, 3) == ()
    speculator.finished(0, [7, 8, 9, 7])
    assert speculator.num_trie_nodes > 0
    assert speculator.draft(1, [5, 7], 0, 3) == (8, 9, 7)  # from request 0's output
    assert speculator.draft(1, [5, 7, 8], 1, 3) == (7,)  # 9 stands for the pending token
    speculator.finished(1, [])
    speculator.finished(2, [1, 1, 1, 1])  # 8 tokens kept > 6: request 0's leave
    assert speculator.draft(3, [5, 7], 0, 3) == ()
    assert speculator.num_trie_nodes <= 6 * 4 + len([5, 7]) * 4
    none = Speculator(attrs.evolve(spec, suffix_cache_tokens=0))
    none.finished(0, [7, 8, 9])
    assert none.num_trie_nodes == 0
    assert Speculator(NGRAM).num_trie_nodes == 0


def test_statistics_add_up_position_by_position() -> None:
    sched = scheduler(perfect)
    sched.add_request(request())
    kv = SimulatedKV(32, 4)
    while not sched.is_idle():
        step(sched, kv)
    stats = sched.statistics()
    both = total(SchedulerStatistics, [stats, stats])
    assert both.spec_decode_accepted_tokens_per_pos == tuple(
        2 * n for n in stats.spec_decode_accepted_tokens_per_pos
    )
    assert both.num_spec_decode_drafts == 2 * stats.num_spec_decode_drafts
    assert total(SchedulerStatistics, []).spec_decode_mean_acceptance_length == 1.0


# --- configuration --------------------------------------------------------------------------


def test_speculative_config_from_a_mapping_and_its_errors() -> None:
    assert speculative_config(None) is None
    assert speculative_config(NGRAM) is NGRAM
    made = speculative_config({"method": "suffix", "num_speculative_tokens": 3})
    assert made == SpeculativeConfig(method="suffix", num_speculative_tokens=3)
    with pytest.raises(TypeError, match="has no field 'k'; its fields are method, "):
        speculative_config({"method": "ngram", "k": 3})
    with pytest.raises(TypeError, match='needs "method"'):
        speculative_config({"num_speculative_tokens": 3})
    with pytest.raises(TypeError, match="must be a SpeculativeConfig, a mapping"):
        speculative_config("ngram")
    with pytest.raises(ValueError, match="method must be"):
        speculative_config({"method": "eagle"})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 16\], got 17"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=17)
    with pytest.raises(ValueError, match="prompt_lookup_max must be >= prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=3)
    # The n-gram index holds every length up to the longest for every token: its memory
    # grows with that length squared (100,000 on a 700-token prompt was +457 MiB).
    with pytest.raises(
        ValueError,
        match=r"prompt_lookup_max must be in \[1, 16\] \(the n-gram index holds every length "
        r"up to it for each token: memory grows with its square\), got 100000",
    ):
        speculative_config({"method": "ngram", "prompt_lookup_max": 100_000})
    with pytest.raises(ValueError, match=r"prompt_lookup_min must be in \[1, 16\]"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=17, prompt_lookup_max=16)
    longest = SpeculativeConfig(method="ngram", prompt_lookup_min=16, prompt_lookup_max=16)
    assert longest.prompt_lookup_max == MAX_PROMPT_LOOKUP == 16
    config = SchedulerConfig(num_blocks=4, speculative_config={"method": "ngram"})
    assert config.speculative_config == SpeculativeConfig(method="ngram")
    made_here = Scheduler(config).speculator
    assert made_here is not None
    assert made_here.config == config.speculative_config
    assert Scheduler(SchedulerConfig(num_blocks=4)).speculator is None


def test_verify_draft_counts_the_leading_matches() -> None:
    assert verify_draft((1, 2, 3), (1, 2, 4, 9)) == 2
    assert verify_draft((), (5,)) == 0
    assert verify_draft((1,), (2, 1)) == 0
    output = RunnerOutput(
        0,
        {3: 1},
        {3: TokenLogprobs(1, -0.5)},
        speculated={3: (2,)},
        speculated_logprobs={3: (TokenLogprobs(2, -0.1),)},
    )
    assert output.tokens(3) == (1, 2)
    assert [entry.token_id for entry in output.token_logprobs(3)] == [1, 2]
    assert RunnerOutput(0, {3: 1}).token_logprobs(3) == ()
