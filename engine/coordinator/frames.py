"""The wire between the coordinator and a replica: msgpack frames with a length prefix.

Every frame is a 4-byte big-endian length followed by that many bytes of msgpack, encoded
from one of the :mod:`msgspec` structs below (tagged, array-like: compact and fast). The same
frames go over a child process's stdin/stdout and over a TCP connection to a Ray actor; they
need no ports, no broker and no event loop of a particular kind.

The coordinator sends :data:`ToReplica` frames and receives :data:`FromReplica` frames. A
malformed frame (bad msgpack, an unknown tag, a field of the wrong type, a value out of its
range such as a negative id or an unknown finish reason, a length over
:data:`MAX_FRAME_BYTES`) and a stream that ends inside a frame raise :class:`FrameError` with
what was wrong: the coordinator treats it as a replica failure, never a hang.

What the frames carry is converted to and from the engine's values beside them: a request's
parameters and its constraint in :mod:`~twostroke.engine.coordinator.wire_constraints`, its
outputs and errors in :mod:`~twostroke.engine.coordinator.wire_outputs`, its prompt here
(:func:`wire_prompt`). Those modules import this one, never the other way.
"""

from __future__ import annotations

import collections
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Generic, Literal, TypeAlias, TypeVar, cast

import anyio
import anyio.abc
import msgspec

from twostroke.engine.errors import EngineError
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
from twostroke.states.prompts import prompt_kind
from twostroke.states.validators import is_int

__all__ = [
    "MAX_FRAME_BYTES",
    "Accepted",
    "Add",
    "Call",
    "Cancel",
    "DefineConstraint",
    "DeltaItem",
    "Deltas",
    "Failed",
    "Finished",
    "FinishedPart",
    "ForgetConstraint",
    "FrameDecoder",
    "FrameError",
    "FrameReader",
    "FrameTooLarge",
    "FromReplica",
    "Ready",
    "Rejected",
    "Reply",
    "Shutdown",
    "Start",
    "StartFailed",
    "Stats",
    "ToReplica",
    "WireArgument",
    "WireConstraint",
    "WireFinishReason",
    "WirePrompt",
    "encode_frame",
    "routing_key",
    "split_output",
    "wire_prompt",
]

#: The largest frame either side sends or accepts (a frame announcing more is malformed).
MAX_FRAME_BYTES = 64 << 20
_HEADER = struct.Struct(">I")

#: A prompt on the wire: text, or a list of token ids or of chat messages.
WirePrompt: TypeAlias = str | list[int | dict[str, Any]]
#: A request id, call id or token id on the wire: never negative (decoding checks).
WireId: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]
#: A count on the wire (tokens, preemptions): never negative.
WireCount: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]
#: Why a request finished: a ``FinishReason`` value (decoding refuses any other string).
WireFinishReason: TypeAlias = Literal["stop", "length"]
#: One token's log-probabilities: the token id, its logprob, the top alternatives.
WireLogprobs: TypeAlias = tuple[WireId, float, list[tuple[WireId, float]]]


class FrameError(EngineError):
    """A frame from the other side is malformed or truncated (names what was wrong).

    Attributes:
        frames: The good frames that came before the bad one in the same bytes.
    """

    def __init__(self, message: str, frames: Sequence[object] = ()) -> None:
        super().__init__(message)
        self.frames = list(frames)


class FrameTooLarge(ValueError):
    """A frame would be longer than the limit: refused before it is sent.

    Attributes:
        size: Its length in bytes.
        limit: The most bytes a frame may have.
    """

    def __init__(self, kind: str, size: int, limit: int) -> None:
        super().__init__(f"a {kind} frame of {size} bytes is more than the limit of {limit}")
        self.size = size
        self.limit = limit


# --- coordinator → replica -------------------------------------------------------------


class Start(msgspec.Struct, tag="start", array_like=True):
    """The first frame: which model to open and the engine's options."""

    model: str | None
    options: dict[str, Any]


#: A constraint's argument on the wire: text, a choice's strings, or nothing.
WireArgument: TypeAlias = str | tuple[str, ...] | None

#: What each kind of constraint's argument must be on the wire: the limits its class holds
#: it to (:mod:`twostroke.states.constraints`), checked as a frame is decoded.
_ARGUMENTS: dict[str, Any] = {
    JsonSchema.kind: Annotated[str, msgspec.Meta(max_length=MAX_SCHEMA_LENGTH)],
    AnyJsonObject.kind: None,
    Regex.kind: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATTERN_LENGTH)],
    Choice.kind: Annotated[
        tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CHOICE_LENGTH)], ...],
        msgspec.Meta(min_length=1, max_length=MAX_CHOICES),
    ],
    Grammar.kind: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GRAMMAR_LENGTH)],
}


class WireConstraint(msgspec.Struct, array_like=True):
    """A request's constraint: its ``kind`` and its argument, the constraint's ``value``
    (:func:`~twostroke.engine.coordinator.wire_constraints.wire_constraint` makes it,
    :func:`~twostroke.engine.coordinator.wire_constraints.constraint_from_wire` reads it).

    Decoding refuses an unknown kind and an argument of the wrong type or past its kind's
    limit (``MAX_SCHEMA_LENGTH``, ``MAX_PATTERN_LENGTH``, ``MAX_CHOICES``,
    ``MAX_CHOICE_LENGTH``, ``MAX_GRAMMAR_LENGTH``): the frame is malformed. The constraint's
    other rules (a schema's JSON, its depth) are the refusal of each request that names it.
    """

    kind: str
    argument: WireArgument = None

    def __post_init__(self) -> None:
        if self.kind not in _ARGUMENTS:
            raise ValueError(
                f"a constraint's kind must be one of {', '.join(_ARGUMENTS)}, got {self.kind!r:.40}"
            )
        try:
            msgspec.convert(self.argument, _ARGUMENTS[self.kind])
        except msgspec.ValidationError as exc:  # where in the argument, not in the frame
            where = str(exc).replace("`$", "`argument")
            raise ValueError(f"the argument of a {self.kind} constraint: {where}") from None


class Add(msgspec.Struct, tag="add", array_like=True):
    """A request: its parameters by name but the constraint
    (:func:`~twostroke.engine.coordinator.wire_constraints.wire_params`), and the id of its
    constraint, which a :class:`DefineConstraint` sent before (``None``: it has none)."""

    request_id: WireId
    prompt: WirePrompt
    params: dict[str, Any]
    constraint_id: WireId | None = None


class DefineConstraint(msgspec.Struct, tag="define", array_like=True):
    """A constraint that ``Add`` frames name by ``constraint_id`` from now on: sent once,
    however many requests carry it, until a :class:`ForgetConstraint`."""

    constraint_id: WireId
    constraint: WireConstraint


class ForgetConstraint(msgspec.Struct, tag="forget", array_like=True):
    """The last request that named a defined constraint has ended: the replica drops it."""

    constraint_id: WireId


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    request_id: WireId


class Call(msgspec.Struct, tag="call", array_like=True):
    """Ask the replica's engine something: ``tokenize``, ``detokenize`` or ``wait_idle``."""

    call_id: WireId
    method: str
    argument: Any


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Close the engine (cancelling open requests if ``cancel``) and exit."""

    cancel: bool


ToReplica: TypeAlias = Start | Add | DefineConstraint | ForgetConstraint | Cancel | Call | Shutdown


# --- replica → coordinator -------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", array_like=True):
    pid: WireCount
    model_name: str
    max_model_len: Annotated[int, msgspec.Meta(ge=1)]


class StartFailed(msgspec.Struct, tag="start_failed", array_like=True):
    kind: str
    message: str


class Accepted(msgspec.Struct, tag="accepted", array_like=True):
    request_id: WireId
    prompt_token_ids: list[WireId]


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    """``submit`` raised: ``kind`` is ``RequestRejected``, ``TypeError`` or ``ValueError``.

    A ``RequestRejected`` for the context's length carries its numbers (its attributes).
    """

    request_id: WireId
    kind: str
    message: str
    num_prompt_tokens: WireCount | None = None
    max_tokens: WireCount | None = None
    max_model_len: WireCount | None = None


class DeltaItem(msgspec.Struct, array_like=True):
    request_id: WireId
    text: str
    token_ids: list[WireId]
    logprobs: list[WireLogprobs] | None
    finish_reason: WireFinishReason | None


class Deltas(msgspec.Struct, tag="deltas", array_like=True):
    """Every request's new output since the last frame (one item per request, coalesced)."""

    items: list[DeltaItem]


class Finished(msgspec.Struct, tag="finished", array_like=True):
    request_id: WireId
    token_ids: list[WireId]
    text: str
    finish_reason: WireFinishReason
    prompt_tokens: WireCount
    queue_time: Annotated[float, msgspec.Meta(ge=0)] | None
    num_preemptions: WireCount
    logprobs: list[WireLogprobs] | None
    cached_prompt_tokens: WireCount = 0


class FinishedPart(msgspec.Struct, tag="finished_part", array_like=True):
    """The start of a finished request's output, when all of it would not fit in one frame.

    A request's parts come in order, then its :class:`Finished` with the rest.
    """

    request_id: WireId
    token_ids: list[WireId]
    text: str
    logprobs: list[WireLogprobs] | None


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """The request ended with an error: ``RequestFailed``, ``RequestCancelled``,
    ``EngineClosed`` or ``EngineDead``."""

    request_id: WireId
    kind: str
    message: str


class Reply(msgspec.Struct, tag="reply", array_like=True):
    """The answer to a :class:`Call`; ``kind`` names the exception it raised, if any."""

    call_id: WireId
    value: Any
    kind: str | None
    message: str


class Stats(msgspec.Struct, tag="stats", array_like=True):
    """A snapshot of the replica's ``EngineStatistics`` (field name to value).

    Any value decodes: the coordinator checks the fields it knows and ignores the others,
    whatever they hold (a newer replica may report more, of other kinds).
    """

    values: dict[str, Any]


FromReplica: TypeAlias = (
    Ready
    | StartFailed
    | Accepted
    | Rejected
    | Deltas
    | Finished
    | FinishedPart
    | Failed
    | Reply
    | Stats
)


# --- the codec -------------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()


def encode_frame(frame: msgspec.Struct, *, limit: int = MAX_FRAME_BYTES) -> bytes:
    """One frame: its length, then its msgpack.

    Args:
        frame: The frame.
        limit: The most bytes its msgpack may have (the receiver's limit).

    Raises:
        TypeError: a field holds a value msgpack cannot carry.
        FrameTooLarge: the frame would be longer than ``limit``: nothing is encoded.
    """
    body = _ENCODER.encode(frame)
    if len(body) > limit:
        raise FrameTooLarge(type(frame).__name__, len(body), limit)
    return _HEADER.pack(len(body)) + body


def encoded_size(value: object) -> int:
    """Bytes of msgpack that ``value`` (a frame, or a part of one) takes."""
    return len(_ENCODER.encode(value))


#: A piece of a request's output: its text, token ids and logprobs.
OutputPiece: TypeAlias = tuple[str, list[int], list[WireLogprobs] | None]


def split_output(
    piece: OutputPiece, size_of: Callable[[OutputPiece], int], budget: int
) -> list[OutputPiece]:
    """``piece`` cut into consecutive pieces whose ``size_of`` is at most ``budget``.

    Joined in order, the pieces' texts, token ids and logprobs are those of ``piece``. A
    piece is halved until it fits: the common case, one piece that fits, costs one measure.

    Args:
        piece: The output to cut.
        size_of: The bytes of the frame that would carry a piece.
        budget: The most bytes such a frame may have.

    Raises:
        FrameTooLarge: a single token (or character) does not fit.
    """
    size = size_of(piece)
    if size <= budget:
        return [piece]
    text, token_ids, logprobs = piece
    if len(token_ids) <= 1 and len(text) <= 1:
        raise FrameTooLarge("one-token output", size, budget)
    cut, tokens = len(text) // 2, len(token_ids) // 2
    first: OutputPiece = (
        text[:cut],
        token_ids[:tokens],
        None if logprobs is None else logprobs[:tokens],
    )
    rest: OutputPiece = (
        text[cut:],
        token_ids[tokens:],
        None if logprobs is None else logprobs[tokens:],
    )
    return split_output(first, size_of, budget) + split_output(rest, size_of, budget)


T = TypeVar("T")


class FrameDecoder(Generic[T]):
    """Splits a byte stream into frames of type ``T``, however the bytes were chunked.

    Args:
        frame_type: :data:`ToReplica` or :data:`FromReplica`.
        peer: Who sends the bytes, for error messages (``"replica 1"``).
        limit: The most bytes a frame may have.
    """

    def __init__(self, frame_type: Any, peer: str, *, limit: int = MAX_FRAME_BYTES) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(frame_type)
        self._peer = peer
        self._limit = limit
        self._buffer = bytearray()
        self._frames = 0

    def feed(self, data: bytes) -> list[T]:
        """The complete frames that ``data`` finishes (a partial one waits for more).

        Raises:
            FrameError: a frame is malformed, or announces more than the limit.
        """
        buffer = self._buffer
        buffer += data
        frames: list[T] = []
        start = 0
        while len(buffer) - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer, start)
            if length > self._limit:
                raise FrameError(
                    f"malformed frame {self._frames} from {self._peer}: it announces "
                    f"{length} bytes, more than the limit of {self._limit}",
                    frames,
                )
            end = start + _HEADER.size + length
            if len(buffer) < end:
                break
            body = bytes(buffer[start + _HEADER.size : end])
            try:
                frames.append(self._decoder.decode(body))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise FrameError(
                    f"malformed frame {self._frames} from {self._peer} ({length} bytes): {exc}",
                    frames,
                ) from exc
            self._frames += 1
            start = end
        del buffer[:start]
        return frames

    def close(self) -> None:
        """The stream ended: check it did not end inside a frame.

        Raises:
            FrameError: bytes of an unfinished frame are left.
        """
        if self._buffer:
            have = len(self._buffer)
            if have < _HEADER.size:
                detail = f"{have} of the {_HEADER.size} bytes of its length"
            else:
                (length,) = _HEADER.unpack_from(self._buffer)
                detail = f"{have - _HEADER.size} of its {length} bytes"
            raise FrameError(
                f"truncated frame {self._frames} from {self._peer}: the stream ended after {detail}"
            )


class FrameReader:
    """The frames of a byte stream, as an async iterator (ends at the stream's end).

    Raises (while iterating):
        FrameError: a malformed frame, or the stream ended inside one.
    """

    def __init__(
        self,
        receive: anyio.abc.ByteReceiveStream,
        frame_type: Any,
        peer: str,
        *,
        limit: int = MAX_FRAME_BYTES,
    ) -> None:
        self._receive = receive
        self._decoder: FrameDecoder[Any] = FrameDecoder(frame_type, peer, limit=limit)
        self._ready: collections.deque[Any] = collections.deque()
        self._error: FrameError | None = None
        #: Seconds spent decoding (for the coordinator's cost per relayed token).
        self.decode_seconds = 0.0

    def __aiter__(self) -> FrameReader:
        return self

    async def __anext__(self) -> Any:
        while not self._ready:
            if self._error is not None:
                raise self._error
            try:
                data = await self._receive.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._decoder.close()
                raise StopAsyncIteration from None
            began = time.perf_counter()
            try:
                self._ready.extend(self._decoder.feed(data))
            except FrameError as exc:  # the good frames before it first
                self._ready.extend(exc.frames)
                self._error = exc
            self.decode_seconds += time.perf_counter() - began
        return self._ready.popleft()


# --- prompts on the wire ---------------------------------------------------------------


def wire_prompt(prompt: object) -> WirePrompt:
    """``prompt`` as it travels: checked for shape only (the replica tokenizes it).

    The check is the engine's own (:func:`~twostroke.states.prompts.prompt_kind`), so a bad
    prompt raises the same error through the coordinator as through a bare engine.

    Raises:
        TypeError: neither text, token ids nor chat messages.
        ValueError: empty.
    """
    kind = prompt_kind(prompt)
    if kind == "text":
        return cast(str, prompt)
    if kind == "messages":
        return [dict(message) for message in cast(Sequence[Mapping[str, str]], prompt)]
    return list(cast(Sequence[int], prompt))


def routing_key(prompt: WirePrompt) -> str | list[int]:
    """What prefix affinity looks at: the text, the token ids, or the messages as text."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], dict):
        return "".join(
            f"{message.get('role', '')}\x00{message.get('content', '')}\x01"
            for message in prompt
            if isinstance(message, dict)
        )
    return [item for item in prompt if is_int(item)]


def estimate_prompt_tokens(prompt: WirePrompt) -> int:
    """A routing estimate before the replica tokenizes: ids counted, text at 4 bytes a token."""
    key = routing_key(prompt)
    if isinstance(key, str):
        return len(key.encode("utf-8", errors="replace")) // 4 + 1
    return len(key)
