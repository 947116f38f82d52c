"""The error hierarchy shared by every layer of twostroke.

One root, :class:`EngineError`, so that an application can catch everything the engine
raises on purpose with one ``except``. Bad arguments are still ``TypeError`` / ``ValueError``
(the errors Python programmers expect for them); the ones specific to twostroke subclass
both the root and the builtin, so either ``except`` works.
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "InvalidTransition",
    "RequestRejected",
    "SchedulerError",
]


class EngineError(Exception):
    """Root of every error that twostroke raises deliberately."""


class InvalidTransition(EngineError):
    """An event was applied to a request whose status does not accept it.

    The request is left exactly as it was.
    """

    def __init__(self, request_id: int, status: object, event: object) -> None:
        self.request_id = request_id
        self.status = status
        self.event = event
        super().__init__(
            f"request {request_id}: status {status} does not accept event {type(event).__name__}"
        )


class RequestRejected(EngineError, ValueError):
    """A request can never be served with this configuration (it is not queued)."""


class SchedulerError(EngineError, RuntimeError):
    """The scheduler was driven out of protocol (a bug in the caller, not in the input)."""
