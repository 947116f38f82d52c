"""A plain reference :class:`~twostroke.states.constraints.Matcher`, for choices and regexes.

Written to be obviously right rather than fast: it keeps the output as text (each token is a
string of a small vocabulary) and asks, for every token of the vocabulary, whether the text
with that token appended can still grow into a match. For a :class:`Choice` that is "some
choice starts with it"; for a :class:`Regex` it is "the Brzozowski derivative of the
expression by the text is not the empty language", over a small subset of regex syntax
(:func:`parse_regex`: literals, ``\\``-escaped punctuation, ``[...]`` classes with ranges
and ``^``, ``.``, groups, ``|``, ``*``, ``+``, ``?``), where Python's ``re``, Rust's
``regex`` and this parser agree. Tests check real backends against it; toy runners may
constrain their output with it. Pure (the standard library).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Sequence

import attrs

from twostroke.states.constraints import Choice, Constraint, Regex, bitmask_words, write_bitmask

__all__ = ["ReferenceMatcher", "parse_regex", "regex_matches"]


# --- a regex as a tree, and its derivatives ---------------------------------------------------


@attrs.frozen
class _Empty:
    """The empty language (nothing matches)."""


@attrs.frozen
class _Epsilon:
    """The language of the empty string."""


@attrs.frozen
class _Chars:
    """One character from a set (``negated``: one character not in it)."""

    chars: frozenset[str]
    negated: bool = False

    def has(self, char: str) -> bool:
        return (char in self.chars) != self.negated


@attrs.frozen
class _Seq:
    first: _Node
    second: _Node


@attrs.frozen
class _Alt:
    left: _Node
    right: _Node


@attrs.frozen
class _Star:
    inner: _Node


_Node = _Empty | _Epsilon | _Chars | _Seq | _Alt | _Star
_EMPTY = _Empty()
_EPSILON = _Epsilon()
_ANY = _Chars(frozenset("\n"), negated=True)  # ``.``: any character but a newline


def _seq(first: _Node, second: _Node) -> _Node:
    if isinstance(first, _Empty) or isinstance(second, _Empty):
        return _EMPTY
    if isinstance(first, _Epsilon):
        return second
    if isinstance(second, _Epsilon):
        return first
    return _Seq(first, second)


def _alt(left: _Node, right: _Node) -> _Node:
    if isinstance(left, _Empty):
        return right
    if isinstance(right, _Empty) or left == right:
        return left
    return _Alt(left, right)


def _nullable(node: _Node) -> bool:
    """Whether the node's language holds the empty string."""
    if isinstance(node, _Epsilon | _Star):
        return True
    if isinstance(node, _Seq):
        return _nullable(node.first) and _nullable(node.second)
    if isinstance(node, _Alt):
        return _nullable(node.left) or _nullable(node.right)
    return False


def _is_empty(node: _Node) -> bool:
    """Whether the node's language is empty (no string at all matches)."""
    if isinstance(node, _Empty):
        return True
    if isinstance(node, _Chars):
        return not node.chars and not node.negated
    if isinstance(node, _Seq):
        return _is_empty(node.first) or _is_empty(node.second)
    if isinstance(node, _Alt):
        return _is_empty(node.left) and _is_empty(node.right)
    return False


@functools.lru_cache(maxsize=65_536)
def _derive(node: _Node, char: str) -> _Node:
    """The strings ``s`` such that ``char + s`` is in the node's language."""
    if isinstance(node, _Chars):
        return _EPSILON if node.has(char) else _EMPTY
    if isinstance(node, _Seq):
        head = _seq(_derive(node.first, char), node.second)
        return _alt(head, _derive(node.second, char)) if _nullable(node.first) else head
    if isinstance(node, _Alt):
        return _alt(_derive(node.left, char), _derive(node.right, char))
    if isinstance(node, _Star):
        return _seq(_derive(node.inner, char), node)
    return _EMPTY  # the empty string and the empty language have no first character


def _derive_text(node: _Node, text: str) -> _Node:
    for char in text:
        node = _derive(node, char)
    return node


# --- the parser -------------------------------------------------------------------------------

_SPECIAL = frozenset("()[]|*+?.\\")


class _Parser:
    """Recursive descent over the subset: alternatives of sequences of quantified atoms."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.at = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"the reference regex parser {what} at {self.at} in {self.pattern!r}")

    def peek(self) -> str | None:
        return self.pattern[self.at] if self.at < len(self.pattern) else None

    def take(self) -> str:
        char = self.peek()
        if char is None:
            raise self.error("needs more")
        self.at += 1
        return char

    def alternatives(self) -> _Node:
        node = self.sequence()
        while self.peek() == "|":
            self.take()
            node = _alt(node, self.sequence())
        return node

    def sequence(self) -> _Node:
        node: _Node = _EPSILON
        while self.peek() not in (None, "|", ")"):
            node = _seq(node, self.quantified())
        return node

    def quantified(self) -> _Node:
        node = self.atom()
        while self.peek() in ("*", "+", "?"):
            quantifier = self.take()
            if quantifier == "*":
                node = _Star(node)
            elif quantifier == "+":
                node = _seq(node, _Star(node))
            else:
                node = _alt(_EPSILON, node)
        return node

    def atom(self) -> _Node:
        char = self.take()
        if char == "(":
            node = self.alternatives()
            if self.peek() != ")":
                raise self.error("misses a ')'")
            self.take()
            return node
        if char == "[":
            return self.char_class()
        if char == ".":
            return _ANY
        if char == "\\":
            return self.escape()
        if char in _SPECIAL:
            raise self.error(f"does not read {char!r}")
        return _Chars(frozenset(char))

    def escape(self) -> _Node:
        char = self.take()
        if char.isalnum():
            raise self.error(f"does not read the escape \\{char}")
        return _Chars(frozenset(char))

    def char_class(self) -> _Node:
        chars: set[str] = set()
        negated = self.peek() == "^"
        if negated:
            self.take()
        while self.peek() != "]":
            char = self.take()
            if char == "\\":
                char = self.take()
                if char.isalnum():
                    raise self.error(f"does not read the escape \\{char} in a class")
            if self.peek() == "-" and self.pattern[self.at + 1 : self.at + 2] not in ("", "]"):
                self.take()
                last = self.take()
                if ord(last) < ord(char):
                    raise self.error(f"reads a reversed range {char}-{last}")
                chars.update(chr(code) for code in range(ord(char), ord(last) + 1))
            else:
                chars.add(char)
        self.take()
        if not chars:
            raise self.error("does not read an empty class")
        return _Chars(frozenset(chars), negated)


@functools.lru_cache(maxsize=1024)
def parse_regex(pattern: str) -> _Node:
    """The tree of a pattern of the subset this module reads.

    Raises:
        ValueError: syntax outside the subset (named, with the position).
    """
    parser = _Parser(pattern)
    node = parser.alternatives()
    if parser.peek() is not None:
        raise parser.error(f"does not read {parser.peek()!r}")
    return node


def regex_matches(pattern: str, text: str) -> bool:
    """Whether ``text`` as a whole matches ``pattern`` (by derivatives, not ``re``)."""
    return _nullable(_derive_text(parse_regex(pattern), text))


# --- the matcher ------------------------------------------------------------------------------


class ReferenceMatcher:
    """A :class:`~twostroke.states.constraints.Matcher` for a choice or a regex, by brute force.

    Args:
        constraint: The choice or the regular expression (of :func:`parse_regex`'s subset).
        vocabulary: Each token id's text; ids in ``eos_token_ids`` are EOS whatever their text.
        eos_token_ids: The ids that end the output.

    Raises:
        TypeError: another kind of constraint (it follows only these two).
        ValueError: a pattern outside the subset, an empty token text, or EOS ids outside
            the vocabulary.
    """

    def __init__(
        self,
        constraint: Constraint,
        vocabulary: Sequence[str],
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        if isinstance(constraint, Choice):
            self._language: _Node | tuple[str, ...] = constraint.choices
        elif isinstance(constraint, Regex):
            self._language = parse_regex(constraint.pattern)
        else:
            kind = type(constraint).__name__
            raise TypeError(f"the reference matcher follows a Choice or a Regex, got {kind}")
        self._eos = frozenset(eos_token_ids)
        if not all(0 <= token < len(vocabulary) for token in self._eos):
            raise ValueError(f"eos_token_ids {sorted(self._eos)} are not all in the vocabulary")
        self._texts = {i: text for i, text in enumerate(vocabulary) if i not in self._eos}
        if not all(self._texts.values()):
            raise ValueError("every token but EOS must have a non-empty text")
        self._vocab_size = len(vocabulary)
        self.constraint = constraint
        # The state after each token: the output's text, and whether EOS has come.
        self._history: list[tuple[str, bool]] = [("", False)]
        self._known: dict[str, frozenset[int]] = {}
        # A regex's derivative by each text reached, made from the one before it by the new
        # token's text: one derivative per token, not one per character of the whole text
        # at every question (the scheduler's machines ask thousands).
        self._states: dict[str, _Node] = {}

    @property
    def text(self) -> str:
        """The output so far, EOS left out."""
        return self._history[-1][0]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_tokens(self) -> int:
        return len(self._history) - 1

    def _viable(self, text: str) -> bool:
        """Whether ``text`` (of a choice) can still grow into a match."""
        assert isinstance(self._language, tuple)
        return any(choice.startswith(text) for choice in self._language)

    def _state(self, text: str) -> _Node:
        """The regex's derivative by ``text``, a text this matcher has reached."""
        assert not isinstance(self._language, tuple)
        state = self._states.get(text)
        if state is None:
            state = self._states[text] = _derive_text(self._language, text)
        return state

    @property
    def accepting(self) -> bool:
        if isinstance(self._language, tuple):
            return self.text in self._language
        return _nullable(self._state(self.text))

    @property
    def terminated(self) -> bool:
        return self._history[-1][1] or not self._extensions()

    def _extensions(self) -> frozenset[int]:
        """The tokens other than EOS that keep the output viable (kept per text: asked often)."""
        if self._history[-1][1]:
            return frozenset()
        text = self.text
        known = self._known.get(text)
        if known is not None:
            return known
        if isinstance(self._language, tuple):
            found = frozenset(
                token for token, piece in self._texts.items() if self._viable(text + piece)
            )
        else:  # the derivative by the text once, then by each piece
            state = self._state(text)
            found = frozenset(
                token
                for token, piece in self._texts.items()
                if not _is_empty(_derive_text(state, piece))
            )
        self._known[text] = found
        return found

    def allowed_token_ids(self) -> frozenset[int]:
        return self._extensions() | (self._eos if self.accepting else frozenset())

    def advance(self, token_id: int) -> bool:
        if token_id not in self.allowed_token_ids():
            return False
        if token_id in self._eos:  # EOS again after EOS changes nothing but the count
            self._history.append((self.text, True))
        else:
            text, piece = self.text, self._texts[token_id]
            if not isinstance(self._language, tuple) and text + piece not in self._states:
                self._states[text + piece] = _derive_text(self._state(text), piece)
            self._history.append((text + piece, False))
        return True

    def copy(self) -> ReferenceMatcher:
        """An independent matcher at the same place, to look ahead without moving this one.

        The simulated engine asks what a request's matcher would allow after the tokens its
        steps in flight sampled (the request's own matcher advances only as tokens are
        applied). What one has worked out per text, both keep: it holds for either.
        """
        twin = copy.copy(self)
        twin._history = list(self._history)
        return twin

    def fork(self) -> ReferenceMatcher:
        """:meth:`copy`, under the protocol's name."""
        return self.copy()

    def fill_bitmask(self, row: memoryview) -> None:
        expected = 4 * bitmask_words(self._vocab_size)
        if row.nbytes != expected:
            raise ValueError(f"a bitmask row must be {expected} bytes, got {row.nbytes}")
        write_bitmask(self.allowed_token_ids(), row)

    def __repr__(self) -> str:
        state = "terminated" if self.terminated else "accepting" if self.accepting else "open"
        return f"<ReferenceMatcher {self.constraint!r} {self.text!r} {state}>"
