"""A submitted request as two ends, split as anyio splits a memory object stream.

:func:`create_request_handle` makes the pair: the caller holds the reading end, a
:class:`RequestHandle` (cancel it, stream it, await it); whoever produces the request's
output holds the writing end, a :class:`HandleWriter` (the engine's delivery, or the
coordinator's relay).

Writing never blocks the engine: the writer merges new output into the handle's one pending
:class:`~twostroke.engine.outputs.Delta` (coalescing, as vLLM's per-request output collector
does) and wakes whoever waits. A slow consumer therefore receives larger deltas, never a
growing queue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio
import anyio.lowlevel

from twostroke.engine.outputs import Delta, RequestOutput

__all__ = ["HandleWriter", "OnDelta", "OnEnd", "RequestHandle", "create_request_handle"]

#: Takes each delta of a relayed handle (see :meth:`RequestHandle.relay_to`).
OnDelta = Callable[[Delta], None]
#: Takes a relayed handle's end: its output, or the error it ended with (the other is ``None``).
OnEnd = Callable[[RequestOutput | None, BaseException | None], None]


def create_request_handle(
    request_id: int, prompt_token_ids: tuple[int, ...], cancel: Callable[[int], None]
) -> tuple[HandleWriter, RequestHandle]:
    """The two ends of one request: its writer and its handle.

    Args:
        request_id: The request's id.
        prompt_token_ids: Its prompt's ids (empty until known: see
            :meth:`HandleWriter.set_prompt_token_ids`).
        cancel: Called with ``request_id`` when the caller cancels (at most once per
            :meth:`RequestHandle.cancel` call, never once the request ended).

    Returns:
        ``(writer, handle)``, in the order of :func:`anyio.create_memory_object_stream`.
    """
    handle = RequestHandle(request_id, prompt_token_ids, cancel)
    return HandleWriter(handle), handle


class RequestHandle:
    """One request in flight, as its caller sees it. Made by :meth:`Engine.submit`.

    The handle must be used from the event loop thread that runs the engine.
    """

    # One per request (a burst of submits makes thousands): no instance dict.
    __slots__ = (
        "_cancel",
        "_ended",
        "_error",
        "_on_delta",
        "_on_end",
        "_output",
        "_pending",
        "_prompt_token_ids",
        "_streamed_to_end",
        "_wake",
        "request_id",
    )

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: tuple[int, ...],
        cancel: Callable[[int], None],
    ) -> None:
        self.request_id = request_id
        self._prompt_token_ids = prompt_token_ids
        self._cancel = cancel
        self._pending: Delta | None = None
        self._ended = False
        # Made by the first waiter, dropped once set: a request nobody waits on yet (most of
        # a burst of submits) costs no event.
        self._wake: anyio.Event | None = None
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._streamed_to_end = False
        self._on_delta: OnDelta | None = None
        self._on_end: OnEnd | None = None

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids (behind a coordinator: empty until a replica took it)."""
        return self._prompt_token_ids

    def done(self) -> bool:
        """Whether the request has ended (finished, failed or cancelled)."""
        return self._ended

    def cancel(self) -> None:
        """Ask the engine to cancel the request. Idempotent; returns at once.

        The cancellation is applied by the engine at the next step boundary; the request's
        KV blocks are free once the step in flight that used them completes.
        """
        if not self._ended:
            self._cancel(self.request_id)

    async def result(self) -> RequestOutput:
        """Wait for the complete output.

        Cancelling the task that awaits this abandons the wait; the request goes on (use
        :meth:`cancel`, or :meth:`Engine.generate`, which owns its request).

        Raises:
            RequestFailed: a step of this request failed.
            RequestCancelled: the request was cancelled.
            EngineDead: the engine died.
            EngineClosed: the engine shut down in ``cancel`` mode before it finished.
        """
        await anyio.lowlevel.checkpoint()
        while not self._ended:
            await self._wait_for_change()
        if self._error is not None:
            raise self._error
        assert self._output is not None
        return self._output

    async def next_delta(self) -> Delta:
        """Wait for new output and return everything produced since the last call.

        Raises:
            StopAsyncIteration: the final delta was already returned.
            RequestFailed, RequestCancelled, EngineDead, EngineClosed: as :meth:`result`.
        """
        await anyio.lowlevel.checkpoint()
        while True:
            if self._pending is not None:
                delta, self._pending = self._pending, None
                if delta.finished:
                    self._streamed_to_end = True
                return delta
            if self._error is not None:
                raise self._error
            if self._streamed_to_end or (self._ended and self._output is not None):
                raise StopAsyncIteration
            await self._wait_for_change()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        return await self.next_delta()

    def relay_to(self, on_delta: OnDelta, on_end: OnEnd) -> None:
        """Read by callbacks: hand every later delta to ``on_delta``, and the end to ``on_end``.

        For a consumer that feeds its own output from this handle's, as the coordinator
        does from a replica's engine: no task per request, no second buffer. Deltas no
        longer collect here (:meth:`next_delta` sees none); :meth:`result` still works.
        Call it right after ``submit``: the engine delivers only in its bookkeeping stroke,
        after an await. Both callbacks run synchronously there and must not block.

        Raises:
            RuntimeError: the handle relays already, or has output or an end not yet relayed.
        """
        if self._on_delta is not None:
            raise RuntimeError(f"can't relay request {self.request_id} twice")
        if self._pending is not None or self._ended:
            raise RuntimeError(
                f"can't relay request {self.request_id}: output reached its handle first"
            )
        self._on_delta = on_delta
        self._on_end = on_end

    def __repr__(self) -> str:
        state = "done" if self._ended else "open"
        return f"<RequestHandle {self.request_id} {state}>"

    async def _wait_for_change(self) -> None:
        """Wait until the next delta or the end (every waiter re-checks what it waits for)."""
        if self._wake is None:
            self._wake = anyio.Event()
        await self._wake.wait()

    def _wake_waiters(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.set()


class HandleWriter:
    """The writing end of a :class:`RequestHandle`: where its output and its end go.

    Held by the engine's delivery (or the coordinator's relay), never by the caller. Every
    call is synchronous and returns at once. (The writer shares the handle's state, as the
    two ends of an anyio memory stream share theirs: the handle's private fields are this
    module's own.)
    """

    __slots__ = ("_handle",)

    def __init__(self, handle: RequestHandle) -> None:
        self._handle = handle

    @property
    def handle(self) -> RequestHandle:
        """The reading end."""
        return self._handle

    def set_prompt_token_ids(self, prompt_token_ids: tuple[int, ...]) -> None:
        """Tell the handle its prompt's ids, once known (behind a coordinator)."""
        self._handle._prompt_token_ids = prompt_token_ids

    def deliver(self, delta: Delta) -> None:
        """New output: merged into the handle's pending delta, or relayed at once."""
        handle = self._handle
        if handle._on_delta is not None:
            handle._on_delta(delta)
            return
        pending = handle._pending
        handle._pending = delta if pending is None else pending.merge(delta)
        handle._wake_waiters()

    def finish(self, output: RequestOutput) -> None:
        """The request finished with ``output``. Nothing if it has ended already."""
        self._end(output, None)

    def fail(self, error: BaseException) -> None:
        """The request ended with ``error`` (raised to its readers). Nothing if it has ended
        already."""
        self._end(None, error)

    def _end(self, output: RequestOutput | None, error: BaseException | None) -> None:
        handle = self._handle
        if handle._ended:
            return
        handle._output = output
        handle._error = error
        handle._ended = True
        handle._wake_waiters()
        if handle._on_end is not None:
            handle._on_end(output, error)

    def __repr__(self) -> str:
        return f"<HandleWriter of {self._handle!r}>"
