"""The error hierarchy shared by every layer of twostroke.

One root, :class:`EngineError`, so that an application can catch everything the engine
raises on purpose with one ``except``. Bad arguments are still ``TypeError`` / ``ValueError``
(the errors Python programmers expect for them); the ones specific to twostroke subclass
both the root and the builtin, so either ``except`` works.
"""

from __future__ import annotations

__all__ = [
    "ConstraintRejected",
    "EngineError",
    "EngineOverloaded",
    "InvalidTransition",
    "RequestRejected",
    "SchedulerError",
]


class EngineError(Exception):
    """Root of every error that twostroke raises deliberately."""


class InvalidTransition(EngineError):
    """An event was applied to a request that may not take it; the request is unchanged.

    Either the table of transitions has no row for the event in the request's status
    (``"request 3: status DECODING does not accept event Admitted"``), or the status accepts
    the event but its counts break a rule, which the message states
    (``"request 3: ChunkScheduled(num_tokens=9) exceeds the 7 tokens left to compute"``).

    Attributes:
        request_id: The request.
        status: Its status, unchanged.
        event: The event refused.
        rule: The count rule the event broke, or ``None`` for a table miss.
    """

    def __init__(
        self, request_id: int, status: object, event: object, rule: str | None = None
    ) -> None:
        self.request_id = request_id
        self.status = status
        self.event = event
        self.rule = rule
        if rule is None:
            rule = f"status {status} does not accept event {type(event).__name__}"
        super().__init__(f"request {request_id}: {rule}")


class RequestRejected(EngineError, ValueError):
    """A request can never be served with this configuration (it is not queued).

    A request whose prompt and ``max_tokens`` pass the context (``max_model_len``) carries
    the three numbers, so that a front end words the refusal its own way from them (the
    HTTP server: OpenAI's "This model's maximum context length is ..."); they are ``None``
    for every other rejection.

    Attributes:
        num_prompt_tokens: The prompt's tokens.
        max_tokens: The most output tokens the request asked for.
        max_model_len: The context: the most prompt and output tokens a request may have.
    """

    def __init__(
        self,
        message: str,
        *,
        num_prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(message)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class ConstraintRejected(RequestRejected):
    """A request's constraint cannot be enforced: the backend refused it, or it took too long.

    Raised when the constraint is compiled, before the request is queued: a keyword the
    backend does not implement, a regular expression or grammar it cannot read, a schema no
    output can satisfy, or one that did not compile within the time allowed
    (``"constraint.pattern: invalid regex: unclosed group"``).

    Attributes:
        field: The part of the request at fault (``"constraint.schema"``,
            ``"constraint.pattern"``, ``"constraint.choices"``, ``"constraint.grammar"``).
        reason: What is wrong with it, in the backend's words where it has them.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")

    def __reduce__(self) -> tuple[type[ConstraintRejected], tuple[str, str]]:
        return type(self), (self.field, self.reason)


class EngineOverloaded(EngineError):
    """The waiting queue is full (``max_waiting_requests``): the request was not queued.

    Unlike :class:`RequestRejected`, the same request may be served later, once requests
    waiting now have been admitted; the HTTP server answers it with a 503 and
    ``Retry-After``. Nothing already queued is affected.
    """


class SchedulerError(EngineError, RuntimeError):
    """The scheduler was driven out of protocol (a bug in the caller, not in the input)."""
