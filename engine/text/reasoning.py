"""A thinking model's output split into its reasoning and its answer, as text, as it streams.

Models of 2025-26 (DeepSeek-R1, Qwen3, SmolLM3 and others) think before they answer, between
``<think>`` and ``</think>``. vLLM's reasoning parsers return that reasoning apart
(``reasoning_content``) and the answer alone as ``content``; tool calls and JSON outputs are
read from the answer. :class:`ReasoningParser` does the same on the output's text, one delta
at a time: a marker split across deltas is held back until it is whole, so that any split of
an output into deltas gives the reasoning and the answer of the whole (a property test pins
it).

Where the reasoning starts matters. A template may open ``<think>`` itself at the end of the
prompt (DeepSeek-R1's always, Qwen3's "thinking" models'): the output then starts inside the
reasoning and the model writes only ``</think>`` (:func:`opens_reasoning` reads that from the
prompt's tail). Otherwise the model opens it, as the first thing it writes; an output that
starts with anything else is all answer. Whitespace right after a marker is dropped (the
``"\\n\\n"`` after ``</think>`` is layout, not answer).

Text only: no tokenizer, no server. A marker that is a special token the detokenizer skips is
not seen (none of the models above makes ``<think>`` one).
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningFormat",
    "ReasoningParser",
    "ReasoningSplit",
    "opens_reasoning",
    "reasoning_format",
    "split_reasoning",
    "template_reasoning_format",
]

#: The parsers ``--reasoning-parser`` names, vLLM's names where vLLM has them: ``deepseek_r1``
#: (the prompt always opens the reasoning), ``qwen3`` and ``think`` (the prompt's tail says).
REASONING_PARSERS = ("deepseek_r1", "qwen3", "think")


@attrs.frozen
class ReasoningFormat:
    """How a model marks its reasoning.

    Attributes:
        name: The parser's name (one of :data:`REASONING_PARSERS`).
        start: The text that opens the reasoning.
        end: The text that closes it.
        always_open: Whether every prompt opens the reasoning (DeepSeek-R1's template ends
            with ``<think>``), whatever its tail shows.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_open: bool = False

    def parser(self, opened: bool = False) -> ReasoningParser:
        """A parser of one output.

        Args:
            opened: Whether the prompt opened the reasoning (:func:`opens_reasoning`).
        """
        return ReasoningParser(self, opened=opened or self.always_open)


_FORMATS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_open=True),
    "qwen3": ReasoningFormat("qwen3"),
    "think": ReasoningFormat("think"),
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The reasoning format ``--reasoning-parser`` names.

    Raises:
        ValueError: ``name`` is none of :data:`REASONING_PARSERS`.
    """
    found = _FORMATS.get(name)
    if found is None:
        raise ValueError(
            f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}"
        )
    return found


def template_reasoning_format(chat_template: str | None) -> ReasoningFormat | None:
    """The generic ``think`` format where a chat template mentions ``<think>``, else ``None``.

    A template that thinks writes the marker (Qwen3's closes an empty reasoning when thinking
    is off, and drops past turns' reasoning); SmolLM2's and Llama's never do, so their
    answers are read as they always were.
    """
    think = _FORMATS["think"]
    if chat_template is None or think.start not in chat_template:
        return None
    return think


def opens_reasoning(fmt: ReasoningFormat, prompt_tail: str) -> bool:
    """Whether a prompt ending with ``prompt_tail`` leaves the reasoning open: its last
    ``start`` marker has no ``end`` after it (Qwen3's with thinking off closes it)."""
    return fmt.always_open or prompt_tail.rfind(fmt.start) > prompt_tail.rfind(fmt.end)


@attrs.frozen
class ReasoningDelta:
    """What one piece of output adds to the reasoning and to the answer (either may be
    empty: text that could be part of a marker is held back)."""

    reasoning: str = ""
    content: str = ""


@attrs.frozen
class ReasoningSplit:
    """A whole output split.

    Attributes:
        reasoning: The reasoning, ``None`` where the output did not reason.
        content: The answer.
    """

    reasoning: str | None
    content: str


_State = Literal["start", "opened", "reasoning", "answer"]


class ReasoningParser:
    """One output's text, fed as it streams, split into reasoning and answer.

    States: ``start`` (the output may open the reasoning: text that is whitespace and a
    prefix of ``start`` is held), ``opened`` (the prompt opened it; a ``start`` the model
    writes again is dropped), ``reasoning`` (held: a suffix that may begin ``end``),
    ``answer`` (nothing held; markers in the answer are answer text).

    Args:
        fmt: The markers.
        opened: Whether the prompt opened the reasoning.
    """

    def __init__(self, fmt: ReasoningFormat, *, opened: bool = False) -> None:
        self._fmt = fmt
        self._state: _State = "opened" if opened else "start"
        self._held = ""
        self._skip_space = opened  # what follows a marker: the prompt's counts
        self.reasoned = opened

    def feed(self, text: str) -> ReasoningDelta:
        """Add ``text`` to the output; return what it adds to the reasoning and the answer."""
        self._held += text
        reasoning: list[str] = []
        content: list[str] = []
        start, end = self._fmt.start, self._fmt.end
        while True:
            if self._skip_space and self._state != "start":
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self._skip_space = False
            if self._state in ("start", "opened"):
                stripped = self._held.lstrip()
                if stripped.startswith(start):
                    self._held = stripped[len(start) :]
                    self._state, self._skip_space, self.reasoned = "reasoning", True, True
                    continue
                if start.startswith(stripped):
                    break  # whitespace, or a marker not yet whole
                self._state = "answer" if self._state == "start" else "reasoning"
                continue
            if self._state == "reasoning":
                found = self._held.find(end)
                if found >= 0:
                    reasoning.append(self._held[:found])
                    self._held = self._held[found + len(end) :]
                    self._state, self._skip_space = "answer", True
                    continue
                keep = _partial_marker(self._held, end)
                reasoning.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            content.append(self._held)
            self._held = ""
            break
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """The output has ended: what was held back, as what it was part of (a reasoning
        never closed is all reasoning, as vLLM's parsers read it)."""
        held, self._held = self._held, ""
        if self._state == "start":
            return ReasoningDelta(content=held)
        if self._skip_space:
            held = held.lstrip()
        if self._state == "answer":
            return ReasoningDelta(content=held)
        return ReasoningDelta(reasoning=held)


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def split_reasoning(fmt: ReasoningFormat, text: str, *, opened: bool = False) -> ReasoningSplit:
    """A whole output split into its reasoning and its answer (:class:`ReasoningParser`).

    Args:
        fmt: The markers.
        text: The output.
        opened: Whether the prompt opened the reasoning (:func:`opens_reasoning`).
    """
    parser = fmt.parser(opened)
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning + last.reasoning
    return ReasoningSplit(reasoning if parser.reasoned else None, first.content + last.content)
