"""A chat answer as typed events: what every endpoint's writer consumes.

The chat service (:mod:`~twostroke.engine.server.chat_service`) reads one output, as it
streams or whole, into these events: :class:`ThinkingDelta` (a thinking model's reasoning,
read apart by the server's reasoning parser), :class:`TextDelta` (text before the first call),
:class:`CallStarted` (a call's id and function), :class:`ArgumentsDelta` (a piece of its
arguments' JSON), :class:`Finished` (the answer's finish reason) and :class:`Usage`. A whole
output is read by the same :class:`AnswerReader` as a stream's deltas, in one piece, so a
complete answer and a stream are folds over the same events: each endpoint's writer
(:mod:`~twostroke.engine.server.response_events`,
:mod:`~twostroke.engine.server.message_events`) is that fold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import attrs

from twostroke.engine.server.structured import ToolCalls
from twostroke.engine.text.reasoning import ReasoningParser
from twostroke.engine.tools.parser import (
    ArgumentsDelta,
    CallStarted,
    TextDelta,
    ToolCallParser,
    ToolEvent,
)

__all__ = [
    "AnswerEvent",
    "AnswerReader",
    "ArgumentsDelta",
    "CallStarted",
    "Finished",
    "TextDelta",
    "ThinkingDelta",
    "Usage",
]


@attrs.frozen
class ThinkingDelta:
    """A piece of the model's reasoning (between its ``<think>`` markers, which it lacks):
    Messages' ``thinking`` block, Responses' ``reasoning`` item.

    Attributes:
        text: The piece.
    """

    text: str


@attrs.frozen
class Finished:
    """The answer has ended.

    Attributes:
        reason: ``stop``, ``length`` or, where the answer holds a complete call,
            ``tool_calls`` (:meth:`~twostroke.engine.server.structured.ToolCalls.finish_reason`).
    """

    reason: str


@attrs.frozen
class Usage:
    """The answer's token counts.

    Attributes:
        prompt_tokens: Tokens in the prompt.
        completion_tokens: Tokens of the output.
        cached_tokens: Prompt tokens the prefix cache held.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


#: What the chat service reports of an answer.
AnswerEvent: TypeAlias = ThinkingDelta | TextDelta | CallStarted | ArgumentsDelta | Finished | Usage


class AnswerReader:
    """One output's text, piece by piece, as answer events (usage aside).

    Without tools every piece is text; with tools the pieces go through a
    :class:`~twostroke.engine.tools.parser.ToolCallParser` of the format, which holds back
    text that may start a call and reports a call once its JSON is closed.

    With a reasoning parser, the reasoning goes apart first (:class:`ThinkingDelta`) and
    only the answer after it is read for text and calls.

    Args:
        tool_calls: How the output is read when it may hold calls (``None``: it cannot).
        reasoning: The choice's reasoning parser (``None``: the output is all answer).
    """

    def __init__(
        self, tool_calls: ToolCalls | None, reasoning: ReasoningParser | None = None
    ) -> None:
        self._tool_calls = tool_calls
        self._parser = None if tool_calls is None else ToolCallParser(tool_calls.format)
        self._reasoning = reasoning

    def read(self, text: str, finish_reason: str | None = None) -> list[AnswerEvent]:
        """The events that ``text``, the output's next piece, completes; with
        ``finish_reason``, the output's last piece, whose events end with :class:`Finished`.
        """
        events: list[AnswerEvent] = []
        if self._reasoning is not None:
            split = self._reasoning.feed(text)
            thought, text = split.reasoning, split.content
            if finish_reason is not None:
                last = self._reasoning.finish()
                thought, text = thought + last.reasoning, text + last.content
            if thought:
                events.append(ThinkingDelta(thought))
        if self._parser is None or self._tool_calls is None:
            if text:
                events.append(TextDelta(text))
        else:
            pieces = self._parser.feed(text)
            if finish_reason is not None:
                pieces += self._parser.finish()
                finish_reason = self._tool_calls.finish_reason(self._parser.result(), finish_reason)
            events += _joined(pieces)
        if finish_reason is not None:
            events.append(Finished(finish_reason))
        return events


def _joined(events: Sequence[ToolEvent]) -> list[ToolEvent]:
    """Consecutive text pieces as one, and consecutive pieces of one call's arguments as
    one: a piece of output is one delta of each, however the parser split it."""
    joined: list[ToolEvent] = []
    for event in events:
        last = joined[-1] if joined else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            joined[-1] = TextDelta(last.text + event.text)
        elif (
            isinstance(event, ArgumentsDelta)
            and isinstance(last, ArgumentsDelta)
            and last.index == event.index
        ):
            joined[-1] = ArgumentsDelta(event.index, last.text + event.text)
        else:
            joined.append(event)
    return joined
