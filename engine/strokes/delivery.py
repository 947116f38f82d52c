"""Delivery: from a step's report to what each caller sees.

The bookkeeping stroke applies a step's outcome to the scheduler and gets a
:class:`~twostroke.states.plan.StepReport`; :class:`Deliveries` turns it into output. It keeps
the engine's side of every open request (its handle's writer, its incremental detokenizer and its
logprobs), matches stop strings, merges deltas into the handles, and builds the final
:class:`~twostroke.engine.outputs.RequestOutput` with vLLM's timing metrics.

Everything here is synchronous and runs on the event loop between two awaits of the
bookkeeping stroke, so a handle never sees a half-applied step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs

from twostroke.engine.errors import RequestFailed
from twostroke.engine.handle import HandleWriter
from twostroke.engine.outputs import Delta, RequestMetrics, RequestOutput, Usage
from twostroke.engine.text.detokenizer import IncrementalDetokenizer
from twostroke.states.plan import RunnerOutput, StepReport, TokenLogprobs
from twostroke.states.request import FinishReason, Request

__all__ = ["Deliveries", "Tracked"]


@attrs.define(eq=False)
class Tracked:
    """The engine's side of one open request."""

    request: Request
    writer: HandleWriter
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    #: Output tokens delivered: a stop string may end the request before the last token a
    #: step with drafts brought, and those after it are not its output.
    num_delivered: int = 0

    def __repr__(self) -> str:
        return f"<Tracked {self.request!r}>"


class Deliveries:
    """The open requests' handles and how a step's report reaches them.

    Args:
        finish_on_stop_string: Called with a request id when its text matched a stop string
            (the scheduler must stop scheduling it; its blocks come back once no step in
            flight uses them). Stop strings are the one stop decided here, where the text
            is; every stop on token ids is the request's own.
    """

    def __init__(self, finish_on_stop_string: Callable[[int], object]) -> None:
        self._open: dict[int, Tracked] = {}
        self._finish_on_stop_string = finish_on_stop_string

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._open

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._open))

    def get(self, request_id: int) -> Tracked | None:
        return self._open.get(request_id)

    def values(self) -> list[Tracked]:
        return list(self._open.values())

    def track(self, tracked: Tracked) -> None:
        """Start delivering to a newly submitted request."""
        request_id = tracked.request.request_id
        assert request_id not in self._open, f"request {request_id} is tracked already"
        self._open[request_id] = tracked

    def deliver(
        self, report: StepReport, output: RunnerOutput | None, cause: BaseException | None
    ) -> None:
        """Deliver one applied step: new tokens, finished requests and failed ones.

        What the scheduler recorded on each request (its finish time, its failure) is what
        the caller sees; nothing is measured or worded again here.

        Args:
            report: What applying the step changed in the scheduler.
            output: The runner's output for the step (``None`` if it failed).
            cause: The step's exception if it failed (each request's error is chained to it).
        """
        # A row that verified drafts brings several tokens of one request, in order: each
        # is delivered (and matched against stop strings) as if it came in a step of its own.
        place: dict[int, int] = {}
        for request_id, token_id in report.new_tokens:
            tracked = self._open.get(request_id)
            if tracked is None:
                continue  # a stop string ended it at an earlier token of this step
            index = place[request_id] = place.get(request_id, -1) + 1
            entry: TokenLogprobs | None = None
            if tracked.logprobs is not None and output is not None:
                entries = output.token_logprobs(request_id)
                entry = entries[index] if index < len(entries) else None
            if entry is not None:
                assert tracked.logprobs is not None
                tracked.logprobs.append(entry)
            tracked.num_delivered += 1
            update = tracked.detokenizer.push([token_id])
            tracked.writer.deliver(
                Delta(request_id, update.text, (token_id,), None if entry is None else (entry,))
            )
            if update.stopped:
                self._finish_on_stop_string(request_id)
                self._finish(tracked, FinishReason.STOP)
        for request_id, reason in report.finished:
            ended = self._open.get(request_id)
            if ended is not None:  # not already ended by a stop string
                tail = ended.detokenizer.flush()
                ended.writer.deliver(Delta(request_id, tail, ()))
                self._finish(ended, reason)
        for request_id in report.failed:
            failed = self._open.get(request_id)
            if failed is not None:
                assert failed.request.failure is not None, failed
                error = RequestFailed(request_id, failed.request.failure)
                error.__cause__ = cause
                self.end(request_id, error)

    def end(self, request_id: int, error: BaseException) -> None:
        """End an open request with ``error`` (cancelled, failed, engine closed or dead)."""
        tracked = self._open.pop(request_id)
        tracked.writer.fail(error)

    def _finish(self, tracked: Tracked, reason: FinishReason) -> None:
        request = tracked.request
        tracked.writer.deliver(Delta(request.request_id, finish_reason=reason))
        token_ids = request.output_token_ids[: tracked.num_delivered]
        output = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=token_ids,
            text=tracked.detokenizer.text,
            finish_reason=reason,
            usage=Usage(request.num_prompt_tokens, len(token_ids), request.num_cached_tokens),
            metrics=request_metrics(request, len(token_ids)),
            logprobs=tuple(tracked.logprobs) if tracked.logprobs is not None else None,
        )
        del self._open[request.request_id]
        tracked.writer.finish(output)


def request_metrics(request: Request, num_output_tokens: int | None = None) -> RequestMetrics:
    """vLLM's per-request timings of a request that has ended (its ``end_time`` is set),
    over ``num_output_tokens`` (default: all it holds)."""
    assert request.end_time is not None, request
    queue_time = None
    if request.first_scheduled_time is not None:
        queue_time = request.first_scheduled_time - request.arrival_time
    return RequestMetrics.measure(
        arrival=request.arrival_time,
        first_token=request.first_token_time,
        queue_time=queue_time,
        now=request.end_time,
        num_output_tokens=(
            request.num_output_tokens if num_output_tokens is None else num_output_tokens
        ),
        num_preemptions=request.num_preemptions,
    )
