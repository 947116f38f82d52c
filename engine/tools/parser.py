"""A model's output as text and tool calls, read as it streams or all at once.

:class:`ToolCallParser` takes the output's text in pieces (the deltas of a stream) and turns
it into events: :class:`TextDelta` for text before the first call, then for each call
:class:`CallStarted` (its function's name) and :class:`ArgumentsDelta` (its arguments). No
piece of the trigger reaches a text delta: text that could be the start of the opening tag
is held back until the next piece shows whether it is. :func:`parse_output` feeds the whole
text through the same parser, so a complete answer and the concatenation of a stream's
deltas agree by construction.

A call is *complete* once its JSON object is closed (its name and arguments are whole; the
format's closing text may still be cut). A call's events are held back until then, so an
output cut inside a call (by ``max_tokens``) has reported nothing of that call, streamed or
whole: the calls before it are kept, the cut one is dropped, and none of its text is
content. The price is that a call's arguments arrive in one piece, not as the model writes
them; the alternative, a stream that has sent half a call the whole answer does not hold,
gives an agent loop arguments it cannot parse (issue 48, finding 6).

The parser relies on the output following the format exactly, as the constraint of
:func:`~twostroke.engine.tools.grammar.tool_constraint` makes it: after the trigger, what the
format writes before the first call, then for each call ``{"name": "<name>", "<key>": `` and
the arguments' JSON, ``}``, the format's closing text and its separator or its end. It tracks
JSON strings and nesting to find where the arguments end.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeAlias

import attrs

from twostroke.engine.tools.formats import FUNCTION_NAME, ToolCall, ToolFormat

__all__ = [
    "ArgumentsDelta",
    "CallStarted",
    "ParsedOutput",
    "TextDelta",
    "ToolCallParser",
    "ToolEvent",
    "parse_output",
]


def _header(fmt: ToolFormat) -> re.Pattern[str]:
    """A call's opening, up to its arguments: ``{"name": "<name>", "<key>": ``."""
    key = re.escape(f'"{fmt.arguments_key}": ')
    return re.compile(r'\{"name": "(' + FUNCTION_NAME.pattern + r')", ' + key)


@attrs.frozen
class TextDelta:
    """Text the model wrote before its first call."""

    text: str


@attrs.frozen
class CallStarted:
    """A call's function is known: its index among the calls, its id and the name."""

    index: int
    id: str
    name: str


@attrs.frozen
class ArgumentsDelta:
    """A piece of the arguments (JSON text) of call ``index``."""

    index: int
    text: str


#: What the parser reports.
ToolEvent: TypeAlias = TextDelta | CallStarted | ArgumentsDelta


@attrs.frozen
class ParsedOutput:
    """A whole output, read.

    Attributes:
        content: The text before the first call (all of it when there is no call).
        calls: The complete calls, in order (a call cut by ``max_tokens`` is not one).
        complete: Nothing was cut: false when the output ended inside a call, or inside
            the format's text around calls (a call was begun, and is dropped).
    """

    content: str
    calls: tuple[ToolCall, ...]
    complete: bool


class ToolCallParser:
    """Reads one output's text, piece by piece, as text and calls (see the module docstring).

    Args:
        fmt: The format the model writes calls in.
        make_id: Makes each call's id (default: the format's :meth:`~ToolFormat.new_call_id`).
    """

    def __init__(self, fmt: ToolFormat, make_id: Callable[[], str] | None = None) -> None:
        self._fmt = fmt
        self._make_id = make_id if make_id is not None else fmt.new_call_id
        self._header = _header(fmt)
        self._state = "text"
        self._pending = ""
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._arguments: list[str] = []  # the call being read (held until it is complete)
        self._current = ("", "")  # its id and name
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._closed = 0  # calls whose closing text was read
        self._ended = False  # the format's end was read

    @property
    def num_calls(self) -> int:
        """Calls started so far."""
        return len(self._calls) + (self._state == "arguments")

    def feed(self, text: str) -> list[ToolEvent]:
        """The events that ``text``, the next piece of the output, completes."""
        self._pending += text
        events: list[ToolEvent] = []
        while True:
            before = (self._state, len(self._pending))
            getattr(self, f"_read_{self._state}")(events)
            if (self._state, len(self._pending)) == before:
                return events

    def finish(self) -> list[ToolEvent]:
        """The events of the output's end: text held back because it could have been the
        start of a trigger is text after all."""
        if self._state in ("text", "free") and self._pending:
            text, self._pending = self._pending, ""
            self._content.append(text)
            return [TextDelta(text)]
        return []

    def result(self) -> ParsedOutput:
        """The output read so far (call after :meth:`finish` for a whole output)."""
        complete = self._state in ("text", "free") or (
            self._state == "between"
            and self._closed == len(self._calls)
            and (self._ended or not self._fmt.end)
            and not self._pending  # (a separator or end begun and cut: a call begun)
        )
        return ParsedOutput("".join(self._content), tuple(self._calls), complete)

    def _text(self, events: list[ToolEvent], text: str) -> None:
        if text:
            self._content.append(text)
            events.append(TextDelta(text))

    def _read_text(self, events: list[ToolEvent]) -> None:
        trigger = self._fmt.trigger
        if self._fmt.at_start:  # calls only where the output starts with the trigger
            if self._pending.startswith(trigger):
                self._state = "first"
            elif not trigger.startswith(self._pending):
                self._state = "free"  # text to the end
            return
        found = self._pending.find(trigger)
        if found >= 0:
            text, self._pending = self._pending[:found], self._pending[found:]
            self._state = "first"
        else:
            keep = _partial_suffix(self._pending, trigger)
            cut = len(self._pending) - keep
            text, self._pending = self._pending[:cut], self._pending[cut:]
        self._text(events, text)

    def _read_free(self, events: list[ToolEvent]) -> None:
        text, self._pending = self._pending, ""
        self._text(events, text)

    def _read_first(self, events: list[ToolEvent]) -> None:
        if self._pending.startswith(self._fmt.first):
            self._pending = self._pending[len(self._fmt.first) :]
            self._state = "header"

    def _read_header(self, events: list[ToolEvent]) -> None:
        match = self._header.match(self._pending)
        if match is None:
            return  # wait for more (the constraint makes it come)
        self._pending = self._pending[match.end() :]
        self._state = "arguments"
        self._arguments = []
        self._depth, self._in_string, self._escaped = 1, False, False
        self._current = (self._make_id(), match[1])

    def _read_arguments(self, events: list[ToolEvent]) -> None:
        end = None
        for position, char in enumerate(self._pending):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:  # the call's own closing brace
                    end = position
                    break
        piece = self._pending if end is None else self._pending[:end]
        self._pending = "" if end is None else self._pending[end + 1 :]
        self._arguments.append(piece)
        if end is not None:  # complete: only now is the call reported (module docstring)
            call_id, name = self._current
            call = ToolCall(call_id, name, "".join(self._arguments))
            index = len(self._calls)
            self._calls.append(call)
            events += [CallStarted(index, call_id, name), ArgumentsDelta(index, call.arguments)]
            self._state = "between"

    def _read_between(self, events: list[ToolEvent]) -> None:
        close = self._fmt.close
        if self._closed < len(self._calls):
            if not self._pending.startswith(close):
                return
            self._pending = self._pending[len(close) :]
            self._closed += 1
        separator = self._fmt.separator
        if separator is not None and self._pending.startswith(separator):
            self._pending = self._pending[len(separator) :]
            self._state = "header"
        elif self._fmt.end and self._pending.startswith(self._fmt.end):
            self._pending = self._pending[len(self._fmt.end) :]
            self._ended = True


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of ``tag``."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def parse_output(
    fmt: ToolFormat, text: str, make_id: Callable[[], str] | None = None
) -> ParsedOutput:
    """A whole output read as text and calls (the same reading as a stream's)."""
    parser = ToolCallParser(fmt, make_id)
    parser.feed(text)
    parser.finish()
    return parser.result()
