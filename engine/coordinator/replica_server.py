"""One engine replica behind the frame protocol: a child process, or the body of a Ray actor.

``python -m twostroke.engine.coordinator.replica_server [--backend asyncio|trio]`` reads
:data:`~.frames.ToReplica` frames on stdin and writes :data:`~.frames.FromReplica` frames on
stdout (anything else the process prints goes to stderr: stdout is dup'ed away first). The
first frame, :class:`~.frames.Start`, names the model and the engine's options; the replica
opens its :class:`~twostroke.engine.engine.Engine` and answers :class:`~.frames.Ready` (or
:class:`~.frames.StartFailed`).

Everything model-specific happens here, never in the coordinator: tokenizing the prompt as
given (text, token ids or chat messages), checking its length, detokenizing incrementally and
matching stop strings. Output leaves as coalesced deltas: the engine's handles relay into one
pending delta per request (:meth:`RequestHandle.relay_to`), and a writer task sends every
pending delta in one frame whenever the pipe can take it, so a slow coordinator receives
bigger deltas, never a growing queue. No frame is longer than the coordinator accepts
(:data:`~.frames.MAX_FRAME_BYTES`): deltas piled up past it go in several frames, a long
finished output in :class:`~.frames.FinishedPart` frames ahead of its ``Finished``, and a
reply too long is answered with an error instead.

Ordering is the pipe's: a request's ``Accepted`` precedes its deltas, which precede its end.
A ``Cancel`` for a request not seen yet (it overtook its ``Add``) is remembered and honoured
when the ``Add`` arrives. End of input without ``Shutdown`` means the coordinator is gone:
the replica cancels everything and exits.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import msgspec

from twostroke.engine.coordinator.frames import (
    MAX_FRAME_BYTES,
    Accepted,
    Add,
    Call,
    Cancel,
    DefineConstraint,
    DeltaItem,
    Deltas,
    Failed,
    Finished,
    FinishedPart,
    ForgetConstraint,
    FrameError,
    FrameReader,
    FrameTooLarge,
    OutputPiece,
    Ready,
    Reply,
    Shutdown,
    Start,
    StartFailed,
    Stats,
    ToReplica,
    encode_frame,
    encoded_size,
    split_output,
)
from twostroke.engine.coordinator.wire_constraints import constraint_from_wire, params_from_wire
from twostroke.engine.coordinator.wire_outputs import (
    delta_item,
    failed_frame,
    finished_frame,
    rejected_frame,
)
from twostroke.engine.engine import Engine
from twostroke.engine.errors import EngineError, RequestCancelled
from twostroke.engine.handle import RequestHandle
from twostroke.engine.outputs import Delta, RequestOutput
from twostroke.states.constraints import Constraint

__all__ = ["FdReceiveStream", "FdSendStream", "main", "serve"]

#: How many ids of ended (or early-cancelled) requests a replica remembers, to tell a late
#: cancel (ignored) from one that overtook its add (honoured).
_REMEMBERED = 4096

#: Bytes of a ``Deltas`` frame around its items (its tag and two array headers, rounded up).
_DELTAS_OVERHEAD = 16


def delta_frames(items: list[DeltaItem], limit: int) -> list[bytes]:
    """``Deltas`` frames of at most ``limit`` bytes that carry ``items``, in order.

    One frame when they fit (the common case: encoded once); otherwise the items are packed
    into several, and an item too long for one frame is cut into consecutive items of the
    same request (only the last keeps its finish reason). Nothing is dropped.
    """
    try:
        return [encode_frame(Deltas(items), limit=limit)]
    except FrameTooLarge:
        pass
    budget = limit - _DELTAS_OVERHEAD
    frames: list[bytes] = []
    batch: list[DeltaItem] = []
    used = 0
    for item in items:
        for part in _split_item(item, budget):
            size = encoded_size(part)
            if batch and used + size > budget:
                frames.append(encode_frame(Deltas(batch), limit=limit))
                batch, used = [], 0
            batch.append(part)
            used += size
    if batch:
        frames.append(encode_frame(Deltas(batch), limit=limit))
    return frames


def _split_item(item: DeltaItem, budget: int) -> list[DeltaItem]:
    def size_of(piece: OutputPiece) -> int:
        return encoded_size(DeltaItem(item.request_id, *piece, item.finish_reason))

    pieces = split_output((item.text, item.token_ids, item.logprobs), size_of, budget)
    last = len(pieces) - 1
    return [
        DeltaItem(
            item.request_id, text, token_ids, logprobs, item.finish_reason if i == last else None
        )
        for i, (text, token_ids, logprobs) in enumerate(pieces)
    ]


def finished_frames(frame: Finished, limit: int) -> list[bytes]:
    """``frame``, as :class:`FinishedPart` frames then a ``Finished``, none over ``limit``."""
    try:
        return [encode_frame(frame, limit=limit)]
    except FrameTooLarge:
        pass

    def with_output(piece: OutputPiece) -> Finished:
        text, token_ids, logprobs = piece
        return msgspec.structs.replace(frame, text=text, token_ids=token_ids, logprobs=logprobs)

    # A piece that fits a Finished fits a FinishedPart (its other fields take more room).
    pieces = split_output(
        (frame.text, frame.token_ids, frame.logprobs),
        lambda piece: encoded_size(with_output(piece)),
        limit,
    )
    *parts, last = pieces
    frames = [
        encode_frame(FinishedPart(frame.request_id, token_ids, text, logprobs), limit=limit)
        for text, token_ids, logprobs in parts
    ]
    frames.append(encode_frame(with_output(last), limit=limit))
    return frames


class _Bounded:
    """A set of ids that forgets the oldest beyond a size."""

    def __init__(self, size: int) -> None:
        self._ids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._size = size

    def add(self, item: int) -> None:
        self._ids[item] = None
        if len(self._ids) > self._size:
            self._ids.popitem(last=False)

    def pop(self, item: int) -> bool:
        """Remove ``item``; whether it was there."""
        if item in self._ids:
            del self._ids[item]
            return True
        return False

    def __contains__(self, item: int) -> bool:
        return item in self._ids


class _Server:
    """The replica's side of the protocol, around one open engine."""

    def __init__(self, engine: Engine, send: anyio.abc.ByteSendStream, limit: int) -> None:
        self._engine = engine
        self._send = send
        self._limit = limit
        self._handles: dict[int, RequestHandle] = {}
        self._control: list[Any] = []
        self._deltas: dict[int, Delta] = {}
        self._ends: list[Finished | Failed] = []
        self._wake = anyio.Event()
        self._ended = _Bounded(_REMEMBERED)
        self._cancelled_early = _Bounded(_REMEMBERED)
        self._stopping = False
        self._broken = False
        self._stats_scope = anyio.CancelScope()
        #: The constraints the coordinator defined, by id (or why each was refused).
        self._constraints: dict[int, Constraint | Exception] = {}

    async def run(self, frames: FrameReader, stats_interval: float) -> None:
        error: FrameError | None = None
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._writer)
            task_group.start_soon(self._report_statistics, stats_interval)
            cancel = True  # the coordinator vanished (or broke the protocol) unless it said so
            try:
                async for frame in frames:
                    if isinstance(frame, Add):
                        self._add(frame)
                    elif isinstance(frame, DefineConstraint):
                        self._define(frame)
                    elif isinstance(frame, ForgetConstraint):
                        self._constraints.pop(frame.constraint_id, None)
                    elif isinstance(frame, Cancel):
                        self._cancel(frame.request_id)
                    elif isinstance(frame, Call):
                        task_group.start_soon(self._call, frame)
                    elif isinstance(frame, Shutdown):
                        cancel = frame.cancel
                        break
                    else:
                        raise FrameError(f"unexpected frame from the coordinator: {frame!r}")
            except FrameError as exc:
                error = exc  # raised once every request has ended, outside the task group
            if cancel:
                for handle in list(self._handles.values()):
                    handle.cancel()
            await self._engine.wait_idle()
            # The writer sends what is left and returns; the statistics task stops.
            self._stopping = True
            self._stats_scope.cancel()
            self._wake.set()
        if error is not None:
            raise error

    # --- requests -----------------------------------------------------------------------

    def _add(self, frame: Add) -> None:
        request_id = frame.request_id
        if self._cancelled_early.pop(request_id):
            self._ended.add(request_id)
            self._push_end(failed_frame(request_id, RequestCancelled(request_id)))
            return
        try:
            params = params_from_wire(frame, self._constraints)
            # The engine checks the prompt's shape (its types are the engine's Prompt).
            handle = self._engine.submit(cast(Any, frame.prompt), params)
        except (EngineError, TypeError, ValueError) as exc:
            self._ended.add(request_id)
            self._push(rejected_frame(request_id, exc))
            return
        self._handles[request_id] = handle
        handle.relay_to(partial(self._on_delta, request_id), partial(self._on_end, request_id))
        self._push(Accepted(request_id, list(handle.prompt_token_ids)))

    def _define(self, frame: DefineConstraint) -> None:
        """Make a constraint that requests will name; one the constraint's checks refuse is
        each such request's refusal."""
        try:
            self._constraints[frame.constraint_id] = constraint_from_wire(frame.constraint)
        except (TypeError, ValueError) as exc:
            self._constraints[frame.constraint_id] = exc

    def _cancel(self, request_id: int) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.cancel()
        elif request_id not in self._ended:
            self._cancelled_early.add(request_id)

    def _on_delta(self, request_id: int, delta: Delta) -> None:
        pending = self._deltas.get(request_id)
        self._deltas[request_id] = delta if pending is None else pending.merge(delta)
        self._wake.set()

    def _on_end(
        self, request_id: int, output: RequestOutput | None, error: BaseException | None
    ) -> None:
        del self._handles[request_id]
        self._ended.add(request_id)
        if output is not None:
            self._push_end(finished_frame(request_id, output))
        else:
            assert error is not None
            self._push_end(failed_frame(request_id, error))

    async def _call(self, frame: Call) -> None:
        value: Any = None
        try:
            if frame.method == "tokenize":
                value = await self._engine.tokenize(frame.argument)
            elif frame.method == "detokenize":
                value = await self._engine.detokenize(frame.argument)
            elif frame.method == "wait_idle":
                await self._engine.wait_idle()
                value = attrs.asdict(self._engine.statistics())
            else:
                raise ValueError(f"unknown replica call {frame.method!r}")
        except (EngineError, TypeError, ValueError) as exc:
            self._push(Reply(frame.call_id, None, type(exc).__name__, str(exc)))
            return
        reply = Reply(frame.call_id, value, None, "")
        try:
            encode_frame(reply, limit=self._limit)
        except FrameTooLarge as exc:  # refused here, rather than break the coordinator's limit
            reply = Reply(frame.call_id, None, "ValueError", f"the reply does not fit: {exc}")
        self._push(reply)

    # --- output -------------------------------------------------------------------------

    def _push(self, frame: Any) -> None:
        if frame is not None:
            self._control.append(frame)
        self._wake.set()

    def _push_end(self, frame: Finished | Failed) -> None:
        self._ends.append(frame)
        self._wake.set()

    def _take(self) -> bytes:
        """Everything pending, encoded: control frames, then deltas, then ends.

        No frame is longer than the coordinator's limit: deltas that would be are spread
        over several frames, and a finished output over parts ahead of its ``Finished``.
        """
        limit = self._limit
        chunks = [encode_frame(frame, limit=limit) for frame in self._control]
        if self._deltas:
            items = [delta_item(request_id, delta) for request_id, delta in self._deltas.items()]
            chunks.extend(delta_frames(items, limit))
        for end in self._ends:
            if isinstance(end, Finished):
                chunks.extend(finished_frames(end, limit))
            else:
                chunks.append(encode_frame(end, limit=limit))
        self._control.clear()
        self._deltas.clear()
        self._ends.clear()
        return b"".join(chunks)

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            data = self._take()
            if data and not self._broken:
                try:
                    await self._send.send(data)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    self._broken = True  # the coordinator is gone: drain, send nothing
            if self._stopping:
                return

    async def _report_statistics(self, interval: float) -> None:
        last: dict[str, Any] | None = None
        with self._stats_scope:
            while True:
                values = attrs.asdict(self._engine.statistics())
                if values != last:
                    self._push(Stats(values))
                    last = values
                await anyio.sleep(interval)


async def serve(
    receive: anyio.abc.ByteReceiveStream,
    send: anyio.abc.ByteSendStream,
    *,
    stats_interval: float = 0.5,
    max_frame_bytes: int = MAX_FRAME_BYTES,
) -> None:
    """Serve one coordinator over a pair of byte streams until it says ``Shutdown``.

    Args:
        receive: Where :data:`~.frames.ToReplica` frames arrive.
        send: Where :data:`~.frames.FromReplica` frames go.
        stats_interval: Seconds between statistics snapshots (sent only when changed).
        max_frame_bytes: The longest frame either side sends or accepts.

    Raises:
        FrameError: the coordinator sent a malformed frame, or no ``Start`` first.
        EngineDead: the engine died (every open request was told first).
    """
    frames = FrameReader(receive, ToReplica, "the coordinator", limit=max_frame_bytes)
    start = await anext(frames, None)
    if not isinstance(start, Start):
        raise FrameError(f"the first frame from the coordinator must be Start, got {start!r}")
    async with contextlib.AsyncExitStack() as stack:
        try:
            engine = await stack.enter_async_context(Engine.open(start.model, **start.options))
        except Exception as exc:
            await send.send(encode_frame(StartFailed(type(exc).__name__, str(exc))))
            return
        ready = Ready(os.getpid(), engine.model_name, engine.max_model_len)
        await send.send(encode_frame(ready))
        await _Server(engine, send, max_frame_bytes).run(frames, stats_interval)


# --- the child process ------------------------------------------------------------------


class FdReceiveStream(anyio.abc.ByteReceiveStream):
    """Bytes from a pipe's file descriptor, without threads (``anyio.wait_readable``)."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            await anyio.lowlevel.checkpoint()
            if not data:
                raise anyio.EndOfStream
            return data

    async def aclose(self) -> None:
        await anyio.lowlevel.checkpoint()


class FdSendStream(anyio.abc.ByteSendStream):
    """Bytes to a pipe's file descriptor, without threads (``anyio.wait_writable``)."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd

    async def send(self, item: bytes) -> None:
        view = memoryview(item)
        while view:
            try:
                written = os.write(self._fd, view)
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
                continue
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise anyio.BrokenResourceError from exc
            view = view[written:]
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await anyio.lowlevel.checkpoint()


async def _serve_stdio(frames_fd: int) -> None:
    await serve(FdReceiveStream(0), FdSendStream(frames_fd))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one replica on stdin/stdout (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m twostroke.engine.coordinator.replica_server")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args(argv)
    frames_fd = os.dup(1)
    os.dup2(2, 1)  # print() and stray library output must never corrupt the frames
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    anyio.run(_serve_stdio, frames_fd, backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
