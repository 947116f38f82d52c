"""A submitted request as its caller sees it: a handle to cancel it, stream it, or await it.

Delivery never blocks the engine: the bookkeeping stroke merges new output into the handle's
one pending :class:`~twostroke.engine.outputs.Delta` (coalescing, as vLLM's per-request output
collector does) and sets an event. A slow consumer therefore receives larger deltas, never a
growing queue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio
import anyio.lowlevel

from twostroke.engine.outputs import Delta, RequestOutput

__all__ = ["RequestHandle"]


class RequestHandle:
    """One request in flight. Created by :meth:`Engine.submit`; not constructed directly.

    The handle must be used from the event loop thread that runs the engine.
    """

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: tuple[int, ...],
        cancel: Callable[[int], None],
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._cancel = cancel
        self._pending: Delta | None = None
        self._ended = False
        # Made by the first waiter, dropped once set: a request nobody waits on yet (most of
        # a burst of submits) costs no event.
        self._wake: anyio.Event | None = None
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._streamed_to_end = False
        self._relay_delta: Callable[[Delta], None] | None = None
        self._relay_end: Callable[[RequestOutput | None, BaseException | None], None] | None
        self._relay_end = None

    # --- called by the engine ---------------------------------------------------------

    def _deliver(self, delta: Delta) -> None:
        if self._relay_delta is not None:
            self._relay_delta(delta)
            return
        self._pending = delta if self._pending is None else self._pending.merge(delta)
        self._wake_waiters()

    def _finish(self, output: RequestOutput | None, error: BaseException | None) -> None:
        if self._ended:
            return
        self._output = output
        self._error = error
        self._ended = True
        self._wake_waiters()
        if self._relay_end is not None:
            self._relay_end(output, error)

    def _relay_to(
        self,
        on_delta: Callable[[Delta], None],
        on_end: Callable[[RequestOutput | None, BaseException | None], None],
    ) -> None:
        """Hand every delta to ``on_delta`` instead of keeping it, and the end to ``on_end``.

        For the data-parallel coordinator, which feeds its own handle from a replica's: no
        task per request, no second buffer. Called right after ``submit``, before the engine
        can deliver anything (delivery happens in the bookkeeping stroke, after an await).
        Both callbacks run synchronously in the bookkeeping stroke and must not block.
        """
        self._relay_delta = on_delta
        self._relay_end = on_end

    def _wake_waiters(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.set()

    async def _wait_for_change(self) -> None:
        """Wait until the next delta or the end (every waiter re-checks what it waits for)."""
        if self._wake is None:
            self._wake = anyio.Event()
        await self._wake.wait()

    # --- public -----------------------------------------------------------------------

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

    def __repr__(self) -> str:
        state = "done" if self.done() else "open"
        return f"<RequestHandle {self.request_id} {state}>"
