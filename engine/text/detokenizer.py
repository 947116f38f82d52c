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
can no longer become one. An Aho-Corasick automaton over the stop strings finds both the
suffix to hold back and the first match, at O(1) amortised cost per character of output and
O(total length of the stop strings) memory, whatever their number and length.
"""

from __future__ import annotations

import collections
import functools
from array import array
from collections.abc import Sequence

import attrs

from twostroke.engine.text.tokenizer import Tokenizer
from twostroke.states.errors import EngineError
from twostroke.states.request import Request
from twostroke.states.validators import is_int

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
_CHAR_BITS = 21  # every code point is below 2**21 (0x110000)


class _StopMatcher:
    """An Aho-Corasick automaton over one request's stop strings.

    A state is a node of the trie of the stop strings: the longest suffix of the text fed so
    far that is a prefix of some stop string, which is exactly the text to hold back (its
    length is :meth:`depth`). Feeding a character follows a trie edge or, failing that, the
    node's failure link (its longest proper suffix that is a node) until one does: O(1)
    amortised per character. Every node knows the longest stop string that ends there.

    Memory is O(total length): one edge per node, in one dict keyed by ``node`` and the
    character's code point, and three arrays of ints. (Storing every prefix of every stop
    string instead is O(length²): 20,000 characters cost 200 MB.)
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        edges: dict[int, int] = {}
        depth = [0]
        ends = [-1]  # the stop string (index) that this node spells, or -1
        children: list[list[tuple[int, int]]] = [[]]  # (code point, child), for the links
        for index, string in enumerate(stop):
            node = 0
            for char in string:
                key = node << _CHAR_BITS | ord(char)
                child = edges.get(key)
                if child is None:
                    child = edges[key] = len(depth)
                    depth.append(depth[node] + 1)
                    ends.append(-1)
                    children.append([])
                    children[node].append((ord(char), child))
                node = child
            if ends[node] < 0:
                ends[node] = index
        # Breadth first, so that a node's failure link (shallower) is complete before it.
        fail = [0] * len(depth)
        longest = ends  # then: the longest stop string that is a suffix of the node's text
        queue = collections.deque(child for _, child in children[0])
        while queue:
            node = queue.popleft()
            for code, child in children[node]:
                queue.append(child)
                link = fail[node]
                while link and (link << _CHAR_BITS | code) not in edges:
                    link = fail[link]
                fail[child] = edges.get(link << _CHAR_BITS | code, 0)
                if longest[child] < 0:
                    longest[child] = longest[fail[child]]
        self._edges = edges
        self._depth = array("l", depth)
        self._fail = array("l", fail)
        self._longest = array("l", longest)

    def depth(self, state: int) -> int:
        """Characters of text that ``state`` stands for (the text to hold back)."""
        return self._depth[state]

    def scan(self, state: int, text: str) -> tuple[int, int, int]:
        """Feed ``text`` from ``state`` until the first stop string ends.

        Returns:
            ``(state, end, stop)``: the state reached; the offset in ``text`` just past the
            first stop string to end in it (the longest of those ending there) and its index,
            or ``-1`` and ``-1`` when none ends in ``text``.
        """
        edges, fail, longest = self._edges, self._fail, self._longest
        for offset, char in enumerate(text):
            code = ord(char)
            while (child := edges.get(state << _CHAR_BITS | code)) is None and state:
                state = fail[state]
            state = 0 if child is None else child
            if longest[state] >= 0:
                return state, offset + 1, longest[state]
        return state, -1, -1


@functools.lru_cache(maxsize=16)
def _stop_matcher(stop: tuple[str, ...]) -> _StopMatcher:
    """The automaton for ``stop``, shared: the ``n`` choices of a request have the same.

    They are submitted one after the other, so a few entries suffice; with stop strings capped
    (:data:`~twostroke.states.params.MAX_STOP_STRINGS` of at most
    :data:`~twostroke.states.params.MAX_STOP_STRING_LENGTH` characters) each takes well under
    1 MB.
    """
    return _StopMatcher(stop)


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
    if stop == ():  # the usual case, without the ABC check below
        return ()
    if isinstance(stop, str) or not isinstance(stop, Sequence):
        raise TypeError(f"stop must be a sequence of strings, got {type(stop).__name__} {stop!r}")
    for item in stop:
        if not isinstance(item, str):
            raise TypeError(f"stop must contain only strings, got {type(item).__name__} {item!r}")
        if not item:
            raise ValueError("stop strings must be non-empty, got ''")
    return tuple(stop)


def _token_ids(name: str, token_ids: object, last: int | None = None) -> list[int]:
    """``token_ids`` (only its ``last`` ones, if given) as a list, checked to be ints."""
    if not isinstance(token_ids, tuple | list) and (  # the usual cases, without an ABC check
        isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence)
    ):
        raise TypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    if last is not None:
        token_ids = token_ids[max(len(token_ids) - last, 0) :]
    for item in token_ids:
        if not is_int(item):
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
        prompt_token_ids: The prompt; its last :data:`PROMPT_CONTEXT_TOKENS` tokens give the
            output its context (only they are read, so a long prompt costs nothing more).
        stop: Strings that end the output.
        include_stop_str_in_output: Keep the matched stop string at the end of the text.

    Raises:
        TypeError: ``prompt_token_ids`` is not a sequence (or its last tokens are not
            ints), or ``stop`` is not a sequence of strings.
        ValueError: a stop string is empty.
    """

    # The engine makes one per submitted request: slots, so no instance dict to allocate.
    __slots__ = (
        "_flushed",
        "_held",
        "_include_stop",
        "_matcher",
        "_parts",
        "_read",
        "_stop",
        "_stop_state",
        "_stop_string",
        "_tokenizer",
        "_unresolved_pushes",
        "_window",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        context = _token_ids("prompt_token_ids", prompt_token_ids, last=PROMPT_CONTEXT_TOKENS)
        self._start(tokenizer, context, _stop_strings(stop), bool(include_stop_str_in_output))

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, request: Request) -> IncrementalDetokenizer:
        """The detokenizer of an engine request, whose inputs were checked where they were made.

        Its prompt ids come from ``tokenize_prompt`` and its stop strings from
        :class:`~twostroke.states.params.SamplingParams`, so nothing is checked again here
        (the engine makes one per submitted request).
        """
        detokenizer = cls.__new__(cls)
        context = list(request.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        params = request.params
        detokenizer._start(tokenizer, context, params.stop, params.include_stop_str_in_output)
        return detokenizer

    def _start(
        self, tokenizer: Tokenizer, context: list[int], stop: tuple[str, ...], include: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._include_stop = include
        # Built at the first text (a waiting request needs none): it holds the held text's
        # state, ``_stop_state``.
        self._matcher: _StopMatcher | None = None
        self._stop_state = 0
        # The window: tokens[:read] were shown (they are context), tokens[read:] were not.
        self._window = context
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
        if self._matcher is None:
            self._matcher = _stop_matcher(self._stop)
        # The held text is the longest suffix of the text so far that could begin a stop
        # string (the automaton's state stands for it): a match cannot start before it.
        candidate = self._held + new_text
        state, end, index = self._matcher.scan(self._stop_state, new_text)
        if end >= 0:
            stop_string = self._stop[index]
            end += len(self._held)
            shown = candidate[: end if self._include_stop else end - len(stop_string)]
            self._held = ""
            self._stop_string = stop_string
            self._show(shown)
            return DetokenizedDelta(shown, stopped=True, stop_string=stop_string)
        self._stop_state = state
        hold = self._matcher.depth(state)
        shown = candidate[: len(candidate) - hold]
        self._held = candidate[len(candidate) - hold :]
        self._show(shown)
        return DetokenizedDelta(shown)

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
