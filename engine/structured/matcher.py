"""The :class:`~twostroke.states.constraints.Matcher` protocol over llguidance's ``LLMatcher``.

What llguidance does differently from the protocol, and how this adapter keeps the protocol:

* A token the grammar does not allow puts an ``LLMatcher`` in an error state it never
  leaves; :meth:`GuidanceMatcher.advance` tries the token first (``try_consume_tokens``), so
  a refused token changes nothing and returns ``False``. Where the grammar forces a text,
  the mask allows only the tokenizer's own spelling of it, and ``advance`` still takes the
  others (the protocol allows that).
* Where no token can continue an incomplete output (a dead end: the vocabulary cannot spell
  what the grammar needs), llguidance allows EOS, or enters its error state; the protocol
  allows EOS only where the output is complete, so the adapter clears the EOS bits there,
  refuses EOS, and reports the dead end as the protocol does (nothing allowed, terminated,
  not accepting): the request fails.
* Once the output cannot be extended (llguidance "stops"), llguidance allows EOS in the mask
  but does not take it; the adapter takes it as a token that changes nothing but the count.
* Where the backend leaves keywords of a JSON schema to a check of the complete output
  (:mod:`~twostroke.engine.structured.schemas`: ``oneOf`` enforced as ``anyOf``,
  ``uniqueItems``), the matcher is accepting only where the backend accepts *and* the output
  so far validates; an output that is complete for the backend but does not validate cannot
  end: where it cannot be extended either, it is a dead end whose :attr:`failure` says what
  did not validate.
* Limits the backend hits mid-output (lexer or parser fuel) leave it in its error state;
  the adapter raises :class:`~twostroke.engine.errors.MatcherError` with its reason.

:func:`fill_bitmasks` fills the rows of many matchers at once on llguidance's own thread
pool (the GIL released), which is how a step's constrained rows should be filled.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

from twostroke.engine.errors import MatcherError
from twostroke.engine.structured.backend import llguidance
from twostroke.engine.structured.grammars import reason_of
from twostroke.states.constraints import bitmask_words, read_bitmask

__all__ = ["GuidanceMatcher", "fill_bitmasks"]

#: How llguidance's error state starts when no token continues the output.
_DEAD_END = "NoExtension"


def _address(buffer: memoryview, nbytes: int) -> int:
    """The address of a writable, contiguous buffer of exactly ``nbytes`` bytes."""
    if buffer.readonly:
        raise ValueError("a bitmask row must be writable")
    if not buffer.c_contiguous:
        raise ValueError("a bitmask row must be contiguous")
    if buffer.nbytes != nbytes:
        raise ValueError(f"a bitmask row must be {nbytes} bytes, got {buffer.nbytes}")
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class GuidanceMatcher:
    """One request's matcher: an llguidance ``LLMatcher`` behind the states protocol.

    Made by :meth:`~twostroke.engine.structured.compiler.CompiledConstraint.matcher`, never
    directly. Not thread-safe: one thread at a time.

    Args:
        matcher: llguidance's matcher, in its initial state, this object's alone.
        vocab_size: How many token ids a mask covers.
        eos_token_ids: The ids that end the output.
        check: A check of the complete output (the reason it fails, or ``None``) and the
            tokenizer that spells the tokens for it, where the backend leaves part of the
            constraint to it.
    """

    __slots__ = (
        "_check_output",
        "_eos",
        "_matcher",
        "_num_tokens",
        "_row_bytes",
        "_tokens",
        "_verdict",
        "_vocab_size",
    )

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        *,
        check: tuple[Callable[[bytes], str | None], llguidance.LLTokenizer] | None = None,
    ) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._row_bytes = 4 * bitmask_words(vocab_size)
        self._num_tokens = 0
        self._check_output = check
        self._tokens: list[int] = []  # kept only where there is a check
        #: The check's verdict on the output of ``_num_tokens`` tokens, once asked.
        self._verdict: tuple[int, str | None] | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting()) and self._invalid() is None

    def _invalid(self) -> str | None:
        """Why the output so far, complete for the backend, does not pass the check."""
        if self._check_output is None or not self._matcher.is_accepting():
            return None
        if self._verdict is None or self._verdict[0] != self._num_tokens:
            check, tokenizer = self._check_output
            output = bytes(tokenizer.decode_bytes([t for t in self._tokens if t not in self._eos]))
            self._verdict = (self._num_tokens, check(output))
        return self._verdict[1]

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def failure(self) -> str | None:
        """Why the backend gave up on the output, if it did: the limit it hit (named as in
        ``CompilerConfig``, with its value), or a dead end; ``None`` while it goes on."""
        if self._matcher.is_error() and not self._dead_end():
            return reason_of(self._matcher.get_error())
        if self.terminated and not self.accepting:
            return self._invalid() or reason_of(_DEAD_END)
        return None

    def _dead_end(self) -> bool:
        return bool(self._matcher.is_error()) and self._matcher.get_error().startswith(_DEAD_END)

    def _check(self) -> None:
        if self._matcher.is_error() and not self._dead_end():
            raise MatcherError(reason_of(self._matcher.get_error()))

    def advance(self, token_id: int) -> bool:
        """Move past ``token_id`` if the output with it can still match; return whether it can.

        Every id of :meth:`allowed_token_ids` can; so can another spelling of a text the
        grammar forces, which the mask leaves out. EOS only where :attr:`accepting`.

        Raises:
            MatcherError: the backend gave up (a limit), not because of this token.
        """
        if not 0 <= token_id < self._vocab_size:
            return False
        if token_id in self._eos:
            if not self.accepting:
                return False
            if self._matcher.is_stopped():  # llguidance takes no token once stopped
                self._took(token_id)
                return True
        if self._matcher.try_consume_tokens([token_id]) == 1:
            self._took(token_id)
            return True
        self._check()
        return False

    def _took(self, token_id: int) -> None:
        self._num_tokens += 1
        if self._check_output is not None:
            self._tokens.append(token_id)

    def _clear_eos(self, row: memoryview) -> None:
        """Clear the EOS bits of a row llguidance filled, unless the output is complete."""
        if self._eos and not self.accepting:
            data = row if row.format == "B" and row.ndim == 1 else row.cast("B")
            for token in self._eos:
                data[token >> 3] &= ~(1 << (token & 7)) & 0xFF

    def allowed_token_ids(self) -> frozenset[int]:
        """The ids :meth:`advance` would take now.

        Raises:
            MatcherError: the backend gave up computing the mask.
        """
        row = memoryview(bytearray(self._row_bytes))
        self.fill_bitmask(row)
        return read_bitmask(row)

    def fill_bitmask(self, row: memoryview) -> None:
        """Write the allowed set into one bitmask row (``4 * bitmask_words(vocab_size)`` bytes).

        Raises:
            ValueError: the row is read-only, not contiguous or of the wrong size.
            MatcherError: the backend gave up computing the mask.
        """
        self._matcher.unsafe_compute_mask_ptr(_address(row, self._row_bytes), self._row_bytes)
        self._check()
        self._clear_eos(row)

    def fork(self) -> GuidanceMatcher:
        """An independent matcher at the same place (llguidance's ``deep_copy``)."""
        twin = GuidanceMatcher(
            self._matcher.deep_copy(), self._vocab_size, self._eos, check=self._check_output
        )
        twin._num_tokens = self._num_tokens
        twin._tokens = list(self._tokens)
        twin._verdict = self._verdict
        return twin

    def __repr__(self) -> str:
        state = (
            "dead end"
            if self._dead_end()
            else "error"
            if self._matcher.is_error()
            else "terminated"
            if self.terminated
            else "accepting"
            if self.accepting
            else "open"
        )
        return f"<GuidanceMatcher {self._num_tokens} tokens, {state}>"


def fill_bitmasks(
    matchers: Sequence[tuple[GuidanceMatcher, int]],
    rows: memoryview,
    executor: llguidance.LLExecutor,
    *,
    failures: list[tuple[int, Exception]] | None = None,
) -> None:
    """Fill many matchers' rows of one bitmask at once, in parallel, the GIL released.

    Args:
        matchers: Each matcher (once) with the index of its row; all of one vocabulary.
        rows: The whole bitmask, writable and contiguous: ``num_rows`` rows of
            ``4 * bitmask_words(vocab_size)`` bytes (a 2-D int32 array, or its bytes).
        executor: llguidance's thread pool (``llguidance.LLExecutor(num_threads)``).
        failures: Where each matcher the backend gave up on goes, as its row and its error,
            rather than raising the first (the others' rows are filled all the same).

    Raises:
        ValueError: an index outside the rows, a matcher given twice, matchers of different
            vocabulary sizes, or a bitmask of the wrong size or layout.
        MatcherError: the backend gave up on one of the matchers (the first one's reason),
            unless ``failures`` takes it.
    """
    if not matchers:
        return
    row_bytes = matchers[0][0]._row_bytes
    if any(matcher._row_bytes != row_bytes for matcher, _ in matchers):
        raise ValueError("the matchers of one bitmask must share one vocabulary size")
    if rows.nbytes % row_bytes:
        raise ValueError(f"a bitmask must be whole rows of {row_bytes} bytes, got {rows.nbytes}")
    num_rows = rows.nbytes // row_bytes
    rows_of: dict[int, int] = {}  # llguidance's matcher (by id): the row it fills
    for matcher, index in matchers:
        if not 0 <= index < num_rows:
            raise ValueError(f"row {index} is outside a bitmask of {num_rows} rows")
        # llguidance borrows each matcher for the call: one given twice is its RuntimeError
        # "Already borrowed", which names neither the rule nor the rows.
        first = rows_of.setdefault(id(matcher._matcher), index)
        if first != index:
            raise ValueError(
                f"each matcher fills one row of a call, got one matcher for rows {first} and "
                f"{index} (copy the row instead)"
            )
    address = _address(rows, rows.nbytes)
    executor.unsafe_compute_mask_ptr(
        [(matcher._matcher, index) for matcher, index in matchers], address, row_bytes, num_rows
    )
    data = rows if rows.format == "B" and rows.ndim == 1 else rows.cast("B")
    for matcher, index in matchers:
        try:
            matcher._check()
        except MatcherError as exc:
            if failures is None:
                raise
            failures.append((index, exc))
            continue
        matcher._clear_eos(data[index * row_bytes : (index + 1) * row_bytes])
