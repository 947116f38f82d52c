"""Errors raised by the running engine, and those of the layers below it, in one place.

The engine's own errors are defined here and subclass :class:`EngineError`. Those of
``states/`` (the scheduling core) are re-exported; so are those of ``gpu/``, which subclass
``RuntimeError`` only, because the layering rule keeps ``gpu/`` from importing the root
that ``states/`` defines. ``docs/errors.md`` lists every error with when it is raised and
what state the engine is in afterwards; ``twostroke.engine`` exports each of them.
"""

from __future__ import annotations

from twostroke.gpu.completion import CompletionAlreadySet, CompletionError, CompletionNotDone
from twostroke.gpu.device import DeviceUnavailable
from twostroke.gpu.forward_thread import ForwardThreadClosed
from twostroke.states.errors import (
    ConstraintRejected,
    EngineError,
    EngineOverloaded,
    InvalidTransition,
    RequestRejected,
    SchedulerError,
)
from twostroke.states.routing import NoLiveReplica

__all__ = [
    "CompletionAlreadySet",
    "CompletionError",
    "CompletionNotDone",
    "ConstraintFailed",
    "ConstraintRejected",
    "DeviceUnavailable",
    "EngineClosed",
    "EngineDead",
    "EngineError",
    "EngineOverloaded",
    "ForwardThreadClosed",
    "InvalidTransition",
    "MatcherError",
    "NoLiveReplica",
    "ReplicaFailed",
    "RequestCancelled",
    "RequestFailed",
    "RequestRejected",
    "SchedulerError",
    "StructuredOutputUnavailable",
]


class EngineClosed(EngineError):
    """The engine's ``async with`` block has been left (or is being left): no new work."""


class EngineDead(EngineError):
    """A stroke of the engine died; ``__cause__`` is what killed it.

    Every open waiter receives this within one step, and the engine's ``async with`` block
    re-raises it.
    """


class RequestFailed(EngineError):
    """A step this request was in failed; ``__cause__`` is the runner's exception.

    Other requests are unaffected and the engine keeps serving.
    """

    def __init__(self, request_id: int, message: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id} failed: {message}")


class ConstraintFailed(RequestFailed):
    """A constrained request's backend gave up partway through its output: a limit of the
    backend the constraint breaks only there (a row of the parse past
    ``max_items_in_row``), or a dead end (no token of the vocabulary continues it).

    The constraint's own doing, not a step's: the server answers it as a 400
    (``constraint_failed``) naming the body's field. Other requests are unaffected.

    Attributes:
        field: The part of the request at fault (``"constraint.schema"``, ...).
        reason: Which rule it broke, with the limit's value where the backend gives it.
    """

    def __init__(self, request_id: int, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(request_id, f"{field}: {reason}")


class RequestCancelled(EngineError):
    """The request was cancelled (through its handle) before it finished."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id} was cancelled")


class ReplicaFailed(EngineError):
    """The engine replica serving this request died (data-parallel coordinator).

    Only that replica's open requests fail; the coordinator keeps serving with the others.
    ``__cause__`` says what happened to the replica (its ``EngineDead``, the child process's
    exit, a malformed frame, a lost connection).

    Attributes:
        replica: The index of the replica that died.
        request_id: The failed request (``None`` when the error is about the replica itself,
            as when it fails to start).
    """

    def __init__(self, replica: int, message: str, request_id: int | None = None) -> None:
        self.replica = replica
        self.request_id = request_id
        prefix = "" if request_id is None else f"request {request_id} failed: "
        super().__init__(f"{prefix}replica {replica} failed: {message}")


class StructuredOutputUnavailable(EngineError, ImportError):
    """The structured-output backend (llguidance) is missing or too old.

    Raised when ``twostroke.engine.structured`` is imported; the message says which version
    is needed and how to install it. The rest of the engine works without it.
    """


class MatcherError(EngineError, RuntimeError):
    """A constrained request's matcher gave up mid-output: the request cannot go on.

    The backend hit one of its limits (lexer or parser fuel, the size of the grammar) while
    advancing or computing a mask; its message is the reason. Constraints that fail this
    way from their first token are refused when compiled (``ConstraintRejected``) instead.
    """
