"""A Message written from the chat service's answer events, and the Messages event stream.

``/v1/messages`` runs on the chat service (:mod:`~twostroke.engine.server.chat_service`),
which answers with typed events (:mod:`~twostroke.engine.server.answer_events`), whole or as
they stream. :class:`MessageDraft` folds them into Anthropic content blocks (``text``, and
``tool_use`` with ``id``, ``name`` and ``input``), ``stop_reason``, ``stop_sequence`` and
``usage``, and into the Messages event sequence: ``message_start``, ``ping``,
``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``) /
``content_block_stop`` for each block, ``message_delta`` and ``message_stop``. An
:class:`~twostroke.engine.server.event_writer.EventWriter` sends those events as the answer
streams; its keep-alive is Anthropic's ``ping`` event (:data:`PING`).

The engine does not say which stop string ended an output, so the chat request keeps it in
the text (``include_stop``): the draft holds back as many characters as the longest of
``stop_sequences`` until more text comes, and at the end a text that ends with one of them
loses it, and names it as ``stop_sequence`` (a text that ended on a stop string ends with it;
one that ended on EOS cannot, or the stop string would have ended it first).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from twostroke.engine.server.answer_events import ArgumentsDelta, CallStarted, Usage
from twostroke.engine.server.errors import ApiError, anthropic_error_type
from twostroke.engine.server.event_writer import Draft

__all__ = ["PING", "MessageDraft"]

#: Anthropic's keep-alive event.
PING: dict[str, Any] = {"type": "ping"}

#: Chat's ``finish_reason`` as Anthropic's ``stop_reason`` (``"stop"`` is ``end_turn``, or
#: ``stop_sequence`` when a stop sequence ended the text).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessageDraft(Draft):
    """A Message being written from the answer's events, and its stream's events.

    Pure bookkeeping, no I/O: :meth:`begin` gives the opening events,
    :meth:`~twostroke.engine.server.event_writer.Draft.apply` the events for the answer's next
    events (text deltas open and extend a ``text`` block, a call's start opens a ``tool_use`` block
    that its arguments extend), :meth:`fail` ends the stream with an ``error`` event, :meth:`end`
    closes the open block and gives ``message_delta`` and ``message_stop``, and :meth:`message` is
    the Message object at any point. A complete (not streamed) answer is the same fold over the
    whole answer's events.

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
        self._calls: dict[int, dict[str, Any]] = {}  # a call's index -> its block
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

    def _finished(self, reason: str) -> None:
        self._finish_reason = reason

    def _counted(self, usage: Usage) -> None:
        # the prompt's tokens the prefix cache did not hold, and those it did
        self._usage = {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens,
        }

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

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        """Anthropic's ``error`` event: the stream ends with it."""
        self.failed = True
        self._open = None
        kind = anthropic_error_type(500 if error.type == "server_error" else 400, error.code)
        return [{"type": "error", "error": {"type": kind, "message": error.message}}]

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

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        """A ``thinking`` block (opened at the first piece) and its ``thinking_delta``. Its
        ``signature`` is empty: nothing signs a local model's reasoning, and a client that
        sends the block back has it dropped from the context, as Anthropic drops it."""
        events: list[dict[str, Any]] = []
        block = self._open
        if block is None or block["type"] != "thinking":
            events += self._release(len(self._pending)) + self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""}
            events.append(self._start(block))
        block["thinking"] += text
        delta = {"type": "thinking_delta", "thinking": text}
        events.append({"type": "content_block_delta", "index": len(self._content) - 1,
                       "delta": delta})  # fmt: skip
        return events

    def _started(self, call: CallStarted) -> list[dict[str, Any]]:
        # The text before a call is not the output's end: no stop sequence ends it.
        events = self._release(len(self._pending)) + self._close()
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        self._calls[call.index] = block
        events.append(self._start(block))
        return events

    def _call_arguments(self, delta: ArgumentsDelta) -> list[dict[str, Any]]:
        index = self._content.index(self._calls[delta.index])
        self._arguments[index] = self._arguments.get(index, "") + delta.text
        json_delta = {"type": "input_json_delta", "partial_json": delta.text}
        return [{"type": "content_block_delta", "index": index, "delta": json_delta}]

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self._content.append(block)
        self._open = block
        return {"type": "content_block_start", "index": len(self._content) - 1,
                "content_block": dict(block)}  # fmt: skip

    def _close(self) -> list[dict[str, Any]]:
        """``content_block_stop`` for the block being written, if one is; a ``tool_use``
        block gets its ``input`` from the JSON its deltas carried (the chat service reports a
        call once its JSON is closed)."""
        block, self._open = self._open, None
        if block is None:
            return []
        index = self._content.index(block)
        if block["type"] == "tool_use":
            block["input"] = json.loads(self._arguments.get(index) or "{}")
        return [{"type": "content_block_stop", "index": index}]
