"""A Message written from chat completion chunks, and the Messages API's event stream.

``/v1/messages`` runs through the chat path (:mod:`~twostroke.engine.server.messages`), which
answers with a chat completion, whole or as chunks. :class:`MessageDraft` turns those into
Anthropic content blocks (``text``, and ``tool_use`` with ``id``, ``name`` and ``input``),
``stop_reason``, ``stop_sequence`` and ``usage``, and into the Messages event sequence:
``message_start``, ``ping``, ``content_block_start`` / ``content_block_delta``
(``text_delta``, ``input_json_delta``) / ``content_block_stop`` for each block,
``message_delta`` and ``message_stop``. :class:`MessageEventSender` takes the place of the chat
path's :class:`~twostroke.engine.server.sse.EventSender` and sends those events instead; its
keep-alive is Anthropic's ``ping`` event.

The engine does not say which stop string ended an output, so the chat request keeps it in
the text (``include_stop_str_in_output``): the draft holds back as many characters as the
longest of ``stop_sequences`` until more text comes, and at the end a text that ends with one
of them loses it, and names it as ``stop_sequence`` (a text that ended on a stop string ends
with it; one that ended on EOS cannot, or the stop string would have ended it first).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
from starlette.types import Send

from twostroke.engine.server.errors import anthropic_error_type
from twostroke.engine.server.sse import EventSender

__all__ = ["MessageDraft", "MessageEventSender"]

#: Chat's ``finish_reason`` as Anthropic's ``stop_reason`` (``"stop"`` is ``end_turn``, or
#: ``stop_sequence`` when a stop sequence ended the text).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessageDraft:
    """A Message being written from a chat completion's chunks, and its stream's events.

    Pure bookkeeping, no I/O: :meth:`begin` gives the opening events, :meth:`chunk` the
    events for one chat completion chunk (text deltas open and extend a ``text`` block,
    ``delta.tool_calls`` open and extend ``tool_use`` blocks, an ``error`` ends the stream),
    :meth:`end` closes the open block and gives ``message_delta`` and ``message_stop``, and
    :meth:`message` is the Message object at any point. A complete (not streamed) answer is
    one chunk that holds all of it.

    Args:
        model: The served model's name.
        stop_sequences: The request's ``stop_sequences`` (the chat request keeps a matched
            one at the end of the text; the draft takes it off).
    """

    def __init__(self, model: str, stop_sequences: Sequence[str] = ()) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self._model = model
        # Longest first: where two end the text, the longer matched (it starts earlier).
        self._stops = sorted(stop_sequences, key=len, reverse=True)
        self._hold = len(self._stops[0]) if self._stops else 0
        self._content: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the block being written
        self._pending = ""  # text not yet sent: it may end with a stop sequence
        self._calls: dict[int, dict[str, Any]] = {}  # a chat call's index -> its block
        self._arguments: dict[int, str] = {}  # a block's index -> its input's JSON text
        self._finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.input_tokens = 0
        self._usage: dict[str, Any] = {}
        self.failed = False

    def message(self) -> dict[str, Any]:
        """The Message object as it stands."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [dict(block) for block in self._content],
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage(),
        }

    def usage(self) -> dict[str, Any]:
        """Anthropic's ``usage``: ``input_tokens`` are the prompt's tokens the prefix cache
        did not hold, ``cache_read_input_tokens`` those it did (their sum is the prompt)."""
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            **self._usage,
        }

    def begin(self) -> list[dict[str, Any]]:
        """``message_start`` (an empty Message) and a ``ping``."""
        return [{"type": "message_start", "message": self.message()}, {"type": "ping"}]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat completion chunk (or a whole answer as one)."""
        error = chunk.get("error")
        if isinstance(error, dict):
            return self._fail(error)
        events: list[dict[str, Any]] = []
        usage = chunk.get("usage")
        if usage is not None:
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            self._usage = {
                "input_tokens": usage["prompt_tokens"] - cached,
                "output_tokens": usage["completion_tokens"],
                "cache_read_input_tokens": cached,
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
        """Send what text is held back (less a stop sequence that ended it), close the open
        block, and finish: ``message_delta`` with ``stop_reason``, ``stop_sequence`` and
        ``usage``, then ``message_stop``; nothing after a failure."""
        if self.failed:
            return []
        reason = self._finish_reason or "stop"
        if reason == "stop":
            for stop in self._stops:
                if self._pending.endswith(stop):
                    self._pending = self._pending[: -len(stop)]
                    self.stop_sequence = stop
                    break
        self.stop_reason = "stop_sequence" if self.stop_sequence else _STOP_REASONS[reason]
        events = self._release(len(self._pending)) + self._close()
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return [*events, {"type": "message_delta", "delta": delta, "usage": self.usage()},
                {"type": "message_stop"}]  # fmt: skip

    def _fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        self.failed = True
        self._open = None
        kind = anthropic_error_type(500 if error.get("type") == "server_error" else 400,
                                    error.get("code"))  # fmt: skip
        return [{"type": "error", "error": {"type": kind, "message": str(error.get("message"))}}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        self._pending += text
        return self._release(len(self._pending) - self._hold)

    def _release(self, count: int) -> list[dict[str, Any]]:
        """The events that send the first ``count`` characters of the held-back text."""
        if count <= 0:
            return []
        text, self._pending = self._pending[:count], self._pending[count:]
        events = []
        block = self._open
        if block is None or block["type"] != "text":
            events += self._close()
            block = {"type": "text", "text": ""}
            events.append(self._start(block))
        block["text"] += text
        delta = {"type": "text_delta", "text": text}
        events.append({"type": "content_block_delta", "index": len(self._content) - 1,
                       "delta": delta})  # fmt: skip
        return events

    def _call(self, position: int, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        function = call.get("function") or {}
        block = self._calls.get(position)
        if block is None:  # a new call: its first chunk has its id and name
            # The text before a call is not the output's end: no stop sequence ends it.
            events += self._release(len(self._pending)) + self._close()
            block = {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                     "name": function.get("name", ""), "input": {}}  # fmt: skip
            self._calls[position] = block
            events.append(self._start(block))
        fragment = function.get("arguments") or ""
        if fragment:
            index = self._content.index(block)
            self._arguments[index] = self._arguments.get(index, "") + fragment
            delta = {"type": "input_json_delta", "partial_json": fragment}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        return events

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self._content.append(block)
        self._open = block
        return {"type": "content_block_start", "index": len(self._content) - 1,
                "content_block": dict(block)}  # fmt: skip

    def _close(self) -> list[dict[str, Any]]:
        """``content_block_stop`` for the block being written, if one is; a ``tool_use``
        block gets its ``input`` from the JSON its deltas carried (the chat path sends a
        call once its JSON is closed)."""
        block, self._open = self._open, None
        if block is None:
            return []
        index = self._content.index(block)
        if block["type"] == "tool_use":
            block["input"] = json.loads(self._arguments.get(index) or "{}")
        return [{"type": "content_block_stop", "index": index}]


class MessageEventSender(EventSender):
    """Takes the chat path's chunks (as
    :class:`~twostroke.engine.server.generation.Generation` streams them) and sends the
    Messages API's events instead: ``event:`` and ``data:`` lines, no ``[DONE]``; a
    keep-alive is a ``ping`` event.

    Args:
        send: The ASGI ``send``.
        draft: The Message being written.
    """

    def __init__(self, send: Send, draft: MessageDraft) -> None:
        super().__init__(send)
        self._draft = draft
        self.started = False
        self.ended = False

    async def start(self) -> None:
        await super().start()
        self.started = True
        await self._events(self._draft.begin())

    async def fail(self, error: dict[str, Any]) -> None:
        """End the stream with ``error`` (an API error's OpenAI-shaped body) as an ``error``
        event. For a stream cut short from outside (the server's shutdown), which would
        otherwise end chat-style.

        Raises:
            Disconnected: a send to the client failed.
        """
        await self._events(self._draft.chunk(error))
        await self.done()

    async def data(self, payload: object) -> None:
        assert isinstance(payload, dict)  # the chat path's chunks and errors
        await self._events(self._draft.chunk(payload))

    async def comment(self, text: str) -> None:
        await self._events([{"type": "ping"}])

    async def done(self) -> None:
        await self._events(self._draft.end())
        self.ended = True
        await self._write({"type": "http.response.body", "body": b"", "more_body": False})

    async def _events(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            payload = msgspec.json.encode(event)
            await self._body(b"event: " + event["type"].encode() + b"\ndata: " + payload + b"\n\n")
