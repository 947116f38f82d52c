"""An answer streamed as named server-sent events (``event:`` and ``data:`` lines).

The Responses and Messages APIs stream their answers as named events rather than chat's
``data:`` chunks and ``[DONE]``. Each has a *draft*, a pure fold of the answer's typed events
(:mod:`~twostroke.engine.server.answer_events`) into its object and its wire events;
:class:`EventWriter` sends what a draft gives as the chat service streams, and is the
:class:`~twostroke.engine.server.chat_service.AnswerWriter` of both endpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
from starlette.types import Send

from twostroke.engine.server.answer_events import (
    AnswerEvent,
    ArgumentsDelta,
    CallStarted,
    Finished,
    TextDelta,
    ThinkingDelta,
    Usage,
)
from twostroke.engine.server.errors import ApiError
from twostroke.engine.server.guards import shutting_down
from twostroke.engine.server.sse import Disconnected, EventSender
from twostroke.engine.server.transport import CLOSING_SECONDS

__all__ = ["Draft", "EventWriter"]


class Draft:
    """An endpoint's answer being written, a fold of the answer's events: each method gives
    the wire events it adds. :meth:`apply` hands each event to the endpoint's own step."""

    def begin(self) -> list[dict[str, Any]]:
        """The opening events."""
        raise NotImplementedError

    def apply(self, events: Sequence[AnswerEvent]) -> list[dict[str, Any]]:
        """The wire events for the answer's next ``events``."""
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, TextDelta):
                out += self._text(event.text) if event.text else []
            elif isinstance(event, ThinkingDelta):
                out += self._thinking(event.text) if event.text else []
            elif isinstance(event, CallStarted):
                out += self._started(event)
            elif isinstance(event, ArgumentsDelta):
                out += self._call_arguments(event) if event.text else []
            elif isinstance(event, Finished):
                self._finished(event.reason)
            else:
                self._counted(event)
        return out

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        """The events that end the answer with ``error``."""
        raise NotImplementedError

    def end(self) -> list[dict[str, Any]]:
        """The events that finish the answer (none after a failure)."""
        raise NotImplementedError

    def _text(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _started(self, call: CallStarted) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _call_arguments(self, delta: ArgumentsDelta) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _finished(self, reason: str) -> None:
        raise NotImplementedError

    def _counted(self, usage: Usage) -> None:
        raise NotImplementedError


class EventWriter:
    """Streams one draft's events as named server-sent events.

    Args:
        send: The ASGI ``send``.
        draft: The answer being written.
        ping: The event a keep-alive is (Anthropic's ``ping``); ``None``: an SSE comment.
        before_end: Awaited once the answer is finished, before its last event is sent
            (the Responses API stores its response there); it returns the last events as
            they are to be sent.

    Raises:
        Disconnected: from any method, once a send to the client fails.
    """

    def __init__(
        self,
        send: Send,
        draft: Draft,
        *,
        ping: dict[str, Any] | None = None,
        before_end: Callable[[list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]] | None = None,
    ) -> None:
        self._sender = EventSender(send)
        self._send = send
        self._draft = draft
        self._ping = ping
        self._before_end = before_end
        self.started = False
        self.ended = False

    async def open(self) -> None:
        await self._sender.start()
        self.started = True
        await self._events(self._draft.begin())

    async def write(self, events: Sequence[AnswerEvent]) -> None:
        await self._events(self._draft.apply(events))

    async def keepalive(self) -> None:
        if self._ping is None:
            await self._sender.comment("keep-alive")
        else:
            await self._events([self._ping])

    async def fail(self, error: ApiError) -> None:
        await self._events(self._draft.fail(error))

    async def close(self) -> None:
        events = self._draft.end()
        if self._before_end is not None:
            events = await self._before_end(events)
        await self._events(events)
        self.ended = True
        await self._sender.end()

    async def cut(self) -> None:
        """End a started stream that the server's shutdown cancelled with the endpoint's
        own error events (the server would end it chat-style), shielded and within the time
        the server gives open responses to end (a client that does not read is not waited
        for). One that has not started is left to the server's 503."""
        if not self.started or self.ended:
            return
        error = shutting_down("the request did not finish within the grace period")
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSING_SECONDS):
            with contextlib.suppress(Disconnected):
                await self.fail(error)
                await self.close()

    async def _events(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            payload = msgspec.json.encode(event)
            await self._sender.raw(
                b"event: " + event["type"].encode() + b"\ndata: " + payload + b"\n\n"
            )
