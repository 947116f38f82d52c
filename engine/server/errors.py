"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server answers with is an :class:`ApiError`. The handlers raise it (or an
engine error that :func:`api_error_from` maps to one), and the application turns it into a
JSON body or, once a stream has started, into an SSE ``error`` event. The message never holds
a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from twostroke.engine.errors import (
    ConstraintFailed,
    EngineClosed,
    EngineDead,
    EngineError,
    EngineOverloaded,
    ReplicaFailed,
    RequestFailed,
    RequestRejected,
)

__all__ = [
    "ANTHROPIC_ERROR_TYPES",
    "RETRY_AFTER_SECONDS",
    "ApiError",
    "anthropic_error",
    "anthropic_error_type",
    "api_error_from",
    "invalid_request",
]

#: The ``Retry-After`` of a 503 for a full waiting queue: a client may try again this soon.
#: Requests leave the queue as running ones finish, a batch every few steps.
RETRY_AFTER_SECONDS = 1

#: Anthropic's error type for each HTTP status it answers with (its API's "Errors" page; the
#: ``anthropic`` SDK 2.x picks its exception class by the status). A status not listed is
#: ``invalid_request_error`` below 500 and ``api_error`` from 500.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}

#: A rejection whose message begins with a field's name names it (``stop_token_ids must ...``).
_FIELD = re.compile(r"([a-z_]+) must ")


class ApiError(EngineError):
    """An error response: HTTP status and OpenAI's error fields.

    Args:
        status: The HTTP status code.
        message: What went wrong, for a person to read.
        type: OpenAI's error type (``invalid_request_error``, ``server_error``, ...).
        param: The request field at fault, if one is.
        code: A machine-readable code (``context_length_exceeded``, ``model_not_found``).
        headers: Extra response headers (``connection: close`` for a body left unread).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = tuple(headers)

    def body(self) -> dict[str, Any]:
        """The JSON body of the response."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error``."""
    return ApiError(400, message, type="invalid_request_error", param=param, code=code)


def api_error_from(exc: BaseException, *, max_tokens_field: str = "max_tokens") -> ApiError:
    """The response for an exception raised while serving a request.

    Engine errors get their documented status (400 for a rejected request or a constraint
    that failed partway, 503 for a dead, closed or overloaded engine or a failed replica);
    anything else is a 500 that names only the exception's type. A request too long for the
    context is worded as OpenAI words it, from the numbers the engine's
    :class:`RequestRejected` carries, naming ``max_tokens_field`` (the body's field that set
    the most tokens to generate).
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestRejected):
        prompt, most, limit = exc.num_prompt_tokens, exc.max_tokens, exc.max_model_len
        if prompt is not None and most is not None and limit is not None:
            return invalid_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt + most} tokens ({prompt} in the prompt, {most} for the "
                f"completion). Please reduce the prompt or {max_tokens_field}.",
                param=max_tokens_field,
                code="context_length_exceeded",
            )
        message = str(exc)
        field = _FIELD.match(message)
        return invalid_request(
            message, param=field.group(1) if field else None, code="request_rejected"
        )
    if isinstance(exc, EngineOverloaded):  # transient: the same request may succeed later
        return ApiError(
            503,
            str(exc),
            type="server_error",
            code="engine_overloaded",
            headers=((b"retry-after", str(RETRY_AFTER_SECONDS).encode()),),
        )
    if isinstance(exc, EngineDead):
        return ApiError(503, "the engine is dead", type="server_error", code="engine_dead")
    if isinstance(exc, EngineClosed):
        return ApiError(
            503, "the engine is shutting down", type="server_error", code="engine_closed"
        )
    if isinstance(exc, ReplicaFailed):  # the others serve: a retry may well succeed
        return ApiError(
            503,
            "the replica serving this request failed",
            type="server_error",
            code="replica_failed",
        )
    if isinstance(exc, ConstraintFailed):  # the constraint's doing, not a step's
        return invalid_request(str(exc).partition(" failed: ")[2], code="constraint_failed")
    if isinstance(exc, RequestFailed):
        return ApiError(500, "a step of this request failed", type="server_error")
    return ApiError(500, f"internal server error ({type(exc).__name__})", type="server_error")


def anthropic_error_type(status: int, code: str | None = None) -> str:
    """Anthropic's error type for an error of ``status`` (and OpenAI-style ``code``).

    A full waiting queue (``engine_overloaded``) is Anthropic's ``overloaded_error``.
    """
    if code == "engine_overloaded":
        return "overloaded_error"
    return ANTHROPIC_ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )


def anthropic_error(error: ApiError) -> tuple[int, dict[str, Any]]:
    """The status and body of ``error`` in Anthropic's shape, for ``/v1/messages``:
    ``{"type": "error", "error": {"type": ..., "message": ...}}``.

    A full waiting queue, a 503 on the OpenAI routes, is Anthropic's 529 ``overloaded_error``
    (the SDK retries it, as it does a 503); every other status stays as it is.
    """
    status = 529 if error.code == "engine_overloaded" else error.status
    kind = anthropic_error_type(status, error.code)
    return status, {"type": "error", "error": {"type": kind, "message": error.message}}
