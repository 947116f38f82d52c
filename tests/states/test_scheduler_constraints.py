"""The scheduler with constrained requests: their tokens advance their matchers (inside
``Request.apply``), and a request its constraint stops or fails ends as any other."""

from __future__ import annotations

import re
from typing import cast

import pytest

from twostroke.states.constraints import Choice, Matcher, Regex
from twostroke.states.errors import SchedulerError
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput
from twostroke.states.request import ConstraintCompiled, FinishReason, Request, RequestStatus
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.testing import ReferenceMatcher

VOCABULARY = ["a", "b", "c", "<eos>"]
EOS = 3


def _scheduler() -> Scheduler:
    config = SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32, pipeline_depth=1)
    return Scheduler(config, clock=lambda: 0.0)


def _request(matcher: ReferenceMatcher | object, request_id: int = 0) -> Request:
    constraint = getattr(matcher, "constraint", Choice(["ab"]))
    request = Request(
        request_id,
        (0, 1),
        SamplingParams(max_tokens=8, constraint=constraint),
        0.0,
        frozenset({EOS}),
    )
    request.apply(ConstraintCompiled(cast(Matcher, matcher)))
    return request


def _step(scheduler: Scheduler, token_id: int) -> tuple[list[int], list[tuple[int, FinishReason]]]:
    plan = scheduler.schedule()
    assert plan is not None
    report = scheduler.apply(RunnerOutput(plan.step_id, {0: token_id}))
    return list(report.failed), list(report.finished)


def test_a_complete_choice_finishes_with_stop_without_eos() -> None:
    scheduler = _scheduler()
    request = _request(ReferenceMatcher(Choice(["ab"]), VOCABULARY, [EOS]))
    scheduler.add_request(request)
    assert _step(scheduler, 0) == ([], [])
    assert _step(scheduler, 1) == ([], [(0, FinishReason.STOP)])
    assert request.output_token_ids == (0, 1)


def test_eos_finishes_a_constrained_request_even_with_ignore_eos() -> None:
    scheduler = _scheduler()
    matcher = ReferenceMatcher(Regex("a+"), VOCABULARY, [EOS])
    request = Request(
        0,
        (0,),
        SamplingParams(max_tokens=8, ignore_eos=True, constraint=Regex("a+")),
        0.0,
        frozenset({EOS}),
    )
    request.apply(ConstraintCompiled(matcher))
    scheduler.add_request(request)
    assert _step(scheduler, 0) == ([], [])
    assert _step(scheduler, EOS) == ([], [(0, FinishReason.STOP)])


def test_a_discarded_lookahead_sample_never_reaches_the_matcher() -> None:
    """The request that finishes at step N was given a sample in step N+1 already: that token
    is dropped, so the matcher has nothing to undo."""
    config = SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32, pipeline_depth=2)
    scheduler = Scheduler(config, clock=lambda: 0.0)
    matcher = ReferenceMatcher(Choice(["ab"]), VOCABULARY, [EOS])
    request = _request(matcher)
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert first is not None
    assert second is not None
    scheduler.apply(RunnerOutput(first.step_id, {0: 0}))
    third = scheduler.schedule()
    assert third is not None
    assert third.request_ids == (0,)  # "b" is in flight: the lookahead samples once more
    report = scheduler.apply(RunnerOutput(second.step_id, {0: 1}))
    assert report.finished == ((0, FinishReason.STOP),)
    report = scheduler.apply(RunnerOutput(third.step_id, {0: EOS}))
    assert report.new_tokens == ()
    assert request.output_token_ids == (0, 1)
    assert matcher.num_tokens == 2
    assert matcher.text == "ab"
    assert scheduler.is_idle()


def test_a_token_the_constraint_refuses_fails_the_request_and_is_not_delivered() -> None:
    scheduler = _scheduler()
    request = _request(ReferenceMatcher(Choice(["ab"]), VOCABULARY, [EOS]))
    scheduler.add_request(request)
    assert _step(scheduler, 2) == ([0], [])
    assert request.status is RequestStatus.FAILED
    assert request.failure == "the constraint does not allow token 2 here"
    assert request.output_token_ids == ()
    scheduler.check_invariants()


def test_a_constrained_request_is_queued_only_with_its_matcher() -> None:
    scheduler = _scheduler()
    params = SamplingParams(max_tokens=8, constraint=Choice(["ab"]))
    request = Request(0, (0, 1), params, 0.0, frozenset({EOS}))
    scheduler.check_request(request)  # the engine asks before it compiles the constraint
    message = (
        "request 0 has a constraint but no matcher: apply ConstraintCompiled before queueing it"
    )
    with pytest.raises(SchedulerError, match=f"^{re.escape(message)}$"):
        scheduler.add_request(request)
    assert scheduler.is_idle()
    request.apply(ConstraintCompiled(ReferenceMatcher(Choice(["ab"]), VOCABULARY, [EOS])))
    scheduler.add_request(request)
    assert scheduler.get(0) is request


class _DeadEnd:
    """A matcher that takes any token and then has nowhere to go."""

    vocab_size = 4
    num_tokens = 0
    accepting = False
    terminated = True

    def advance(self, token_id: int) -> bool:
        return True


class _Broken(_DeadEnd):
    def advance(self, token_id: int) -> bool:
        raise RuntimeError("lexer fuel exhausted")


def test_a_dead_end_fails_the_request() -> None:
    scheduler = _scheduler()
    request = _request(_DeadEnd())
    scheduler.add_request(request)
    assert _step(scheduler, 0) == ([0], [])
    assert request.failure == (
        "the constraint reached a dead end: no token of the vocabulary continues it"
    )


def test_a_matcher_that_raises_fails_only_its_request() -> None:
    scheduler = _scheduler()
    request = _request(_Broken())
    scheduler.add_request(request)
    assert _step(scheduler, 0) == ([0], [])
    assert request.failure == "the constraint failed: lexer fuel exhausted"


def test_fail_ends_a_live_request_once() -> None:
    scheduler = _scheduler()
    request = _request(ReferenceMatcher(Choice(["ab"]), VOCABULARY, [EOS]))
    scheduler.add_request(request)
    assert scheduler.schedule() is not None
    assert scheduler.fail(0, "the mask could not be computed")
    assert request.status is RequestStatus.FAILED
    assert request.failure == "the mask could not be computed"
    assert not scheduler.fail(0, "again")
    assert not scheduler.fail(99, "unknown")
    scheduler.check_invariants()
    scheduler.apply(RunnerOutput(0, {0: 0}))
    assert scheduler.is_idle()


def test_toy_choose_picks_an_allowed_token_or_falls_back_at_a_dead_end() -> None:
    from twostroke.states.simulation import toy_choose, toy_next_token

    assert toy_choose([1, 2, 3], frozenset({5, 9})) in {5, 9}
    assert toy_choose([1, 2, 3], frozenset()) == toy_next_token([1, 2, 3])


def test_the_reference_follows_a_constraint_to_stop_or_to_a_dead_end() -> None:
    from twostroke.states.simulation import reference_output

    params = SamplingParams(max_tokens=8, constraint=Choice(["ab"]))
    matcher = ReferenceMatcher(Choice(["ab"]), VOCABULARY, [EOS])
    assert reference_output([0], params, matcher=matcher) == ([0, 1], "stop")
    # "b" is EOS here, so "ab" cannot be spelled: "a" leads to a dead end, and is refused.
    dead = ReferenceMatcher(Choice(["ab"]), VOCABULARY, [1, EOS])
    assert reference_output([0], params, matcher=dead) == ([], "failed")
    # A regex that accepts and goes on: EOS or the length ends it.
    open_ended = ReferenceMatcher(Regex("a*"), VOCABULARY, [EOS])
    output, reason = reference_output([0], params, matcher=open_ended, eos_token_ids={EOS})
    assert set(output) <= {0, EOS}
    assert reason in {"stop", "length"}
