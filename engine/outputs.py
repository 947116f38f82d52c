"""What the engine hands back: streamed deltas and final outputs, all frozen values."""

from __future__ import annotations

import attrs

from twostroke.states.plan import TokenLogprobs
from twostroke.states.request import FinishReason

__all__ = ["Delta", "RequestMetrics", "RequestOutput", "Usage"]


@attrs.frozen
class Delta:
    """New output of one request since the consumer last looked.

    A consumer that reads slowly receives several steps' worth of output merged into one
    delta (coalesced), never a backlog of small ones.

    Attributes:
        request_id: The request.
        text: Text that is final (held-back text, such as a possible partial stop string or
            an incomplete UTF-8 character, arrives in a later delta).
        token_ids: The output token ids produced since the previous delta.
        logprobs: One entry per token in ``token_ids`` when the request asked for logprobs.
        finish_reason: Set on the last delta of a finished request.
    """

    request_id: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: Delta) -> Delta:
        """This delta followed by ``later``, as one."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = (logprobs or ()) + later.logprobs
        return Delta(
            request_id=self.request_id,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            finish_reason=later.finish_reason or self.finish_reason,
        )


@attrs.frozen
class Usage:
    """Token counts of one request, as OpenAI's ``usage`` reports them.

    Attributes:
        prompt_tokens: Tokens in the prompt.
        completion_tokens: Output tokens.
        cached_prompt_tokens: Prompt tokens whose KV came from the prefix cache at the
            request's first admission (not computed for it).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class RequestMetrics:
    """Timings of one request in seconds of the event loop's clock (vLLM's definitions).

    Attributes:
        queue_time: Arrival to first scheduled.
        ttft: Arrival to the first output token being delivered.
        tpot: (end-to-end - ttft) / (output tokens - 1); ``None`` for one-token outputs.
        e2e: Arrival to the final output.
        num_preemptions: How often the request's KV was taken back and recomputed.
    """

    queue_time: float | None
    ttft: float | None
    tpot: float | None
    e2e: float
    num_preemptions: int

    @classmethod
    def measure(
        cls,
        *,
        arrival: float,
        first_token: float | None,
        queue_time: float | None,
        now: float,
        num_output_tokens: int,
        num_preemptions: int,
    ) -> RequestMetrics:
        """The timings of a request that arrived at ``arrival`` and finishes at ``now``.

        TTFT runs from arrival to the first output token; TPOT is
        ``(end-to-end - TTFT) / (output tokens - 1)`` and is ``None`` for one-token outputs.
        """
        e2e = now - arrival
        ttft = None if first_token is None else first_token - arrival
        tpot = None
        if ttft is not None and num_output_tokens > 1:
            tpot = (e2e - ttft) / (num_output_tokens - 1)
        return cls(
            queue_time=queue_time, ttft=ttft, tpot=tpot, e2e=e2e, num_preemptions=num_preemptions
        )


@attrs.frozen
class RequestOutput:
    """The complete output of a finished request."""

    request_id: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    usage: Usage
    metrics: RequestMetrics
    logprobs: tuple[TokenLogprobs, ...] | None = None
