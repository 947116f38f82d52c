"""A constrained request owns its matcher: attached by an event, advanced only by ``apply``."""

from __future__ import annotations

import re

import pytest

from twostroke.states.constraints import Choice, Matcher
from twostroke.states.errors import InvalidTransition
from twostroke.states.params import SamplingParams
from twostroke.states.request import (
    Admitted,
    ConstraintCompiled,
    FinishReason,
    Preempted,
    Request,
    RequestStatus,
    SampleScheduled,
    TokenSampled,
)
from twostroke.states.testing import ReferenceMatcher

VOCABULARY = ["a", "b", "c", "<eos>"]
EOS = 3
YES = Choice(["ab"])


def _matcher() -> ReferenceMatcher:
    return ReferenceMatcher(YES, VOCABULARY, [EOS])


def _waiting(constraint: Choice | None = YES) -> Request:
    params = SamplingParams(max_tokens=8, constraint=constraint)
    return Request(5, (0, 1), params, 0.0, frozenset({EOS}))


def _sampling(matcher: Matcher | None = None) -> Request:
    """A constrained request with its matcher and one sample in flight."""
    request = _waiting()
    request.apply(ConstraintCompiled(matcher or _matcher()))
    request.apply(Admitted(1.0))
    request.apply(SampleScheduled(0, 2))
    return request


def _refused(request: Request, event: ConstraintCompiled | Admitted, rule: str) -> None:
    status, matcher = request.status, request.matcher
    with pytest.raises(InvalidTransition, match=f"^{re.escape(f'request 5: {rule}')}$") as caught:
        request.apply(event)
    assert caught.value.rule == rule
    assert (request.status, request.matcher) == (status, matcher)


# --- attaching it -----------------------------------------------------------------------------


def test_a_waiting_constrained_request_takes_its_matcher_once() -> None:
    request = _waiting()
    assert request.matcher is None
    matcher = _matcher()
    assert request.apply(ConstraintCompiled(matcher)) is RequestStatus.WAITING
    assert request.matcher is matcher
    rule = "ConstraintCompiled came before: the request has its matcher"
    _refused(request, ConstraintCompiled(_matcher()), rule)


def test_only_a_constrained_request_takes_a_matcher_and_only_at_its_start() -> None:
    rule = "ConstraintCompiled needs a constraint, and params.constraint is None"
    _refused(_waiting(None), ConstraintCompiled(_matcher()), rule)
    used = _matcher()
    assert used.advance(0)
    rule = "ConstraintCompiled must bring a matcher at its start, got one 1 tokens in"
    _refused(_waiting(), ConstraintCompiled(used), rule)


def test_a_running_request_takes_no_matcher() -> None:
    request = _sampling()
    message = "request 5: status DECODING does not accept event ConstraintCompiled"
    with pytest.raises(InvalidTransition, match=f"^{message}$"):
        request.apply(ConstraintCompiled(_matcher()))


def test_a_constrained_request_is_not_admitted_without_its_matcher() -> None:
    rule = "Admitted before ConstraintCompiled: a constrained request needs its matcher"
    _refused(_waiting(), Admitted(1.0), rule)
    assert _waiting(None).apply(Admitted(1.0)) is RequestStatus.PREFILLING


def test_the_matcher_is_not_an_attribute_to_set() -> None:
    request = _waiting()
    with pytest.raises(AttributeError):
        request.matcher = _matcher()  # type: ignore[misc]
    with pytest.raises(TypeError, match="matcher"):
        Request(5, (0,), SamplingParams(constraint=YES), 0.0, matcher=_matcher())  # type: ignore[call-arg]


# --- advancing it -----------------------------------------------------------------------------


def test_a_sampled_token_advances_the_matcher_inside_apply() -> None:
    request = _sampling()
    assert request.apply(TokenSampled(0, 2.0)) is RequestStatus.DECODING
    assert request.matcher is not None
    assert request.matcher.num_tokens == 1
    assert request.output_token_ids == (0,)
    assert request.finish_reached() is None
    request.apply(SampleScheduled(1, 1))
    request.apply(TokenSampled(1, 3.0))
    assert request.finish_reached() is not None  # "ab" is complete, without EOS


def test_a_token_the_constraint_refuses_fails_the_request_through_the_table() -> None:
    request = _sampling()
    assert request.apply(TokenSampled(2, 2.0)) is RequestStatus.FAILED
    assert request.failure == "the constraint does not allow token 2 here"
    assert request.output_token_ids == ()
    assert request.matcher is not None
    assert request.matcher.num_tokens == 0
    assert (request.block_table, request.end_time) == ((), 2.0)


def test_a_preempted_request_fails_on_a_refused_token_too() -> None:
    request = _sampling()
    request.apply(Preempted())
    assert request.apply(TokenSampled(EOS, 2.0)) is RequestStatus.FAILED
    assert request.failure == f"the constraint does not allow token {EOS} here"


def test_a_token_the_matcher_does_not_take_is_not_advanced_past() -> None:
    """An event ``apply`` refuses never reaches the matcher: it is checked first."""
    request = _sampling()
    request.apply(TokenSampled(0, 2.0))
    with pytest.raises(InvalidTransition, match="has no placeholder to fill"):
        request.apply(TokenSampled(1, 3.0))
    assert request.matcher is not None
    assert request.matcher.num_tokens == 1


class _DeadEnd:
    """A matcher that takes any token and then has nowhere to go."""

    vocab_size = 4
    num_tokens = 0
    accepting = False
    terminated = False

    def advance(self, token_id: int) -> bool:
        self.num_tokens += 1
        self.terminated = True
        return True

    def allowed_token_ids(self) -> frozenset[int]:
        return frozenset()

    def fill_bitmask(self, row: memoryview) -> None:
        raise NotImplementedError

    def fork(self) -> _DeadEnd:
        raise NotImplementedError


class _Broken(_DeadEnd):
    def advance(self, token_id: int) -> bool:
        raise RuntimeError("lexer fuel exhausted")


def test_a_dead_end_fails_the_request() -> None:
    request = _sampling(_DeadEnd())
    assert request.apply(TokenSampled(0, 2.0)) is RequestStatus.FAILED
    assert request.failure == (
        "the constraint reached a dead end: no token of the vocabulary continues it"
    )
    assert request.output_token_ids == ()


def test_a_matcher_that_raises_fails_the_request_with_its_message() -> None:
    request = _sampling(_Broken())
    assert request.apply(TokenSampled(0, 2.0)) is RequestStatus.FAILED
    assert request.failure == "the constraint failed: lexer fuel exhausted"


class _AnswersOnce(_DeadEnd):
    """A matcher that completes the output with its first token and says so once: asked
    again where it is (a backend whose state read fails the second time), it raises."""

    def __init__(self) -> None:
        self._reads = 0

    def advance(self, token_id: int) -> bool:
        self.num_tokens += 1
        return True

    def _read(self) -> bool:
        self._reads += 1
        if self._reads > 2:  # terminated, then accepting: once each
            raise RuntimeError("asked twice")
        return True

    @property
    def terminated(self) -> bool:  # type: ignore[override]
        return self._read()

    @property
    def accepting(self) -> bool:  # type: ignore[override]
        return self._read()


def test_where_the_matcher_is_is_read_once_a_token_under_the_net() -> None:
    """``finish_reached`` uses what ``apply`` read from the matcher inside its net, so a
    matcher is never asked outside it (where its exception would end the engine's step)."""
    request = _sampling(_AnswersOnce())
    assert request.apply(TokenSampled(0, 2.0)) is RequestStatus.DECODING
    assert request.finish_reached() is FinishReason.STOP
    assert request.finish_reached() is FinishReason.STOP
