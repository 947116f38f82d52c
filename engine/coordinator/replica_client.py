"""The coordinator's side of a replica: what it asks of one, and what a replica reports back.

A replica is driven through :class:`Replica` (add, cancel, call, close, and a supervisor
``run``) and reports to a :class:`Relay` (the coordinator's
:class:`~twostroke.engine.coordinator.relay.RequestRelay`) with plain synchronous calls made
on the event loop. :class:`RemoteReplica` is the client of
:mod:`~twostroke.engine.coordinator.replica_server`: it speaks the frame protocol over a pair
of byte streams and is the base of the process and Ray placements. The ``local`` placement
(:mod:`~twostroke.engine.coordinator.local`) wraps an engine in this process instead; this
module never imports the engine.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Protocol

import anyio
import anyio.abc

from twostroke.engine.coordinator.frames import (
    MAX_FRAME_BYTES,
    Accepted,
    Add,
    Call,
    Cancel,
    DefineConstraint,
    Deltas,
    Failed,
    Finished,
    FinishedPart,
    ForgetConstraint,
    FrameError,
    FrameReader,
    FrameTooLarge,
    FromReplica,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    Start,
    StartFailed,
    Stats,
    WirePrompt,
    encode_frame,
)
from twostroke.engine.coordinator.statistics import engine_statistics
from twostroke.engine.coordinator.wire_constraints import wire_constraint, wire_params
from twostroke.engine.coordinator.wire_outputs import (
    Ending,
    call_error,
    delta_from_item,
    ending_from_finished,
    rejection_error,
    request_error,
)
from twostroke.engine.errors import ReplicaFailed, RequestRejected
from twostroke.engine.outputs import Delta
from twostroke.engine.statistics import EngineStatistics
from twostroke.states.constraints import Constraint
from twostroke.states.params import SamplingParams

__all__ = ["BaseReplica", "Relay", "RemoteReplica", "Replica"]


class Relay(Protocol):
    """What a replica reports; every call is synchronous, on the event loop."""

    def accepted(self, replica: int, request_id: int, prompt_token_ids: tuple[int, ...]) -> None:
        """The replica tokenized and queued the request."""

    def delta(self, replica: int, request_id: int, delta: Delta) -> None:
        """New output (``delta.request_id`` is the replica's own; ignore it)."""

    def finished(self, replica: int, request_id: int, ending: Ending) -> None:
        """The request finished."""

    def failed(self, replica: int, request_id: int, error: BaseException) -> None:
        """The request was rejected, cancelled or failed in the replica."""

    def replica_failed(self, replica: int, cause: BaseException) -> None:
        """The replica is gone; its open requests will never hear from it again."""


class Replica(Protocol):
    """One engine replica as the coordinator drives it."""

    index: int
    #: The process the replica runs in (``None`` in this process).
    pid: int | None
    #: Seconds the coordinator spent decoding this replica's frames and relaying them.
    relay_seconds: float

    async def run(self) -> None:
        """The replica's supervisor task: start it, serve, stop it; never raises.

        Sets :attr:`ready` once it serves (or failed to start: see ``start_error``).
        """

    @property
    def ready(self) -> anyio.Event: ...

    @property
    def start_error(self) -> BaseException | None: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_name(self) -> str: ...

    def add(
        self, request_id: int, prompt: WirePrompt, params: SamplingParams
    ) -> tuple[int, ...] | None:
        """Queue a request; its prompt ids if known at once (local), else ``None``."""

    def cancel(self, request_id: int) -> bool:
        """Cancel a request; ``True`` if it never left the coordinator (it is gone now)."""

    async def call(self, method: str, argument: Any) -> Any:
        """``tokenize``, ``detokenize`` or ``wait_idle`` (which returns fresh statistics)."""

    def close(self, *, cancel: bool) -> None:
        """Stop once its requests have ended (cancelling them first if ``cancel``)."""

    def statistics(self) -> EngineStatistics | None:
        """The replica's engine statistics (the latest snapshot for a remote one)."""


class BaseReplica:
    """What every replica reports about its start: readiness, why it failed, its model.

    The base of every placement's replica (it leaves the rest of :class:`Replica` to them).

    Args:
        index: The replica's index.
        relay: Where it reports (the coordinator's relay).
    """

    def __init__(self, index: int, relay: Relay) -> None:
        self.index = index
        self._relay = relay
        self._ready = anyio.Event()
        self._start_error: BaseException | None = None
        self._max_model_len = 0
        self._model_name = ""

    @property
    def ready(self) -> anyio.Event:
        return self._ready

    @property
    def start_error(self) -> BaseException | None:
        return self._start_error

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def model_name(self) -> str:
        return self._model_name


# --- over frames -------------------------------------------------------------------------


class RemoteReplica(BaseReplica):
    """A replica behind the frame protocol; subclasses open the byte streams.

    Frames to the replica wait in an outbox that one writer task sends in batches, so that
    ``add`` and ``cancel`` stay synchronous. An ``Add`` still in the outbox when its request
    is cancelled is dropped there: the replica never hears of it. No frame either way is
    longer than ``max_frame_bytes``: a request or call whose frame would be is refused
    before it is sent, and a finished output that would be arrives in parts.

    A constraint goes once, in a ``DefineConstraint`` frame, and every request of this
    replica that carries it names it by id, until the last of them has ended (then a
    ``ForgetConstraint``): the choices of one request share one copy on the wire and in the
    replica, not one each.

    Args:
        index: The replica's index.
        relay: Where it reports (the coordinator's relay).
        start: The first frame (model and engine options).
        max_frame_bytes: The longest frame either side sends or accepts.
    """

    placement = "remote"

    def __init__(
        self, index: int, relay: Relay, start: Start, *, max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        super().__init__(index, relay)
        self.pid: int | None = None
        self._limit = max_frame_bytes
        self._outbox: list[tuple[int | None, bytes]] = [
            (None, encode_frame(start, limit=self._limit))
        ]
        self._unsent: set[int] = set()
        self._wake = anyio.Event()
        self._wake.set()  # the Start frame waits in the outbox
        self._started = False
        self._start_problem: str | None = None
        self._start_cause: BaseException | None = None
        self._stats: EngineStatistics | None = None
        #: Pending calls by id: the method, set once answered, and the answer.
        self._calls: dict[int, tuple[str, anyio.Event, list[Any]]] = {}
        self._call_ids = itertools.count()
        #: The parts of finished outputs that came ahead of their ``Finished``, by request.
        self._parts: dict[int, list[FinishedPart]] = {}
        self._closing = False
        self._closed = anyio.Event()
        self._gone: BaseException | None = None
        #: Seconds this process spent decoding the replica's frames and relaying them.
        self.relay_seconds = 0.0
        #: The constraints the replica holds: each one's id and how many open requests
        #: name it; and the constraint of each open request that has one.
        self._constraints: dict[Constraint, list[int]] = {}
        self._constraint_of: dict[int, Constraint] = {}
        self._constraint_ids = itertools.count()

    def add(
        self, request_id: int, prompt: WirePrompt, params: SamplingParams
    ) -> tuple[int, ...] | None:
        fields = wire_params(params)
        constraint = params.constraint
        constraint_id = None if constraint is None else self._hold(request_id, constraint)
        try:
            data = encode_frame(Add(request_id, prompt, fields, constraint_id), limit=self._limit)
        except FrameTooLarge as exc:
            self._release(request_id)
            raise RequestRejected(f"the request is too large to send to a replica: {exc}") from None
        self._outbox.append((request_id, data))
        self._unsent.add(request_id)
        self._wake.set()
        return None

    def _hold(self, request_id: int, constraint: Constraint) -> int:
        """The constraint id ``request_id``'s frame carries; the constraint is defined first
        if the replica does not hold it yet."""
        entry = self._constraints.get(constraint)
        if entry is None:
            constraint_id = next(self._constraint_ids)
            frame = DefineConstraint(constraint_id, wire_constraint(constraint))
            try:
                data = encode_frame(frame, limit=self._limit)
            except FrameTooLarge as exc:
                raise RequestRejected(
                    f"the constraint is too large to send to a replica: {exc}"
                ) from None
            self._send(data)
            entry = self._constraints[constraint] = [constraint_id, 0]
        entry[1] += 1
        self._constraint_of[request_id] = constraint
        return entry[0]

    def _release(self, request_id: int) -> None:
        """``request_id`` has ended: its constraint is forgotten once no open request names
        it."""
        constraint = self._constraint_of.pop(request_id, None)
        if constraint is None:
            return
        entry = self._constraints[constraint]
        entry[1] -= 1
        if not entry[1]:
            del self._constraints[constraint]
            if not self._closing:
                self._send(encode_frame(ForgetConstraint(entry[0])))

    def cancel(self, request_id: int) -> bool:
        if request_id in self._unsent:
            self._unsent.discard(request_id)
            self._release(request_id)
            return True
        self._send(encode_frame(Cancel(request_id)))
        return False

    async def call(self, method: str, argument: Any) -> Any:
        if self._gone is not None:
            raise ReplicaFailed(self.index, str(self._gone)) from self._gone
        call_id = next(self._call_ids)
        try:
            data = encode_frame(Call(call_id, method, argument), limit=self._limit)
        except FrameTooLarge as exc:
            raise ValueError(
                f"the {method} argument is too large to send to a replica: {exc}"
            ) from None
        done = anyio.Event()
        answer: list[Any] = []
        self._calls[call_id] = (method, done, answer)
        self._send(data)
        try:
            await done.wait()
        finally:
            self._calls.pop(call_id, None)
        reply = answer[0]
        if isinstance(reply, BaseException):
            raise reply
        assert isinstance(reply, Reply)
        if reply.kind is not None:
            raise call_error(reply.kind, reply.message)
        return reply.value

    def close(self, *, cancel: bool) -> None:
        if not self._closing:
            self._closing = True
            self._closed.set()
            self._send(encode_frame(Shutdown(cancel)))

    def statistics(self) -> EngineStatistics | None:
        return self._stats

    def _send(self, data: bytes) -> None:
        self._outbox.append((None, data))
        self._wake.set()

    # --- the supervisor's halves ----------------------------------------------------------

    async def serve(
        self, receive: anyio.abc.ByteReceiveStream, send: anyio.abc.ByteSendStream
    ) -> BaseException | None:
        """Exchange frames until the replica's output ends.

        Returns:
            ``None`` after an orderly shutdown, else why the replica is gone (a startup
            failure is stored in ``start_error`` instead).
        """
        frames = FrameReader(receive, FromReplica, f"replica {self.index}", limit=self._limit)
        cause: BaseException | None = None
        dispatch_seconds = 0.0
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._writer, send, task_group.cancel_scope)
            try:
                async for frame in frames:
                    began = time.perf_counter()
                    try:
                        self._dispatch(frame)
                    except FrameError:
                        raise
                    except Exception as exc:
                        # A well-formed frame with a value the coordinator cannot use (or
                        # any other fault while handling it) is this replica's failure,
                        # never the coordinator's: the other replicas keep serving.
                        raise FrameError(
                            f"replica {self.index} sent a frame the coordinator could not "
                            f"handle ({type(frame).__name__}): {type(exc).__name__}: {exc}"
                        ) from exc
                    dispatch_seconds += time.perf_counter() - began
                    self.relay_seconds = frames.decode_seconds + dispatch_seconds
                if not self._closing or not self._started:
                    cause = EOFError(f"replica {self.index} closed its output unexpectedly")
            except (FrameError, anyio.BrokenResourceError, OSError) as exc:
                cause = exc
            task_group.cancel_scope.cancel()
        if self._gone is not None:  # the writer failed first
            cause = self._gone
        if not self._started:
            if self._start_problem is None:
                self._start_problem = f"it did not start: {cause}"
                self._start_cause = cause
            return None
        return cause

    def settle_start(self, detail: str | None = None) -> None:
        """Called by the supervisor when it ends: a replica that never started failed to.

        Args:
            detail: What the supervisor knows besides (a process's exit status).
        """
        if self._ready.is_set():
            return
        problem = self._start_problem or "it did not start"
        error = ReplicaFailed(self.index, problem if detail is None else f"{problem}; {detail}")
        error.__cause__ = self._start_cause
        self._start_error = error
        self._ready.set()

    async def wait_closed(self, grace_period: float) -> None:
        """Return ``grace_period`` seconds after the replica was told to stop."""
        await self._closed.wait()
        await anyio.sleep(grace_period)

    def fail(self, cause: BaseException) -> None:
        """The replica is gone: fail its pending calls and tell the coordinator."""
        if self._gone is None:
            self._gone = cause
        for _, done, answer in self._calls.values():
            answer.append(ReplicaFailed(self.index, str(cause)))
            done.set()
        self._relay.replica_failed(self.index, cause)

    async def _writer(self, send: anyio.abc.ByteSendStream, scope: anyio.CancelScope) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                batch, self._outbox = self._outbox, []
                chunks = []
                for request_id, data in batch:
                    if request_id is not None:
                        if request_id not in self._unsent:
                            continue  # cancelled before it was sent
                        self._unsent.discard(request_id)
                    chunks.append(data)
                if chunks:
                    await send.send(b"".join(chunks))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            if not self._closing:
                self._gone = exc
                scope.cancel()

    def _dispatch(self, frame: Any) -> None:
        relay, index = self._relay, self.index
        if isinstance(frame, Deltas):
            for item in frame.items:
                relay.delta(index, item.request_id, delta_from_item(item))
        elif isinstance(frame, Accepted):
            relay.accepted(index, frame.request_id, tuple(frame.prompt_token_ids))
        elif isinstance(frame, FinishedPart):
            self._parts.setdefault(frame.request_id, []).append(frame)
        elif isinstance(frame, Finished):
            self._release(frame.request_id)
            ending = ending_from_finished(frame, self._parts.pop(frame.request_id, ()))
            relay.finished(index, frame.request_id, ending)
        elif isinstance(frame, Failed | Rejected):
            self._release(frame.request_id)
            self._parts.pop(frame.request_id, None)
            if isinstance(frame, Rejected):
                error = rejection_error(index, frame)
            else:
                error = request_error(index, frame.request_id, frame.kind, frame.message)
            relay.failed(index, frame.request_id, error)
        elif isinstance(frame, Stats):
            self._stats = engine_statistics(frame.values)
        elif isinstance(frame, Reply):
            pending = self._calls.get(frame.call_id)
            if pending is not None:
                method, done, answer = pending
                if method == "wait_idle" and frame.kind is None:
                    self._stats = engine_statistics(frame.value)
                    frame = Reply(frame.call_id, self._stats, None, "")
                answer.append(frame)
                done.set()
        elif isinstance(frame, Ready) and not self._ready.is_set():
            self.pid = self.pid or frame.pid  # a child process's pid is known already
            self._max_model_len = frame.max_model_len
            self._model_name = frame.model_name
            self._started = True
            self._ready.set()
        elif isinstance(frame, StartFailed) and not self._ready.is_set():
            self._start_problem = f"it could not start: {frame.kind}: {frame.message}"
        else:
            raise FrameError(f"unexpected frame from replica {index}: {frame!r}")
