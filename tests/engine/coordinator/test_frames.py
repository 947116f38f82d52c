"""The wire: frames survive any chunking, and bad bytes fail with what was wrong."""

from __future__ import annotations

import re
import typing
from typing import Any

import attrs
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.engine.coordinator.frames import (
    MAX_FRAME_BYTES,
    Accepted,
    Add,
    DefineConstraint,
    DeltaItem,
    Deltas,
    Failed,
    Finished,
    FinishedPart,
    ForgetConstraint,
    FrameDecoder,
    FrameError,
    FromReplica,
    Ready,
    Rejected,
    Reply,
    Stats,
    ToReplica,
    WireConstraint,
    WireFinishReason,
    encode_frame,
    estimate_prompt_tokens,
    routing_key,
    wire_prompt,
)
from twostroke.engine.coordinator.statistics import engine_statistics
from twostroke.engine.coordinator.wire_constraints import (
    constraint_from_wire,
    params_from_wire,
    wire_constraint,
    wire_params,
)
from twostroke.engine.coordinator.wire_outputs import (
    Ending,
    call_error,
    delta_from_item,
    delta_item,
    ending_from_finished,
    failed_frame,
    finished_frame,
    logprobs_from_wire,
    rejected_frame,
    rejection_error,
    request_error,
    wire_logprobs,
)
from twostroke.engine.errors import (
    ConstraintFailed,
    EngineDead,
    EngineError,
    EngineOverloaded,
    RequestCancelled,
    RequestFailed,
    RequestRejected,
)
from twostroke.engine.outputs import Delta, RequestMetrics, RequestOutput, Usage
from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.statistics import EngineStatistics
from twostroke.engine.text.prompt_ids import tokenize_prompt
from twostroke.states.constraints import (
    MAX_CHOICE_LENGTH,
    MAX_CHOICES,
    MAX_GRAMMAR_LENGTH,
    MAX_PATTERN_LENGTH,
    MAX_SCHEMA_LENGTH,
    AnyJsonObject,
    Choice,
    Grammar,
    JsonSchema,
    Regex,
)
from twostroke.states.errors import ConstraintRejected
from twostroke.states.params import SamplingParams
from twostroke.states.plan import TokenLogprobs
from twostroke.states.request import FinishReason
from twostroke.states.statistics import zero

FROM_REPLICA: list[Any] = [
    Ready(pid=12, model_name="toy", max_model_len=4096),
    Accepted(3, [1, 2, 3]),
    Rejected(4, "RequestRejected", "too long", 5000, 16, 4096),
    Rejected(4, "ValueError", "bad"),
    Deltas([DeltaItem(3, "hé", [104, 195], [(104, -0.5, [(104, -0.5), (7, -2.0)])], None)]),
    FinishedPart(3, [104], "h", [(104, -0.5, [(104, -0.5)])]),
    Finished(3, [104, 195, 169], "hé", "stop", 3, 0.25, 1, None),
    Failed(5, "RequestCancelled", "request 5 was cancelled"),
    Reply(0, [97, 98], None, ""),
    Stats({"num_steps": 7, "forward_seconds": 0.5}),
]


@given(cuts=st.lists(st.integers(0, 400), max_size=12))
def test_frames_survive_any_chunking(cuts: list[int]) -> None:
    data = b"".join(encode_frame(frame) for frame in FROM_REPLICA)
    decoder: FrameDecoder[Any] = FrameDecoder(FromReplica, "replica 0")
    frames: list[Any] = []
    previous = 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        frames.extend(decoder.feed(data[previous:cut]))
        previous = cut
    decoder.close()
    assert frames == FROM_REPLICA


def test_a_coordinator_frame_round_trips() -> None:
    frame = Add(9, [{"role": "user", "content": "hi"}], {"max_tokens": 4, "stop": ["x"]})
    decoder: FrameDecoder[Any] = FrameDecoder(ToReplica, "the coordinator")
    assert decoder.feed(encode_frame(frame)) == [frame]


def test_a_constraint_defined_once_is_named_by_its_id() -> None:
    frames = [
        DefineConstraint(4, WireConstraint("choice", ("no", "yes"))),
        Add(9, "hi", {"max_tokens": 4}, 4),
        ForgetConstraint(4),
    ]
    decoder: FrameDecoder[Any] = FrameDecoder(ToReplica, "the coordinator")
    received = decoder.feed(b"".join(encode_frame(frame) for frame in frames))
    assert received == frames
    defined = {4: constraint_from_wire(received[0].constraint)}
    assert params_from_wire(received[1], defined) == SamplingParams(
        max_tokens=4, constraint=Choice(["yes", "no"])
    )
    with pytest.raises(ValueError, match=r"^constraint 4 was never defined \(or forgotten\)$"):
        params_from_wire(received[1])
    bad_frames = (
        DefineConstraint(-1, WireConstraint("regex", "a")),
        ForgetConstraint(-1),
        Add(9, "hi", {}, -1),
    )
    for bad in bad_frames:
        with pytest.raises(FrameError, match=r"Expected `int` >= 0"):
            decoder.feed(encode_frame(bad))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            encode_frame(Accepted(1, [2]))[:-1],
            "truncated frame 0 from replica 2: the stream ended after 12 of its 13 bytes",
        ),
        (
            b"\x00\x00",
            "truncated frame 0 from replica 2: the stream ended after 2 of the 4 "
            "bytes of its length",
        ),
    ],
    ids=["inside-the-body", "inside-the-length"],
)
def test_a_truncated_stream_names_where_it_ended(data: bytes, message: str) -> None:
    decoder: FrameDecoder[Any] = FrameDecoder(FromReplica, "replica 2")
    assert decoder.feed(data) == []
    with pytest.raises(FrameError, match=f"^{re.escape(message)}$"):
        decoder.close()


def test_a_malformed_frame_names_the_frame_and_the_fault() -> None:
    decoder: FrameDecoder[Any] = FrameDecoder(FromReplica, "replica 1")
    good = encode_frame(Accepted(1, [2]))
    assert decoder.feed(good) == [Accepted(1, [2])]
    with pytest.raises(FrameError, match=r"^malformed frame 1 from replica 1 \(5 bytes\): "):
        decoder.feed(b"\x00\x00\x00\x05hello")
    unknown = encode_frame(Add(1, "x", {}))  # a coordinator frame is no replica frame
    with pytest.raises(FrameError, match=r"^malformed frame 0 .*Invalid value 'add'"):
        FrameDecoder(FromReplica, "replica 1").feed(unknown)
    too_big = (MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(
        FrameError,
        match=f"^malformed frame 0 from replica 1: it announces {MAX_FRAME_BYTES + 1} bytes, "
        f"more than the limit of {MAX_FRAME_BYTES}$",
    ):
        FrameDecoder(FromReplica, "replica 1").feed(too_big)


@pytest.mark.parametrize(
    "prompt",
    ["", [], 3, b"bytes", [1, "a"], [{"role": "user", "content": "x"}, 4], [True, 1], None],
)
def test_bad_prompts_raise_what_a_bare_engine_raises(prompt: Any) -> None:
    with pytest.raises((TypeError, ValueError)) as engine_error:
        tokenize_prompt(prompt, ByteTokenizer())
    with pytest.raises(type(engine_error.value), match=f"^{re.escape(str(engine_error.value))}$"):
        wire_prompt(prompt)


def test_prompts_travel_as_given_and_route_by_their_text() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert wire_prompt("hello") == "hello"
    assert wire_prompt((1, 2)) == [1, 2]
    assert wire_prompt(messages) == messages
    assert routing_key([1, 2]) == [1, 2]
    assert routing_key(messages) == "user\x00hi\x01"
    assert estimate_prompt_tokens("12345678") == 3
    assert estimate_prompt_tokens([5, 6, 7]) == 3


@pytest.mark.parametrize(
    ("frame", "fault"),
    [
        (Accepted(-1, [2]), r"Expected `int` >= 0 - at `\$\[1\]`"),
        (Accepted(1, [2, -3]), r"Expected `int` >= 0 - at `\$\[2\]\[1\]`"),
        (Deltas([DeltaItem(1, "x", [5], None, "bogus")]), r"Invalid enum value 'bogus'"),
        (Finished(3, [1], "x", "bogus", 3, 0.25, 1, None), r"Invalid enum value 'bogus'"),
        (Finished(3, [1], "x", "stop", -3, 0.25, 1, None), r"Expected `int` >= 0"),
        (Ready(pid=12, model_name="toy", max_model_len=0), r"Expected `int` >= 1"),
    ],
    ids=["request-id", "token-id", "delta-finish", "finish", "count", "max-model-len"],
)
def test_a_value_out_of_range_is_a_malformed_frame(frame: Any, fault: str) -> None:
    with pytest.raises(FrameError, match=r"^malformed frame 0 from replica 1 \(\d+ bytes\): "):
        FrameDecoder(FromReplica, "replica 1").feed(encode_frame(frame))
    with pytest.raises(FrameError, match=fault):
        FrameDecoder(FromReplica, "replica 1").feed(encode_frame(frame))


def test_the_wire_knows_every_finish_reason() -> None:
    assert set(typing.get_args(WireFinishReason)) == {reason.value for reason in FinishReason}


def test_statistics_from_another_version_keep_the_fields_both_know() -> None:
    known: dict[str, Any] = {
        field.name: (1,) * len(start) if isinstance(start := zero(field), tuple) else 1
        for field in attrs.fields(EngineStatistics)
    }
    newer = {**known, "num_warp_drives": 9, "warp_drives": {"by_deck": [1, 2]}}
    assert engine_statistics(newer) == EngineStatistics(**known)
    (stats,) = FrameDecoder(FromReplica, "replica 0").feed(encode_frame(Stats(newer)))
    assert engine_statistics(stats.values) == EngineStatistics(**known)
    older = engine_statistics({"num_steps": 4, "forward_seconds": 2})
    assert (older.num_steps, older.num_waiting, older.forward_seconds) == (4, 0, 2.0)
    assert isinstance(older.forward_seconds, float)
    with pytest.raises(TypeError, match=r"^statistics field num_steps must be an int, got 1.5$"):
        engine_statistics({"num_steps": 1.5})
    per_position = "spec_decode_accepted_tokens_per_pos"
    assert engine_statistics({per_position: [2] * 16}).spec_decode_accepted_tokens_per_pos[0] == 2
    with pytest.raises(TypeError, match=rf"^statistics field {per_position} must be 16 ints"):
        engine_statistics({per_position: [1, 2]})
    with pytest.raises(TypeError, match=r"^statistics field forward_seconds must be a number"):
        engine_statistics({"forward_seconds": "fast"})
    with pytest.raises(TypeError, match=r"^statistics must be a mapping, got str$"):
        engine_statistics("fast")


# --- the engine's values on the wire ------------------------------------------------------

LOGPROBS = (TokenLogprobs(104, -0.5, ((104, -0.5), (7, -2.0))), TokenLogprobs(195, -1.0))


def _through_the_wire(frame: Any) -> Any:
    decoder: FrameDecoder[Any] = FrameDecoder(FromReplica, "replica 0")
    [decoded] = decoder.feed(encode_frame(frame))
    return decoded


@pytest.mark.parametrize("logprobs", [LOGPROBS, None])
@pytest.mark.parametrize("reason", [None, FinishReason.STOP, FinishReason.LENGTH])
def test_a_delta_crosses_the_wire_unchanged_under_the_coordinators_id(
    logprobs: tuple[TokenLogprobs, ...] | None, reason: FinishReason | None
) -> None:
    delta = Delta(40, "hé", (104, 195), logprobs, reason)
    [item] = _through_the_wire(Deltas([delta_item(7, delta)])).items
    assert delta_from_item(item) == attrs.evolve(delta, request_id=7)
    assert logprobs_from_wire(wire_logprobs(logprobs)) == logprobs


def _output(logprobs: tuple[TokenLogprobs, ...] | None) -> RequestOutput:
    return RequestOutput(
        request_id=40,
        prompt_token_ids=(1, 2, 3),
        token_ids=(104, 195),
        text="hé",
        finish_reason=FinishReason.STOP,
        usage=Usage(3, 2, 1),
        metrics=RequestMetrics(queue_time=0.25, ttft=0.5, tpot=0.1, e2e=0.6, num_preemptions=2),
        logprobs=logprobs,
    )


@pytest.mark.parametrize("logprobs", [LOGPROBS, None])
def test_a_finished_output_crosses_the_wire_as_the_ending_the_coordinator_rebuilds_from(
    logprobs: tuple[TokenLogprobs, ...] | None,
) -> None:
    frame = _through_the_wire(finished_frame(7, _output(logprobs)))
    assert frame.request_id == 7
    expected = Ending(
        token_ids=(104, 195),
        text="hé",
        finish_reason=FinishReason.STOP,
        prompt_tokens=3,
        queue_time=0.25,
        num_preemptions=2,
        logprobs=logprobs,
        cached_prompt_tokens=1,
    )
    assert ending_from_finished(frame) == expected
    # The same output in parts ahead of its Finished frame joins to the same ending.
    wire = wire_logprobs(logprobs)
    parts = [
        FinishedPart(7, [104], "h", None if wire is None else wire[:1]),
        FinishedPart(7, [], "", None if wire is None else []),
    ]
    rest = msgspec.structs.replace(
        frame, token_ids=[195], text="é", logprobs=None if wire is None else wire[1:]
    )
    assert ending_from_finished(rest, parts) == expected


@pytest.mark.parametrize(
    ("error", "sent", "received"),
    [
        (
            RequestCancelled(40),
            Failed(7, "RequestCancelled", "request 7 was cancelled"),
            RequestCancelled(7),
        ),
        (
            RequestFailed(40, "RuntimeError('boom')"),
            Failed(7, "RequestFailed", "RuntimeError('boom')"),
            RequestFailed(7, "in replica 1: RuntimeError('boom')"),
        ),
        (
            RequestRejected("prompt too long"),
            Failed(7, "RequestRejected", "prompt too long"),
            RequestRejected("prompt too long"),
        ),
        (
            EngineOverloaded("100 requests wait"),
            Failed(7, "EngineOverloaded", "100 requests wait"),
            EngineOverloaded("100 requests wait"),
        ),
        (EngineDead("gone"), Failed(7, "EngineDead", "gone"), EngineDead("gone")),
        (
            KeyError("x"),
            Failed(7, "KeyError", "'x'"),
            EngineError("replica 1: KeyError: 'x'"),
        ),
    ],
)
def test_a_request_error_crosses_the_wire_as_its_kind_under_the_coordinators_id(
    error: BaseException, sent: Failed, received: BaseException
) -> None:
    frame = _through_the_wire(failed_frame(7, error))
    assert frame == sent
    raised = request_error(1, frame.request_id, frame.kind, frame.message)
    assert (type(raised), str(raised)) == (type(received), str(received))


@pytest.mark.parametrize(
    ("error", "sent"),
    [
        (
            RequestRejected("too long", num_prompt_tokens=60, max_tokens=8, max_model_len=64),
            Rejected(7, "RequestRejected", "too long", 60, 8, 64),
        ),
        (RequestRejected("no blocks"), Rejected(7, "RequestRejected", "no blocks")),
        (ValueError("id 300"), Rejected(7, "ValueError", "id 300")),
    ],
)
def test_a_refusal_crosses_the_wire_with_the_numbers_of_the_context(
    error: BaseException, sent: Rejected
) -> None:
    frame = _through_the_wire(rejected_frame(7, error))
    assert frame == sent
    raised = rejection_error(1, frame)
    assert (type(raised), str(raised)) == (type(error), str(error))
    if isinstance(error, RequestRejected):
        assert isinstance(raised, RequestRejected)
        numbers = (raised.num_prompt_tokens, raised.max_tokens, raised.max_model_len)
        assert numbers == (error.num_prompt_tokens, error.max_tokens, error.max_model_len)


def test_a_calls_error_is_raised_again_by_name_else_as_an_engine_error() -> None:
    assert type(call_error("ValueError", "bad")) is ValueError
    assert type(call_error("RequestRejected", "long")) is RequestRejected
    unknown = call_error("KeyError", "'x'")
    assert (type(unknown), str(unknown)) == (EngineError, "'x'")


CONSTRAINTS = [
    JsonSchema({"type": "object", "properties": {"a": {"enum": ["x", "é"]}}}),
    AnyJsonObject(),
    Regex("[0-9]{3}"),
    Choice(["yes", "no"]),
    Grammar('start: "a"+'),
    None,
]


def _raw(*frame: object) -> bytes:
    """A frame as a hostile peer may write it: any msgpack, with its length."""
    body = msgspec.msgpack.encode(list(frame))
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_the_params_cross_the_wire_with_the_constraint_apart(constraint: Any) -> None:
    params = SamplingParams(max_tokens=5, stop=["x"], constraint=constraint)
    fields = wire_params(params)
    assert "constraint" not in fields
    constraint_id = None if constraint is None else 2
    frame = Add(3, "hi", fields, constraint_id)
    (received,) = FrameDecoder(ToReplica, "the coordinator").feed(encode_frame(frame))
    assert params_from_wire(received, {2: constraint}) == params


def test_the_priority_crosses_the_wire_and_a_bad_one_is_the_requests_refusal() -> None:
    params = SamplingParams(max_tokens=5, priority=-7)
    frame = Add(3, "hi", wire_params(params))
    (received,) = FrameDecoder(ToReplica, "the coordinator").feed(encode_frame(frame))
    assert received.params["priority"] == -7
    assert params_from_wire(received) == params
    # A peer's value out of range is refused as submit refuses it, naming the rule.
    bad = Add(3, "hi", wire_params(params) | {"priority": 5000})
    (received,) = FrameDecoder(ToReplica, "the coordinator").feed(encode_frame(bad))
    with pytest.raises(ValueError, match=r"^priority must be in \[-1000, 1000\], got 5000$"):
        params_from_wire(received)


@pytest.mark.parametrize(
    ("constraint", "wire"),
    [
        (JsonSchema({"type": "object"}), ["json", '{"type":"object"}']),
        (AnyJsonObject(), ["json_object", None]),
        (Regex("[0-9]{3}"), ["regex", "[0-9]{3}"]),
        (Choice(["yes", "no"]), ["choice", ["no", "yes"]]),
        (Grammar('start: "a"+'), ["grammar", 'start: "a"+']),
    ],
    ids=lambda value: repr(value)[:12],
)
def test_a_constraint_crosses_the_wire_as_its_kind_and_its_argument(
    constraint: Any, wire: list[Any]
) -> None:
    data = encode_frame(DefineConstraint(2, wire_constraint(constraint)))
    assert msgspec.msgpack.decode(data[4:]) == ["define", 2, wire]
    (received,) = FrameDecoder(ToReplica, "the coordinator").feed(data)
    assert received.constraint == WireConstraint(constraint.kind, constraint.value)
    assert constraint_from_wire(received.constraint) == constraint


@pytest.mark.parametrize(
    ("constraint", "fault"),
    [
        (["regex", ""], r"the argument of a regex constraint: Expected `str` of length >= 1"),
        (["regex", "a" * (MAX_PATTERN_LENGTH + 1)], f"length <= {MAX_PATTERN_LENGTH}"),
        (["regex", ["a"]], r"regex constraint: Expected `str`, got `array`"),
        (["choice", ["x"] * (MAX_CHOICES + 1)], f"length <= {MAX_CHOICES}"),
        (["choice", []], r"Expected `array` of length >= 1"),
        (
            ["choice", ["x", "x" * (MAX_CHOICE_LENGTH + 1)]],
            rf"length <= {MAX_CHOICE_LENGTH} - at `argument\[1\]` - at `\$\[2\]`",
        ),
        (["choice", "yes"], r"choice constraint: Expected `array`, got `str`"),
        (["json", "x" * (MAX_SCHEMA_LENGTH + 1)], f"length <= {MAX_SCHEMA_LENGTH}"),
        (["json_object", "x"], r"json_object constraint: Expected `null`, got `str`"),
        (["grammar", ""], r"Expected `str` of length >= 1"),
        (["grammar", "x" * (MAX_GRAMMAR_LENGTH + 1)], f"length <= {MAX_GRAMMAR_LENGTH}"),
        (["grammar", 7], r"Expected `str \| array \| null`, got `int`"),
        (
            ["lark", "start: x"],
            "a constraint's kind must be one of json, json_object, regex, choice, grammar, "
            "got 'lark'",
        ),
    ],
    ids=[
        "empty-regex",
        "long-regex",
        "regex-of-strings",
        "many-choices",
        "no-choices",
        "long-choice",
        "choice-of-text",
        "long-schema",
        "json-object-with-argument",
        "no-grammar",
        "long-grammar",
        "grammar-of-int",
        "unknown-kind",
    ],
)
def test_a_constraint_past_its_limits_is_a_malformed_frame(constraint: Any, fault: str) -> None:
    with pytest.raises(FrameError, match=r"^malformed frame 0 from the coordinator .*" + fault):
        FrameDecoder(ToReplica, "the coordinator").feed(_raw("define", 1, constraint))


def test_no_constraint_past_its_limits_is_made_to_be_sent() -> None:
    with pytest.raises(ValueError, match=r"^the argument of a regex constraint: Expected `str`"):
        WireConstraint("regex", "")


def test_an_add_frame_carries_no_constraint_of_its_own() -> None:
    with pytest.raises(FrameError, match=r"Expected `int \| null`, got `array` - at `\$\[4\]`"):
        FrameDecoder(ToReplica, "the coordinator").feed(_raw("add", 1, "x", {}, ["regex", "a"]))


@pytest.mark.parametrize(
    ("constraint", "error", "message"),
    [
        (WireConstraint("json", "{nope"), ValueError, "^schema is not valid JSON: "),
        (WireConstraint("json", "[1]"), TypeError, "^schema must be a JSON object"),
        (WireConstraint("regex", "a\ud800"), ValueError, "^pattern must be valid Unicode"),
    ],
)
def test_a_constraint_its_own_rules_refuse_is_the_requests_refusal(
    constraint: WireConstraint, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        constraint_from_wire(constraint)


def test_params_that_name_a_constraint_are_refused() -> None:
    message = "^params must not name a constraint: it travels as its own field$"
    with pytest.raises(TypeError, match=message):
        params_from_wire(Add(1, "x", {"constraint": {"pattern": "a"}}))


def test_an_older_coordinators_params_with_constraint_none_are_taken() -> None:
    sampling = SamplingParams(max_tokens=3)
    assert params_from_wire(Add(1, "x", attrs.asdict(sampling))) == sampling


def test_a_refused_constraint_crosses_the_wire_with_its_field_and_reason() -> None:
    refused = ConstraintRejected("constraint.pattern", "invalid regex: a: b")
    for frame in (_through_the_wire(failed_frame(7, refused)),
                  _through_the_wire(rejected_frame(7, refused))):  # fmt: skip
        raised = (
            rejection_error(1, frame)
            if isinstance(frame, Rejected)
            else request_error(1, 7, frame.kind, frame.message)
        )
        assert isinstance(raised, ConstraintRejected)
        assert (raised.field, raised.reason) == (refused.field, refused.reason)


def test_a_constraint_failed_partway_crosses_the_wire_with_its_field_and_reason() -> None:
    failed = ConstraintFailed(3, "constraint.schema", "past max_items_in_row (2000): a: b")
    frame = _through_the_wire(failed_frame(7, failed))
    assert frame == Failed(
        7, "ConstraintFailed", "constraint.schema: past max_items_in_row (2000): a: b"
    )
    raised = request_error(1, 7, frame.kind, frame.message)
    assert isinstance(raised, ConstraintFailed)
    assert (raised.request_id, raised.field, raised.reason) == (7, failed.field, failed.reason)
