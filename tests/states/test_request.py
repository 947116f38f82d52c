"""The request state machine: a stateful test against a hand-written table, and unit tests."""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from twostroke.states.errors import EngineError, InvalidTransition
from twostroke.states.params import SamplingParams
from twostroke.states.request import (
    TERMINAL,
    TRANSITIONS,
    Admitted,
    BlocksAllocated,
    BlocksReleased,
    Cancelled,
    ChunkScheduled,
    ConstraintCompiled,
    DraftVerified,
    Failed,
    Finished,
    FinishReason,
    Preempted,
    PrefixCacheHit,
    Request,
    RequestEvent,
    RequestStatus,
    SampleDiscarded,
    SampleScheduled,
    TokenSampled,
    mermaid_diagram,
)
from twostroke.states.testing import RequestMachine

DOCS = pathlib.Path(__file__).parents[2] / "docs" / "states.md"

# The lifecycle as the design states it, written out by hand (h11 style): the machine below
# checks ``Request.apply`` against this copy, so a change to ``TRANSITIONS`` must be made
# here too, on purpose.
LIFECYCLE = {
    "WAITING": {
        "ConstraintCompiled": "WAITING",
        "Admitted": "PREFILLING",
        "Cancelled": "CANCELLED",
        "Failed": "FAILED",
    },
    "PREFILLING": {
        "PrefixCacheHit": "PREFILLING",
        "BlocksAllocated": "PREFILLING",
        "BlocksReleased": "PREFILLING",
        "ChunkScheduled": "PREFILLING",
        "SampleScheduled": "DECODING",
        "Preempted": "PREEMPTED",
        "Cancelled": "CANCELLED",
        "Failed": "FAILED",
    },
    "DECODING": {
        "BlocksAllocated": "DECODING",
        "BlocksReleased": "DECODING",
        "SampleScheduled": "DECODING",
        "TokenSampled": "DECODING",
        "DraftVerified": "DECODING",
        "Preempted": "PREEMPTED",
        "Finished": "FINISHED",
        "Cancelled": "CANCELLED",
        "Failed": "FAILED",
    },
    "PREEMPTED": {
        "Admitted": "PREFILLING",
        "TokenSampled": "PREEMPTED",
        "SampleDiscarded": "PREEMPTED",
        "DraftVerified": "PREEMPTED",
        "Finished": "FINISHED",
        "Cancelled": "CANCELLED",
        "Failed": "FAILED",
    },
    "FINISHED": {},
    "CANCELLED": {},
    "FAILED": {},
}
Table = Mapping[RequestStatus, Mapping[type[RequestEvent], RequestStatus]]
EVENTS: dict[str, type[RequestEvent]] = {
    kind.__name__: kind
    for kind in (
        ConstraintCompiled,
        Admitted,
        PrefixCacheHit,
        BlocksAllocated,
        BlocksReleased,
        ChunkScheduled,
        SampleScheduled,
        TokenSampled,
        SampleDiscarded,
        DraftVerified,
        Preempted,
        Finished,
        Cancelled,
        Failed,
    )
}


class HandWrittenLifecycle(RequestMachine):
    reference_transitions: ClassVar[Table] = {
        RequestStatus[status]: {EVENTS[event]: RequestStatus[to] for event, to in row.items()}
        for status, row in LIFECYCLE.items()
    }


TestRequestLifecycle = HandWrittenLifecycle.TestCase


def test_the_table_is_the_hand_written_lifecycle() -> None:
    as_names = {
        str(status): {kind.__name__: str(to) for kind, to in row.items()}
        for status, row in TRANSITIONS.items()
    }
    assert as_names == LIFECYCLE
    assert {str(status) for status in TERMINAL} == {"FINISHED", "CANCELLED", "FAILED"}


# --- helpers ----------------------------------------------------------------------------------


def new_request(prompt: int = 3, **params: int) -> Request:
    return Request(7, list(range(prompt)), SamplingParams(**params), arrival_time=0.0)


def decoding(prompt: int = 3) -> Request:
    """A request with one output token and one sample in flight, holding two blocks."""
    request = new_request(prompt)
    request.apply(Admitted(1.0))
    request.apply(BlocksAllocated((4, 5)))
    request.apply(SampleScheduled(0, prompt))
    request.apply(TokenSampled(11, 2.0))
    request.apply(SampleScheduled(1, 1))
    return request


def in_status(status: RequestStatus) -> Request:
    request = decoding()
    paths: dict[RequestStatus, list[RequestEvent]] = {
        RequestStatus.WAITING: [],
        RequestStatus.PREFILLING: [Admitted(1.0)],
        RequestStatus.DECODING: [],
        RequestStatus.PREEMPTED: [Preempted()],
        RequestStatus.FINISHED: [Finished(FinishReason.LENGTH, 3.0)],
        RequestStatus.CANCELLED: [Cancelled(3.0)],
        RequestStatus.FAILED: [Failed("boom", 3.0)],
    }
    if status in (RequestStatus.WAITING, RequestStatus.PREFILLING):
        request = new_request()
    for event in paths[status]:
        request.apply(event)
    assert request.status is status
    return request


def state(request: Request) -> tuple[object, ...]:
    return (
        request.status,
        request.output_token_ids,
        request.block_table,
        request.num_computed_tokens,
        request.num_placeholders,
        request.last_step_id,
        request.finish_reason,
        request.failure,
        request.num_preemptions,
        request.first_scheduled_time,
        request.first_token_time,
        request.last_token_time,
        request.end_time,
    )


ONE_OF_EACH: list[RequestEvent] = [
    Admitted(9.0),
    BlocksAllocated((1,)),
    ChunkScheduled(5, 1),
    SampleScheduled(5, 1),
    TokenSampled(3, 9.0),
    Preempted(),
    Finished(FinishReason.STOP, 9.0),
    Cancelled(9.0),
    Failed("late", 9.0),
]


# --- refusals ---------------------------------------------------------------------------------


def test_invalid_event_names_request_status_and_event_and_changes_nothing() -> None:
    request = new_request()
    before = state(request)
    message = "request 7: status WAITING does not accept event TokenSampled"
    with pytest.raises(InvalidTransition, match=f"^{message}$") as caught:
        request.apply(TokenSampled(1, 1.0))
    assert caught.value.request_id == 7
    assert caught.value.status is RequestStatus.WAITING
    assert caught.value.event == TokenSampled(1, 1.0)
    assert isinstance(caught.value, EngineError)
    assert state(request) == before


@pytest.mark.parametrize("status", sorted(TERMINAL, key=str), ids=str)
@pytest.mark.parametrize("event", ONE_OF_EACH, ids=lambda e: type(e).__name__)
def test_terminal_statuses_accept_nothing(status: RequestStatus, event: RequestEvent) -> None:
    request = in_status(status)
    before = state(request)
    assert not request.accepts(event)
    with pytest.raises(InvalidTransition, match=f"status {status} does not accept event"):
        request.apply(event)
    assert state(request) == before
    assert request.block_table == ()


@pytest.mark.parametrize(
    ("event", "rule"),
    [
        (ChunkScheduled(1, 0), "ChunkScheduled(num_tokens=0) must compute at least 1 token"),
        (SampleScheduled(1, 0), "SampleScheduled(num_tokens=0) must compute at least 1 token"),
        (ChunkScheduled(1, 4), "ChunkScheduled(num_tokens=4) exceeds the 3 tokens left to compute"),
        (
            SampleScheduled(1, 9),
            "SampleScheduled(num_tokens=9) exceeds the 3 tokens left to compute",
        ),
        (
            ChunkScheduled(1, 3),
            "ChunkScheduled(num_tokens=3) reaches the last of the 3 tokens left, so it must sample",
        ),
        (
            SampleScheduled(1, 2),
            "SampleScheduled(num_tokens=2) stops short of the 3 tokens left, so it may not sample",
        ),
    ],
)
def test_events_the_counts_do_not_allow_are_refused_naming_the_rule(
    event: RequestEvent, rule: str
) -> None:
    request = new_request(prompt=3)
    request.apply(Admitted(1.0))
    before = state(request)
    with pytest.raises(InvalidTransition, match=f"^{re.escape(f'request 7: {rule}')}$") as caught:
        request.apply(event)
    assert (caught.value.status, caught.value.event, caught.value.rule) == (
        RequestStatus.PREFILLING,
        event,
        rule,
    )
    assert state(request) == before


def test_the_count_rule_names_what_is_left_after_earlier_chunks() -> None:
    request = new_request(prompt=10)
    request.apply(Admitted(1.0))
    request.apply(ChunkScheduled(0, 3))
    message = "request 7: ChunkScheduled(num_tokens=9) exceeds the 7 tokens left to compute"
    with pytest.raises(InvalidTransition, match=f"^{re.escape(message)}$"):
        request.apply(ChunkScheduled(1, 9))


def test_a_token_without_a_placeholder_is_refused() -> None:
    request = decoding()
    request.apply(TokenSampled(12, 3.0))
    before = state(request)
    message = (
        "request 7: TokenSampled(token_id=13) has no placeholder to fill: "
        "no step in flight samples for this request"
    )
    with pytest.raises(InvalidTransition, match=f"^{re.escape(message)}$") as caught:
        request.apply(TokenSampled(13, 4.0))
    assert caught.value.rule is not None
    assert state(request) == before


def test_a_discarded_sample_drops_the_placeholder_and_needs_one() -> None:
    request = decoding()  # one output token, one sample in flight
    request.apply(Preempted())
    assert request.num_placeholders == 1
    request.apply(SampleDiscarded(1))
    assert request.num_placeholders == 0
    assert request.output_token_ids == (11,)  # the discarded token never arrives
    assert request.status is RequestStatus.PREEMPTED
    before = state(request)
    message = (
        "request 7: SampleDiscarded(step_id=2) has no placeholder to drop: "
        "no step in flight samples for this request"
    )
    with pytest.raises(InvalidTransition, match=f"^{re.escape(message)}$"):
        request.apply(SampleDiscarded(2))
    assert state(request) == before


def test_a_table_miss_has_no_count_rule() -> None:
    request = decoding()
    message = "request 7: status DECODING does not accept event Admitted"
    with pytest.raises(InvalidTransition, match=f"^{message}$") as caught:
        request.apply(Admitted(5.0))
    assert caught.value.rule is None


# --- the lifecycle ------------------------------------------------------------------------------


def test_a_request_goes_through_its_life_and_finishes_with_a_reason() -> None:
    request = new_request(prompt=5, max_tokens=4)
    assert request.apply(Admitted(1.0)) is RequestStatus.PREFILLING
    request.apply(BlocksAllocated((0,)))
    assert request.last_step_id is None
    assert request.apply(ChunkScheduled(0, 2)) is RequestStatus.PREFILLING
    assert request.last_step_id == 0
    request.apply(BlocksAllocated((1,)))
    assert request.apply(SampleScheduled(1, 3)) is RequestStatus.DECODING
    assert request.last_step_id == 1
    assert (request.num_tokens, request.num_computed_tokens, request.num_placeholders) == (6, 5, 1)
    assert request.apply(TokenSampled(42, 2.5)) is RequestStatus.DECODING
    assert request.output_token_ids == (42,)
    assert request.token_ids(3, 6) == (3, 4, 42)
    assert repr(request) == "<Request 7 DECODING 1/4 tokens, 2 blocks>"
    assert request.finish_reason is None
    assert request.apply(Finished(FinishReason.STOP, 3.0)) is RequestStatus.FINISHED
    assert request.finish_reason is FinishReason.STOP
    assert str(request.finish_reason) == "stop"
    assert request.block_table == ()
    assert (request.first_scheduled_time, request.first_token_time) == (1.0, 2.5)
    assert (request.last_token_time, request.end_time) == (2.5, 3.0)
    assert repr(request) == "<Request 7 FINISHED 1/4 tokens, 0 blocks>"


def test_preemption_keeps_tokens_and_placeholders_and_drops_kv() -> None:
    request = decoding()
    assert request.apply(Preempted()) is RequestStatus.PREEMPTED
    assert (request.num_computed_tokens, request.block_table) == (0, ())
    assert (request.num_placeholders, request.output_token_ids) == (1, (11,))
    # The step in flight still delivers its token to the preempted request ...
    assert request.apply(TokenSampled(12, 4.0)) is RequestStatus.PREEMPTED
    # ... and readmission recomputes everything known.
    assert request.apply(Admitted(5.0)) is RequestStatus.PREFILLING
    assert request.first_scheduled_time == 1.0
    request.apply(SampleScheduled(2, request.num_tokens))
    assert request.num_preemptions == 1


def test_failure_keeps_its_message() -> None:
    request = in_status(RequestStatus.FAILED)
    assert request.failure == "boom"
    assert request.finish_reason is None


def output(request: Request, *token_ids: int) -> FinishReason | None:
    """Sample ``token_ids`` into ``request`` one by one; what ``finish_reached`` says then."""
    if request.status is RequestStatus.WAITING:
        request.apply(Admitted(0.0))
    for token_id in token_ids:
        request.apply(SampleScheduled(0, request.num_tokens - request.num_computed_tokens))
        request.apply(TokenSampled(token_id, 1.0))
    return request.finish_reached()


@pytest.mark.parametrize(
    ("params", "tokens", "reason"),
    [
        # min_tokens=1: a stop id or EOS as the first token does not stop; as the second does
        ({"min_tokens": 1, "stop_token_ids": [5]}, [5], None),
        ({"min_tokens": 1, "stop_token_ids": [5]}, [9], None),
        ({"min_tokens": 1, "stop_token_ids": [5]}, [3, 5], FinishReason.STOP),
        ({"min_tokens": 1, "stop_token_ids": [5]}, [3, 9], FinishReason.STOP),
        ({"min_tokens": 1, "stop_token_ids": [5]}, [3, 3], None),
        ({"ignore_eos": True}, [9], None),
        ({"ignore_eos": True, "stop_token_ids": [9]}, [9], FinishReason.STOP),
        # the length: at max_tokens, unless the last token stops it
        ({"max_tokens": 2}, [3], None),
        ({"max_tokens": 2}, [3, 3], FinishReason.LENGTH),
        ({"max_tokens": 2}, [3, 9], FinishReason.STOP),
        ({"max_tokens": 2, "min_tokens": 2}, [3, 9], FinishReason.LENGTH),
        ({"max_tokens": 2, "ignore_eos": True}, [3, 9], FinishReason.LENGTH),
    ],
)
def test_finish_reached_honours_min_tokens_ignore_eos_stop_ids_and_max_tokens(
    params: dict[str, Any], tokens: list[int], reason: FinishReason | None
) -> None:
    request = Request(1, [1, 2], SamplingParams(**params), arrival_time=0.0, eos_token_ids=[9])
    assert request.finish_reached() is None
    assert output(request, *tokens) is reason


def test_max_tokens_is_the_params_number_or_the_one_given() -> None:
    assert Request(1, [1, 2], SamplingParams(max_tokens=3), arrival_time=0.0).max_tokens == 3
    context = SamplingParams(max_tokens=None)  # as many as the context leaves
    message = "max_tokens must be given when params.max_tokens is None"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        Request(1, [1, 2], context, arrival_time=0.0)
    request = Request(1, [1, 2], context, arrival_time=0.0, max_tokens=2)
    assert repr(request) == "<Request 1 WAITING 0/2 tokens, 0 blocks>"
    assert output(request, 3) is None
    assert output(request, 3) is FinishReason.LENGTH


# --- the diagram ------------------------------------------------------------------------------


def test_the_diagram_draws_every_transition_and_nothing_else() -> None:
    lines = mermaid_diagram().splitlines()
    assert lines[0] == "stateDiagram-v2"
    drawn: dict[str, dict[str, str]] = {str(status): {} for status in RequestStatus}
    for line in lines[1:]:
        source, _, rest = line.strip().partition(" --> ")
        target, _, events = rest.partition(": ")
        if "[*]" in (source, target):
            continue
        for event in events.split(", "):
            drawn[source][event] = target
    assert drawn == LIFECYCLE
    assert "    [*] --> WAITING" in lines
    assert sorted(line for line in lines if line.endswith("--> [*]")) == [
        "    CANCELLED --> [*]",
        "    FAILED --> [*]",
        "    FINISHED --> [*]",
    ]


def test_the_docs_show_the_diagram_of_the_code() -> None:
    blocks = re.findall(r"```mermaid\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.DOTALL)
    # The request lifecycle comes first; the block lifecycle (tests/states/test_blocks.py)
    # second.
    assert len(blocks) == 2, "docs/states.md must hold exactly two mermaid blocks"
    assert blocks[0].rstrip("\n") == mermaid_diagram(), (
        "docs/states.md is out of date: paste the output of "
        "twostroke.states.request.mermaid_diagram() into its mermaid block"
    )


@pytest.mark.parametrize("status", list(RequestStatus), ids=str)
def test_accepts_reads_the_table(status: RequestStatus) -> None:
    request = in_status(status)
    accepted = {type(event) for event in ONE_OF_EACH if request.accepts(event)}
    assert accepted == set(TRANSITIONS[status]) & {type(event) for event in ONE_OF_EACH}
    assert accepted or status in TERMINAL
