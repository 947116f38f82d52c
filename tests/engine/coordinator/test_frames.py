"""The wire: frames survive any chunking, and bad bytes fail with what was wrong."""

from __future__ import annotations

import re
import typing
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.engine.coordinator.frames import (
    MAX_FRAME_BYTES,
    Accepted,
    Add,
    DeltaItem,
    Deltas,
    Failed,
    Finished,
    FinishedPart,
    FrameDecoder,
    FrameError,
    FromReplica,
    Ready,
    Rejected,
    Reply,
    Stats,
    ToReplica,
    WireFinishReason,
    encode_frame,
    estimate_prompt_tokens,
    routing_key,
    wire_prompt,
)
from twostroke.engine.coordinator.statistics import engine_statistics
from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.statistics import EngineStatistics
from twostroke.engine.text.prompts import tokenize_prompt
from twostroke.states.request import FinishReason

FROM_REPLICA: list[Any] = [
    Ready(pid=12, model_name="toy", max_model_len=4096),
    Accepted(3, [1, 2, 3]),
    Rejected(4, "RequestRejected", "too long"),
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
    known = {field.name: 1 for field in attrs.fields(EngineStatistics)}
    newer = {**known, "num_warp_drives": 9, "warp_drives": {"by_deck": [1, 2]}}
    assert engine_statistics(newer) == EngineStatistics(**known)
    (stats,) = FrameDecoder(FromReplica, "replica 0").feed(encode_frame(Stats(newer)))
    assert engine_statistics(stats.values) == EngineStatistics(**known)
    older = engine_statistics({"num_steps": 4, "forward_seconds": 2})
    assert (older.num_steps, older.num_waiting, older.forward_seconds) == (4, 0, 2.0)
    assert isinstance(older.forward_seconds, float)
    with pytest.raises(TypeError, match=r"^statistics field num_steps must be an int, got 1.5$"):
        engine_statistics({"num_steps": 1.5})
    with pytest.raises(TypeError, match=r"^statistics field forward_seconds must be a number"):
        engine_statistics({"forward_seconds": "fast"})
    with pytest.raises(TypeError, match=r"^statistics must be a mapping, got str$"):
        engine_statistics("fast")
