"""A request's outputs and errors on the wire, as a replica reports them to the coordinator.

Each conversion sits beside its inverse. The replica's server encodes (:func:`wire_logprobs`,
:func:`delta_item`, :func:`finished_frame`, :func:`failed_frame`, :func:`rejected_frame`); the
coordinator's client decodes (:func:`logprobs_from_wire`, :func:`delta_from_item`,
:func:`ending_from_finished`, :func:`rejection_error`, :func:`request_error`,
:func:`call_error`), so a request served by a replica ends with the output, or raises the
error, that a bare engine would give. The frames themselves, and how a long output is cut
into parts, are :mod:`twostroke.engine.coordinator.frames`.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from twostroke.engine.coordinator.frames import (
    DeltaItem,
    Failed,
    Finished,
    FinishedPart,
    Rejected,
    WireLogprobs,
)
from twostroke.engine.errors import (
    ConstraintFailed,
    EngineClosed,
    EngineDead,
    EngineError,
    EngineOverloaded,
    RequestCancelled,
    RequestFailed,
    RequestRejected,
)
from twostroke.engine.outputs import Delta, RequestOutput
from twostroke.states.errors import ConstraintRejected
from twostroke.states.plan import TokenLogprobs
from twostroke.states.request import FinishReason

__all__ = [
    "Ending",
    "call_error",
    "delta_from_item",
    "delta_item",
    "ending_from_finished",
    "failed_frame",
    "finished_frame",
    "logprobs_from_wire",
    "rejected_frame",
    "rejection_error",
    "request_error",
    "wire_logprobs",
]


@attrs.frozen
class Ending:
    """How a request finished in its replica: the coordinator rebuilds the output from it,
    with its own request id and timings.

    Decoded from a :class:`Finished` frame (:func:`ending_from_finished`), or taken from a
    local replica's output.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    queue_time: float | None
    num_preemptions: int
    logprobs: tuple[TokenLogprobs, ...] | None
    cached_prompt_tokens: int = 0


def wire_logprobs(entries: Sequence[TokenLogprobs] | None) -> list[WireLogprobs] | None:
    """Log-probabilities as they travel (inverse: :func:`logprobs_from_wire`)."""
    if entries is None:
        return None
    return [(entry.token_id, entry.logprob, list(entry.top)) for entry in entries]


def logprobs_from_wire(entries: list[WireLogprobs] | None) -> tuple[TokenLogprobs, ...] | None:
    """Log-probabilities as they arrived (inverse: :func:`wire_logprobs`)."""
    if entries is None:
        return None
    return tuple(
        TokenLogprobs(token_id, logprob, tuple((i, p) for i, p in top))
        for token_id, logprob, top in entries
    )


def delta_item(request_id: int, delta: Delta) -> DeltaItem:
    """A request's pending delta, for a :class:`~twostroke.engine.coordinator.frames.Deltas`
    frame (inverse: :func:`delta_from_item`)."""
    reason = delta.finish_reason
    return DeltaItem(
        request_id=request_id,
        text=delta.text,
        token_ids=list(delta.token_ids),
        logprobs=wire_logprobs(delta.logprobs),
        finish_reason=None if reason is None else reason.value,
    )


def delta_from_item(item: DeltaItem) -> Delta:
    """The delta an item of a :class:`~twostroke.engine.coordinator.frames.Deltas` frame
    carries (inverse: :func:`delta_item`)."""
    reason = item.finish_reason
    return Delta(
        item.request_id,
        item.text,
        tuple(item.token_ids),
        logprobs_from_wire(item.logprobs),
        None if reason is None else FinishReason(reason),
    )


def finished_frame(request_id: int, output: RequestOutput) -> Finished:
    """A finished request's output as it leaves its replica (inverse:
    :func:`ending_from_finished`; one too long for a frame goes in parts, see
    :func:`~twostroke.engine.coordinator.frames.split_output`)."""
    return Finished(
        request_id=request_id,
        token_ids=list(output.token_ids),
        text=output.text,
        finish_reason=output.finish_reason.value,
        prompt_tokens=output.usage.prompt_tokens,
        queue_time=output.metrics.queue_time,
        num_preemptions=output.metrics.num_preemptions,
        logprobs=wire_logprobs(output.logprobs),
        cached_prompt_tokens=output.usage.cached_prompt_tokens,
    )


def ending_from_finished(frame: Finished, parts: Sequence[FinishedPart] = ()) -> Ending:
    """How a request finished, from its :class:`Finished` frame and the parts that came
    ahead of it, in order (inverse: :func:`finished_frame`)."""
    token_ids, text, logprobs = frame.token_ids, frame.text, frame.logprobs
    if parts:  # the output arrived in parts: join them
        token_ids = [i for part in parts for i in part.token_ids] + token_ids
        text = "".join(part.text for part in parts) + text
        if logprobs is not None:
            logprobs = [e for part in parts for e in part.logprobs or ()] + logprobs
    return Ending(
        token_ids=tuple(token_ids),
        text=text,
        finish_reason=FinishReason(frame.finish_reason),
        prompt_tokens=frame.prompt_tokens,
        queue_time=frame.queue_time,
        num_preemptions=frame.num_preemptions,
        logprobs=logprobs_from_wire(logprobs),
        cached_prompt_tokens=frame.cached_prompt_tokens,
    )


def failed_frame(request_id: int, error: BaseException) -> Failed:
    """A request's error as it leaves its replica, under the coordinator's ``request_id``
    (inverse: :func:`request_error`): the engine's own request ids mean nothing outside."""
    message = str(error)
    if isinstance(error, RequestFailed):
        message = message.removeprefix(f"request {error.request_id} failed: ")
    elif isinstance(error, RequestCancelled):
        message = str(RequestCancelled(request_id))
    return Failed(request_id, type(error).__name__, message)


#: Errors a replica may report by name, and how the coordinator raises them again.
_SUBMIT_ERRORS: dict[str, type[Exception]] = {
    "RequestRejected": RequestRejected,
    "TypeError": TypeError,
    "ValueError": ValueError,
    "EngineClosed": EngineClosed,
    "EngineOverloaded": EngineOverloaded,  # its waiting queue is full: the server's 503
}


def rejected_frame(request_id: int, error: BaseException) -> Rejected:
    """``submit``'s refusal as it leaves its replica (inverse: :func:`rejection_error`): a
    ``RequestRejected`` for the context's length carries its numbers."""
    rejected = Rejected(request_id, type(error).__name__, str(error))
    if isinstance(error, RequestRejected):
        rejected.num_prompt_tokens = error.num_prompt_tokens
        rejected.max_tokens = error.max_tokens
        rejected.max_model_len = error.max_model_len
    return rejected


def rejection_error(replica: int, frame: Rejected) -> BaseException:
    """The coordinator's error for a request its replica refused (inverse:
    :func:`rejected_frame`): a ``RequestRejected`` again with its numbers."""
    if frame.kind == "RequestRejected":
        return RequestRejected(
            frame.message,
            num_prompt_tokens=frame.num_prompt_tokens,
            max_tokens=frame.max_tokens,
            max_model_len=frame.max_model_len,
        )
    return request_error(replica, frame.request_id, frame.kind, frame.message)


def request_error(replica: int, request_id: int, kind: str, message: str) -> BaseException:
    """The coordinator's error for a request that ended with ``kind`` in ``replica`` (a
    :class:`Failed` or :class:`Rejected` frame; inverse: :func:`failed_frame`)."""
    if kind == "RequestCancelled":
        return RequestCancelled(request_id)
    if kind == "RequestFailed":
        return RequestFailed(request_id, f"in replica {replica}: {message}")
    if kind == "ConstraintFailed":  # its message is "field: reason", as the replica's
        field, _, reason = message.partition(": ")
        return ConstraintFailed(request_id, field, reason)
    if kind == "ConstraintRejected":  # its message is "field: reason"
        field, _, reason = message.partition(": ")
        return ConstraintRejected(field, reason)
    error_type = _SUBMIT_ERRORS.get(kind)
    if error_type is not None:
        return error_type(message)
    if kind == "EngineDead":
        return EngineDead(message)
    return EngineError(f"replica {replica}: {kind}: {message}")


def call_error(kind: str, message: str) -> Exception:
    """The error a :class:`~twostroke.engine.coordinator.frames.Reply` reports by name,
    raised again by the coordinator's call (an :class:`~twostroke.engine.errors.EngineError`
    for a name it does not know)."""
    return _SUBMIT_ERRORS.get(kind, EngineError)(message)
