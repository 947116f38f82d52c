"""The coordinator's relay: its books of open requests, and what replicas report into them.

A :class:`RequestRelay` is what every replica reports to (it satisfies
:class:`~twostroke.engine.coordinator.replica_client.Relay`). It owns the open requests — the
coordinator's handle for each, the replica serving it, its first-token time — and keeps the
router's and the replicas' counts in step with them: a request is routed and handed to a
replica (:meth:`RequestRelay.submit`), its replica's reports are turned into deltas and an
output on the coordinator's handle (a report from a replica that no longer serves the request
is stale and dropped), and a request ends exactly once (finished, failed, cancelled, or closed
with the coordinator). When a replica dies its requests that had no token yet are resubmitted
once to a live replica, but for constrained ones; the others fail with
:class:`~twostroke.engine.errors.ReplicaFailed`. A constrained request is never moved: its
replica compiled its constraint, running the backend on the client's input, and if that is
what killed the replica it would kill the next one, and every replica in turn.
When no replica is left the relay records the death and tells the coordinator.

The coordinator keeps the lifecycle (starting and stopping replicas) and the public surface;
the relay has no task and never awaits: every call is synchronous, on the event loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Protocol

import anyio
import attrs

from twostroke.engine.coordinator.frames import WirePrompt, estimate_prompt_tokens, routing_key
from twostroke.engine.coordinator.replica_client import Replica
from twostroke.engine.coordinator.wire_outputs import Ending
from twostroke.engine.errors import EngineClosed, EngineDead, ReplicaFailed, RequestCancelled
from twostroke.engine.handle import HandleWriter, RequestHandle, create_request_handle
from twostroke.engine.outputs import Delta, RequestMetrics, RequestOutput, Usage
from twostroke.states.params import SamplingParams
from twostroke.states.routing import Router

__all__ = ["ReplicaState", "RequestRelay", "Verdict"]


class Verdict(Protocol):
    """Whether a replica took a request."""

    @property
    def settled(self) -> anyio.Event:
        """Set once the replica accepted or refused the request (or it ended first)."""

    @property
    def refusal(self) -> BaseException | None:
        """Why the request ended before it was accepted (``None`` if it was)."""


@attrs.define(eq=False)
class _Relayed:
    """The coordinator's side of one open request: the writer of its handle, and its
    :class:`Verdict`."""

    request_id: int
    prompt: WirePrompt
    params: SamplingParams
    writer: HandleWriter
    replica: int
    arrival_time: float
    settled: anyio.Event = attrs.field(factory=anyio.Event)
    refusal: BaseException | None = None
    num_tokens: int = 0
    first_token_time: float | None = None
    resubmitted: bool = False


@attrs.define
class ReplicaState:
    """One replica as the coordinator's books see it.

    Attributes:
        replica: The replica.
        num_open: Open requests it serves.
        steps_seen: Its engine's step count when the coordinator last looked.
        progress_time: When it last made progress (took its first open request, or stepped).
        failure: Why it died; ``None`` while it lives.
    """

    replica: Replica
    num_open: int = 0
    steps_seen: int = 0
    progress_time: float = 0.0
    failure: BaseException | None = None


class RequestRelay:
    """The open requests of a coordinator, and the reports of its replicas about them.

    Args:
        router: Chooses each request's replica and keeps their loads.
        replicas: The coordinator's replicas, by index; shared (the coordinator appends
            them as it makes them, before any request).
        on_death: Called once when the last replica died outside closing; :attr:`death`
            is the last failure by then.
    """

    def __init__(
        self, router: Router, replicas: list[ReplicaState], on_death: Callable[[], None]
    ) -> None:
        self.router = router
        self.replicas = replicas
        self._on_death = on_death
        #: The open requests, by id.
        self.open: dict[int, _Relayed] = {}
        #: Set while no request is open (a fresh event each time one opens).
        self.idle = anyio.Event()
        self.idle.set()
        #: No new work; requests whose replica goes away fail rather than resubmit.
        self.closing = False
        #: The last replica's failure, once every replica died outside closing.
        self.death: BaseException | None = None
        #: Requests resubmitted after their replica died.
        self.num_resubmitted = 0
        self._ids = itertools.count()
        # Bound once and shared by every handle: one object fewer per open request.
        self._cancel_callback = self.cancel

    def submit(self, prompt: WirePrompt, params: SamplingParams) -> RequestHandle:
        """Open a request, route it and hand it to its replica.

        Args:
            prompt: The request's prompt, as it goes to a replica.
            params: Its sampling parameters.

        Returns:
            The coordinator's handle for the request.

        Raises:
            RequestRejected, ValueError: a replica that checks at once (``"local"``) refused
                the request; nothing stays open.
        """
        request_id = next(self._ids)
        writer, handle = create_request_handle(request_id, (), self._cancel_callback)
        relayed = _Relayed(
            request_id=request_id,
            prompt=prompt,
            params=params,
            writer=writer,
            replica=-1,
            arrival_time=anyio.current_time(),
        )
        self.open[request_id] = relayed
        try:
            self._send(relayed)
        except BaseException:
            del self.open[request_id]
            raise
        if self.idle.is_set():
            self.idle = anyio.Event()
        return handle

    def _send(self, relayed: _Relayed) -> None:
        """Route ``relayed`` and hand it to its replica; undone if the replica refuses."""
        request_id = relayed.request_id
        wire = relayed.prompt
        known = relayed.writer.handle.prompt_token_ids
        estimate = len(known) if known else estimate_prompt_tokens(wire)
        most = relayed.params.max_tokens
        if most is None:  # as many as the context leaves: the smallest context, estimated
            lengths = [s.replica.max_model_len for s in self.replicas if s.failure is None]
            most = max(min(lengths, default=0) - estimate, 1)
        index = self.router.route(request_id, routing_key(wire), estimate, most)
        state = self.replicas[index]
        try:
            prompt_token_ids = state.replica.add(request_id, wire, relayed.params)
        except BaseException:
            self.router.release(request_id)
            raise
        relayed.replica = index
        if state.num_open == 0:
            state.progress_time = anyio.current_time()
        state.num_open += 1
        if prompt_token_ids is not None:
            self.accepted(index, request_id, prompt_token_ids)

    def verdict(self, request_id: int) -> Verdict | None:
        """Whether the replica took the request; ``None`` if the request has ended."""
        return self.open.get(request_id)

    def close(self, *, cancel: bool) -> None:
        """Take no new work; if ``cancel``, end every open request with ``EngineClosed``."""
        self.closing = True
        if cancel:
            for relayed in list(self.open.values()):
                error = EngineClosed(
                    f"the coordinator closed before request {relayed.request_id} finished"
                )
                self._end(relayed, None, error)

    def cancel(self, request_id: int) -> None:
        """Cancel an open request (its handle's cancel); nothing if it has ended.

        It ends at once if it never left the coordinator; otherwise its replica reports
        the cancellation later.
        """
        relayed = self.open.get(request_id)
        if relayed is None:
            return
        state = self.replicas[relayed.replica]
        if state.failure is None and state.replica.cancel(request_id):
            self._end(relayed, None, RequestCancelled(request_id))

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the open requests, the router and the counts disagree."""
        self.router.check_invariants()
        for request_id, relayed in self.open.items():
            assert not relayed.writer.handle.done(), f"request {request_id} is done but still open"
            assert self.router.replica_of(request_id) == relayed.replica, relayed
        for index, state in enumerate(self.replicas):
            count = sum(1 for r in self.open.values() if r.replica == index)
            assert state.num_open == count, f"replica {index}: {state.num_open} != {count}"
        if self.idle.is_set():
            assert not self.open, "idle, yet requests are open"

    # --- what the replicas report (the Relay protocol) ----------------------------------

    def _relayed(self, replica: int, request_id: int) -> _Relayed | None:
        """The open request, if ``replica`` still serves it (else the report is stale)."""
        relayed = self.open.get(request_id)
        if relayed is None or relayed.replica != replica:
            return None
        return relayed

    def accepted(self, replica: int, request_id: int, prompt_token_ids: tuple[int, ...]) -> None:
        """The replica tokenized and queued the request."""
        relayed = self._relayed(replica, request_id)
        if relayed is None:
            return
        relayed.writer.set_prompt_token_ids(prompt_token_ids)
        self.router.set_prompt_tokens(request_id, len(prompt_token_ids))
        relayed.settled.set()

    def delta(self, replica: int, request_id: int, delta: Delta) -> None:
        """New output, delivered on the coordinator's handle under its request id."""
        relayed = self._relayed(replica, request_id)
        if relayed is None:
            return
        count = len(delta.token_ids)
        if count:
            if relayed.first_token_time is None:
                relayed.first_token_time = anyio.current_time()
            relayed.num_tokens += count
            self.router.progress(request_id, count)
        relayed.writer.deliver(
            Delta(request_id, delta.text, delta.token_ids, delta.logprobs, delta.finish_reason)
        )

    def finished(self, replica: int, request_id: int, ending: Ending) -> None:
        """The request finished: its output, with the coordinator's timings."""
        relayed = self._relayed(replica, request_id)
        if relayed is None:
            return
        num_output = len(ending.token_ids)
        output = RequestOutput(
            request_id=request_id,
            prompt_token_ids=relayed.writer.handle.prompt_token_ids,
            token_ids=ending.token_ids,
            text=ending.text,
            finish_reason=ending.finish_reason,
            usage=Usage(ending.prompt_tokens, num_output, ending.cached_prompt_tokens),
            metrics=RequestMetrics.measure(
                arrival=relayed.arrival_time,
                first_token=relayed.first_token_time,
                queue_time=ending.queue_time,
                now=anyio.current_time(),
                num_output_tokens=num_output,
                num_preemptions=ending.num_preemptions,
            ),
            logprobs=ending.logprobs,
        )
        self._end(relayed, output, None)

    def failed(self, replica: int, request_id: int, error: BaseException) -> None:
        """The request was rejected, cancelled or failed in the replica."""
        relayed = self._relayed(replica, request_id)
        if relayed is None:
            return
        if isinstance(error, EngineDead | EngineClosed) and not self.closing:
            # The replica is going away under this request: treat it as the replica's death.
            self.replica_failed(replica, error)
            return
        self._end(relayed, None, error)

    def replica_failed(self, replica: int, cause: BaseException) -> None:
        """The replica is gone: resubmit or fail its open requests (once per replica)."""
        state = self.replicas[replica]
        if state.failure is not None:
            return
        state.failure = cause
        orphans = self.router.remove_replica(replica)
        for request_id in orphans:
            relayed = self.open[request_id]
            state.num_open -= 1
            retry = (
                not relayed.num_tokens
                and not relayed.resubmitted
                and relayed.params.constraint is None  # it may be what killed the replica
                and not self.closing
            )
            if retry and self.router.live_replicas:
                relayed.resubmitted = True
                self.num_resubmitted += 1
                try:
                    self._send(relayed)
                except Exception as exc:
                    self._end(relayed, None, exc, counted=False)
                continue
            error = ReplicaFailed(replica, str(cause), request_id=request_id)
            error.__cause__ = cause
            self._end(relayed, None, error, counted=False)
        if not self.router.live_replicas and not self.closing:
            self.death = cause
            self._on_death()

    def _end(
        self,
        relayed: _Relayed,
        output: RequestOutput | None,
        error: BaseException | None,
        *,
        counted: bool = True,
    ) -> None:
        """Close the books on a request and finish its handle (``counted``: its replica
        still counts it open)."""
        request_id = relayed.request_id
        del self.open[request_id]
        self.router.release(request_id)
        if counted and relayed.replica >= 0:
            self.replicas[relayed.replica].num_open -= 1
        if not relayed.settled.is_set():
            relayed.refusal = error
            relayed.settled.set()
        if error is None:
            assert output is not None
            relayed.writer.finish(output)
        else:
            relayed.writer.fail(error)
        if not self.open:
            self.idle.set()
