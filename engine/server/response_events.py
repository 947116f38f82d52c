"""A Response written from chat completion chunks, and the Responses API's event stream.

``/v1/responses`` runs through the chat path (:mod:`~twostroke.engine.server.responses`),
which answers with a chat completion, whole or as chunks. :class:`ResponseDraft` turns those
into Responses output items (``message`` with ``output_text``, ``function_call`` with
``call_id``, ``name`` and ``arguments``), ``usage`` and ``status``, and into the Responses
event sequence, each event with its ``sequence_number``; :class:`ResponseEventSender` takes
the place of the chat path's :class:`~twostroke.engine.server.sse.EventSender` and sends those
events instead of chat chunks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.types import Send

from twostroke.engine.server.sse import EventSender

__all__ = ["ResponseDraft", "ResponseEventSender"]


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseDraft:
    """A Response being written from a chat completion's chunks, and its stream's events.

    Pure bookkeeping, no I/O: :meth:`begin` gives the opening events, :meth:`chunk` the
    events for one chat completion chunk (text deltas open and extend a ``message`` item,
    ``delta.tool_calls`` open and extend ``function_call`` items, an ``error`` fails the
    response), :meth:`end` closes the open items and completes the response, and
    :meth:`response` is the Response object at any point. Every event carries the next
    ``sequence_number``. A complete (not streamed) answer is one chunk that holds all of it.

    Args:
        model: The served model's name.
        echo: The request's fields a Response repeats (``instructions``, ``tools`` ...).
        previous_response_id: The response this one continues, if any.
        store: Whether the response is stored (the caller stores it, and sets this to
            ``False`` when the store would not take it).
    """

    def __init__(
        self,
        model: str,
        echo: dict[str, Any],
        *,
        previous_response_id: str | None = None,
        store: bool = False,
    ) -> None:
        self.id = _hex_id("resp")
        self.previous_response_id = previous_response_id
        self.store = store
        self._created = int(time.time())
        self._model = model
        self._echo = echo
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item that is being written
        self._calls: dict[int, dict[str, Any]] = {}  # a chat tool call's index -> its item
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._error: dict[str, Any] | None = None
        self.status = "in_progress"

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def response(self) -> dict[str, Any]:
        """The Response object as it stands."""
        incomplete = None
        if self.status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self._created,
            "model": self._model,
            "status": self.status,
            "error": self._error,
            "incomplete_details": incomplete,
            "output": list(self._output),
            "usage": self._usage,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "background": False,
            "metadata": {},
            **self._echo,
        }

    def begin(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat completion chunk (or a whole answer as one)."""
        error = chunk.get("error")
        if isinstance(error, dict):
            return self._fail(error)
        events: list[dict[str, Any]] = []
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
            self._usage = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                },
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or choice.get("message") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for position, call in enumerate(delta.get("tool_calls") or ()):
                events += self._call(call.get("index", position), call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def end(self) -> list[dict[str, Any]]:
        """Close what is open and finish: ``response.completed`` (``response.incomplete``
        when the output ran into its token limit); nothing more after a failure."""
        if self.status == "failed":
            return []
        events = self._close()
        if not self._output:  # an empty answer is still one message
            events += self._text("")
            events += self._close()
        if self._finish_reason == "length":
            self.status = "incomplete"
            return [*events, self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return [*events, self._event("response.completed", response=self.response())]

    def _fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        code, message = error.get("code"), str(error.get("message"))
        self.status = "failed"
        self._error = {"code": code or "server_error", "message": message}
        self._open = None
        return [
            self._event("error", code=code, message=message, param=error.get("param")),
            self._event("response.failed", response=self.response()),
        ]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        item = self._open
        if item is None or item["type"] != "message":
            events += self._close()
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": _hex_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
            events.append(self._added(item))
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self._output) - 1, content_index=0,
                                      part=dict(part)))  # fmt: skip
        if text:
            item["content"][0]["text"] += text
            events.append(self._event("response.output_text.delta", item_id=item["id"],
                                      output_index=len(self._output) - 1, content_index=0,
                                      delta=text, logprobs=[]))  # fmt: skip
        return events

    def _call(self, position: int, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        function = call.get("function") or {}
        item = self._calls.get(position)
        if item is None:  # a new call: its first chunk has its id and name
            events += self._close()
            item = {"id": _hex_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call.get("id") or _hex_id("call"),
                    "name": function.get("name", ""), "arguments": ""}  # fmt: skip
            self._calls[position] = item
            events.append(self._added(item))
        fragment = function.get("arguments") or ""
        if fragment:
            item["arguments"] += fragment
            index = self._output.index(item)
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=index,
                                      delta=fragment))  # fmt: skip
        return events

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        self._output.append(item)
        self._open = item
        return self._event("response.output_item.added", output_index=len(self._output) - 1,
                           item=_copy(item))  # fmt: skip

    def _close(self) -> list[dict[str, Any]]:
        """The events that finish the item being written, if one is."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._output.index(item)
        item["status"] = "incomplete" if self._finish_reason == "length" else "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                self._event("response.output_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=part["text"],
                            logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=dict(part)),
            ]  # fmt: skip
        else:
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))  # fmt: skip
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=_copy(item)))  # fmt: skip
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (events must not change when the item grows later)."""
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(part) for part in copied["content"]]
    return copied


class ResponseEventSender(EventSender):
    """Takes the chat path's chunks (as
    :class:`~twostroke.engine.server.generation.Generation` streams them) and sends the
    Responses API's events instead: ``event:`` and ``data:`` lines, no ``[DONE]``.

    Args:
        send: The ASGI ``send``.
        draft: The Response being written.
        before_end: Awaited once the response is finished, before its last event is sent
            (where the response is stored, so that a client that reads that event may name
            it at once); it may change ``draft.store``.
    """

    def __init__(
        self,
        send: Send,
        draft: ResponseDraft,
        *,
        before_end: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(send)
        self._draft = draft
        self._before_end = before_end
        self.started = False
        self.ended = False

    async def start(self) -> None:
        await super().start()
        self.started = True
        await self._events(self._draft.begin())

    async def fail(self, error: dict[str, Any]) -> None:
        """End the stream with ``error`` (an API error's body): the ``error`` and
        ``response.failed`` events, then the end of the body. For a stream cut short from
        outside (the server's shutdown), which would otherwise end chat-style.

        Raises:
            Disconnected: a send to the client failed.
        """
        await self._events(self._draft.chunk(error))
        await self.done()

    async def data(self, payload: object) -> None:
        assert isinstance(payload, dict)  # the chat path's chunks and errors
        await self._events(self._draft.chunk(payload))

    async def done(self) -> None:
        events = self._draft.end()
        if self._before_end is not None:
            await self._before_end()
            if events and "response" in events[-1]:  # the final object, as stored
                events[-1]["response"] = self._draft.response()
        await self._events(events)
        self.ended = True
        await self._write({"type": "http.response.body", "body": b"", "more_body": False})

    async def _events(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            payload = msgspec.json.encode(event)
            await self._body(b"event: " + event["type"].encode() + b"\ndata: " + payload + b"\n\n")
