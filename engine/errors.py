"""Errors raised by the running engine. All subclass :class:`EngineError`."""

from __future__ import annotations

from twostroke.states.errors import EngineError, InvalidTransition, RequestRejected

__all__ = [
    "EngineClosed",
    "EngineDead",
    "EngineError",
    "InvalidTransition",
    "RequestCancelled",
    "RequestFailed",
    "RequestRejected",
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


class RequestCancelled(EngineError):
    """The request was cancelled (through its handle) before it finished."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id} was cancelled")
