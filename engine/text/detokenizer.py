"""Incremental detokenization and stop strings: turning one request's new tokens into new text.

Decoding each new token on its own is wrong (a byte-level BPE token may end in the middle of
a UTF-8 character, and SentencePiece-style decoders render a token's leading space from its
neighbours), and decoding the whole output at every token costs time quadratic in its
length. :class:`IncrementalDetokenizer` uses vLLM's prefix/read-offset method with nothing
but :meth:`Tokenizer.decode`, so it works for any tokenizer: it keeps a short window of
tokens, decodes the window with and without the newest tokens, and shows the difference once
it no longer ends in an unfinished character (U+FFFD). The window then slides on, so the
work per token is constant.

Stop strings follow vLLM too, with one refinement: streamed text never shows a partial stop
string, because the detokenizer holds back the longest suffix of the text that is a prefix of
some stop string (rather than a fixed number of characters), and releases it as soon as it
can no longer become one.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from twostroke.engine.text.tokenizer import Tokenizer
from twostroke.states.errors import EngineError

__all__ = ["DetokenizedDelta", "DetokenizerError", "IncrementalDetokenizer"]

#: Prompt tokens decoded ahead of the output, so that the first output token is rendered in
#: context (a SentencePiece token's leading space, a character begun in the prompt); vLLM's
#: ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``.
PROMPT_CONTEXT_TOKENS = 5

#: After this many pushes in a row whose text still ends in U+FFFD, the text is shown as
#: ``decode`` renders it. Valid UTF-8 never gets there unless dozens of tokens in a row all end
#: inside a character; invalid byte sequences (a random model sampling stray bytes) would
#: otherwise grow the window, and the work per token, without bound.
MAX_UNRESOLVED_PUSHES = 32

_REPLACEMENT_CHARACTER = "\ufffd"


class DetokenizerError(EngineError, RuntimeError):
    """The detokenizer was driven out of protocol (tokens pushed after :meth:`flush`)."""


@attrs.frozen
class DetokenizedDelta:
    """What one :meth:`IncrementalDetokenizer.push` adds to a request's output.

    Attributes:
        text: New text that is safe to show now (possibly empty).
        stopped: A stop string matched: the output ends with this delta.
        stop_string: The stop string that matched, or ``None``.
    """

    text: str
    stopped: bool = False
    stop_string: str | None = None


def _stop_strings(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str) or not isinstance(stop, Sequence):
        raise TypeError(f"stop must be a sequence of strings, got {type(stop).__name__} {stop!r}")
    for item in stop:
        if not isinstance(item, str):
            raise TypeError(f"stop must contain only strings, got {type(item).__name__} {item!r}")
        if not item:
            raise ValueError("stop strings must be non-empty, got ''")
    return tuple(stop)


def _token_ids(name: str, token_ids: object) -> list[int]:
    if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    for item in token_ids:
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(f"{name} must contain only ints, got {type(item).__name__} {item!r}")
    return list(token_ids)


class IncrementalDetokenizer:
    """One request's output text, built token by token, with stop strings applied.

    Push every new output token (one or several at a time) and show each delta's ``text``;
    when the request ends for another reason than a stop string (EOS, length, cancel), call
    :meth:`flush` for the text still held back. Special tokens (EOS among them) contribute no
    text, because :meth:`Tokenizer.decode` skips them.

    The concatenation of every delta and the flush equals ``tokenizer.decode(output_ids)``,
    cut at the first stop string (the one whose match ends first; of two ending at the same
    place, the longer): without it unless ``include_stop_str_in_output``. Tokens pushed after
    a stop string matched are ignored. Like vLLM, an unfinished UTF-8 character at the very
    end of the output is dropped by :meth:`flush`, never shown as U+FFFD.

    Args:
        tokenizer: The request's tokenizer; only ``decode`` is used.
        prompt_token_ids: The prompt; its last few tokens give the output its context.
        stop: Strings that end the output.
        include_stop_str_in_output: Keep the matched stop string at the end of the text.

    Raises:
        TypeError: ``prompt_token_ids`` is not a sequence of ints, or ``stop`` is not a
            sequence of strings.
        ValueError: a stop string is empty.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        prompt = _token_ids("prompt_token_ids", prompt_token_ids)
        self._tokenizer = tokenizer
        self._stop = _stop_strings(stop)
        self._include_stop = bool(include_stop_str_in_output)
        # Every proper prefix of every stop string: the suffixes of the text to hold back.
        self._stop_prefixes = frozenset(s[:i] for s in self._stop for i in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self._stop), default=0)
        # The window: tokens[:read] were shown (they are context), tokens[read:] were not.
        self._window = prompt[max(len(prompt) - PROMPT_CONTEXT_TOKENS, 0) :]
        self._read = len(self._window)
        self._unresolved_pushes = 0
        self._held = ""  # decoded text held back because it could begin a stop string
        self._parts: list[str] = []
        self._stop_string: str | None = None
        self._flushed = False

    @property
    def text(self) -> str:
        """All the text shown so far (every delta and the flush)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched."""
        return self._stop_string is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, or ``None``."""
        return self._stop_string

    def push(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add new output tokens and return the text that became safe to show.

        Args:
            token_ids: The new output tokens, oldest first (the engine may coalesce several).

        Returns:
            The new text, and whether a stop string ended the output. After a stop, further
            pushes return an empty, stopped delta (the engine's one-step lookahead may still
            deliver a token).

        Raises:
            DetokenizerError: :meth:`flush` was called already.
        """
        if self._flushed:
            raise DetokenizerError("cannot push tokens after flush(): the output has ended")
        if self._stop_string is not None:
            return DetokenizedDelta("", stopped=True, stop_string=self._stop_string)
        if not token_ids:
            return DetokenizedDelta("")
        self._window.extend(token_ids)
        return self._apply_stop_strings(self._decode_new_text())

    def flush(self) -> str:
        """End the output and return the text still held back.

        Held-back text could have begun a stop string; now it cannot. Tokens that still end
        inside a UTF-8 character are dropped (vLLM does the same), so the output never ends
        in a U+FFFD that only stands for a character cut short. Calling ``flush`` again
        returns ``""``; after a stop string it returns ``""`` too.

        Returns:
            The released text.
        """
        if self._flushed or self._stop_string is not None:
            self._flushed = True
            return ""
        self._flushed = True
        released, self._held = self._held, ""
        self._show(released)
        return released

    def _decode_new_text(self) -> str:
        """The text of the unread tokens, once it no longer ends inside a character.

        ``decode(window)`` minus ``decode(shown part of the window)``: decoding with the
        context makes the difference independent of where the window starts.
        """
        window, read = self._window, self._read
        prefix_text = self._tokenizer.decode(window[:read])
        new_text = self._tokenizer.decode(window)
        resolved = len(new_text) > len(prefix_text) and not new_text.endswith(
            _REPLACEMENT_CHARACTER
        )
        if not resolved:
            self._unresolved_pushes += 1
            if self._unresolved_pushes < MAX_UNRESOLVED_PUSHES:
                return ""
        self._unresolved_pushes = 0
        # Slide: the tokens just shown become the next context.
        self._window = window[read:]
        self._read = len(self._window)
        return new_text[len(prefix_text) :]

    def _apply_stop_strings(self, new_text: str) -> DetokenizedDelta:
        """Show ``new_text`` except what could still be a stop string, or cut at a match."""
        if not self._stop:
            self._show(new_text)
            return DetokenizedDelta(new_text)
        # A match cannot start before the held text: the held text is the longest suffix of
        # the text so far that could begin a stop string.
        candidate = self._held + new_text
        match = self._first_match(candidate)
        if match is not None:
            start, stop_string = match
            end = start + len(stop_string) if self._include_stop else start
            shown = candidate[:end]
            self._held = ""
            self._stop_string = stop_string
            self._show(shown)
            return DetokenizedDelta(shown, stopped=True, stop_string=stop_string)
        hold = self._partial_stop_length(candidate)
        shown = candidate[: len(candidate) - hold]
        self._held = candidate[len(candidate) - hold :]
        self._show(shown)
        return DetokenizedDelta(shown)

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """The stop string whose first match in ``text`` ends first (ties: the longer)."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for stop_string in self._stop:
            start = text.find(stop_string)
            if start < 0:
                continue
            key = (start + len(stop_string), -len(stop_string), stop_string)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, negative_length, stop_string = best
        return end + negative_length, stop_string

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for length in range(min(self._max_hold, len(text)), 0, -1):
            if text[len(text) - length :] in self._stop_prefixes:
                return length
        return 0

    def _show(self, text: str) -> None:
        if text:
            self._parts.append(text)

    def __repr__(self) -> str:
        state = (
            f"stopped at {self._stop_string!r}"
            if self._stop_string is not None
            else "flushed"
            if self._flushed
            else f"{len(self._window) - self._read} unread tokens, {len(self._held)} chars held"
        )
        return f"<IncrementalDetokenizer {len(self.text)} chars shown, {state}>"
