"""A Response written from the chat service's answer events, and its event stream.

``/v1/responses`` runs on the chat service (:mod:`~twostroke.engine.server.chat_service`),
which answers with typed events (:mod:`~twostroke.engine.server.answer_events`), whole or as
they stream. :class:`ResponseDraft` folds them into Responses output items (``message`` with
``output_text``, ``function_call`` with ``call_id``, ``name`` and ``arguments``), ``usage``
and ``status``, and into the Responses event sequence, each event with its
``sequence_number``; an :class:`~twostroke.engine.server.event_writer.EventWriter` sends
those events as the answer streams.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from twostroke.engine.server.answer_events import ArgumentsDelta, CallStarted, Usage
from twostroke.engine.server.errors import ApiError
from twostroke.engine.server.event_writer import Draft

__all__ = ["ResponseDraft"]


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseDraft(Draft):
    """A Response being written from the answer's events, and its stream's events.

    Pure bookkeeping, no I/O: :meth:`begin` gives the opening events,
    :meth:`~twostroke.engine.server.event_writer.Draft.apply` the events for the answer's next
    events (text deltas open and extend a ``message`` item, a call's start opens a ``function_call``
    item that its arguments extend), :meth:`fail` fails the response, :meth:`end` closes the open
    items and completes the response, and :meth:`response` is the Response object at any point.
    Every event carries the next ``sequence_number``. A complete (not streamed) answer is the same
    fold over the whole answer's events.

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
        self._calls: dict[int, dict[str, Any]] = {}  # a call's index -> its item
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

    def _finished(self, reason: str) -> None:
        self._finish_reason = reason

    def _counted(self, usage: Usage) -> None:
        self._usage = _usage(usage)

    def end(self) -> list[dict[str, Any]]:
        """Close what is open and finish: ``response.completed`` (``response.incomplete``
        when the output ran into its token limit); nothing more after a failure."""
        if self.status == "failed":
            return []
        events = self._close()
        if all(item["type"] == "reasoning" for item in self._output):  # still one message
            events += self._text("")
            events += self._close()
        if self._finish_reason == "length":
            self.status = "incomplete"
            return [*events, self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return [*events, self._event("response.completed", response=self.response())]

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        """``error`` and ``response.failed``: the response has failed."""
        code, message = error.code, error.message
        self.status = "failed"
        self._error = {"code": code or "server_error", "message": message}
        self._open = None
        return [
            self._event("error", code=code, message=message, param=error.param),
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

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        """A ``reasoning`` item (opened at the first piece) whose one ``reasoning_text``
        part grows by ``response.reasoning_text.delta``, as OpenAI's open-weight models'
        reasoning is returned."""
        events = []
        item = self._open
        if item is None or item["type"] != "reasoning":
            events += self._close()
            item = {"id": _hex_id("rs"), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
            events.append(self._added(item))
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=len(self._output) - 1, content_index=0,
                                  delta=text))  # fmt: skip
        return events

    def _started(self, call: CallStarted) -> list[dict[str, Any]]:
        events = self._close()
        item = {"id": _hex_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call.id, "name": call.name, "arguments": ""}  # fmt: skip
        self._calls[call.index] = item
        events.append(self._added(item))
        return events

    def _call_arguments(self, delta: ArgumentsDelta) -> list[dict[str, Any]]:
        item = self._calls[delta.index]
        item["arguments"] += delta.text
        index = self._output.index(item)
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=delta.text)]  # fmt: skip

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
        if item["type"] == "reasoning":  # (a reasoning item has no status)
            text = item["content"][0]["text"]
            return [
                self._event("response.reasoning_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=text),
                self._event("response.output_item.done", output_index=index, item=_copy(item)),
            ]  # fmt: skip
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


def _usage(usage: Usage) -> dict[str, Any]:
    """The Responses API's ``usage``."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
