"""Compiling constraints, off the event loop, bounded in time, cached by value.

A constraint compiles into a :class:`CompiledConstraint`: an llguidance matcher in its
initial state whose first mask has been computed, so that its lazily built lexer exists and
any limit the grammar breaks from its first token shows up here, as a
:class:`~twostroke.states.errors.ConstraintRejected`, not in the middle of a request. Each
request then gets its own :class:`~twostroke.engine.structured.matcher.GuidanceMatcher`, a
copy of that matcher (``deep_copy``: microseconds, and the lexer states built so far come
along).

:meth:`GrammarCompiler.compile` runs the work in a worker thread (llguidance releases the
GIL), at most ``max_concurrent`` at a time, and gives up on one after ``timeout`` seconds:
the caller gets ``ConstraintRejected`` at once, and the thread, abandoned, ends on its own
(llguidance's fuel limits bound the work of every compile). Outcomes are cached by the
constraint, a hashable value equal for equal constraints, in a bounded LRU: refusals too, so
a client that repeats an over-complex schema costs one compile, not one per request. Two
requests that bring one new constraint at once share one compile.
"""

from __future__ import annotations

import collections
import time

import anyio
import anyio.lowlevel
import attrs
import llguidance

from twostroke.engine.structured.grammars import field_of, grammar_of, reason_of
from twostroke.engine.structured.matcher import GuidanceMatcher
from twostroke.engine.structured.vocabulary import Vocabulary
from twostroke.states.constraints import Constraint, bitmask_words
from twostroke.states.errors import ConstraintRejected
from twostroke.states.validators import int_at_least, number_in

__all__ = [
    "DEFAULT_COMPILE_TIMEOUT",
    "CompiledConstraint",
    "CompilerConfig",
    "CompilerStatistics",
    "GrammarCompiler",
]

#: Seconds one compile may take before its constraint is refused. The tool-call schema of
#: docs/structured-output.md compiles in about 15 ms on a busy 2-core machine.
DEFAULT_COMPILE_TIMEOUT = 5.0


@attrs.frozen(kw_only=True)
class CompilerConfig:
    """How a :class:`GrammarCompiler` bounds its work.

    Args:
        timeout: Seconds one compile may take (> 0); past it the constraint is refused.
        max_cached: How many compiled constraints (and refusals) the LRU cache keeps (>= 1).
        max_concurrent: How many compiles run at once (>= 1); more wait their turn (the
            wait does not count against ``timeout``).
        max_grammar_size: llguidance's limit on the symbols of one grammar.
        lexer_fuel: llguidance's limit on the work of building the lexer for one grammar.
        step_lexer_fuel: llguidance's limit on the lexer work of one mask.
    """

    timeout: float = attrs.field(
        default=DEFAULT_COMPILE_TIMEOUT, validator=number_in(0, low_open=True)
    )
    max_cached: int = attrs.field(default=256, validator=int_at_least(1))
    max_concurrent: int = attrs.field(default=2, validator=int_at_least(1))
    max_grammar_size: int = attrs.field(default=500_000, validator=int_at_least(1))
    lexer_fuel: int = attrs.field(default=1_000_000, validator=int_at_least(1))
    step_lexer_fuel: int = attrs.field(default=200_000, validator=int_at_least(1))

    def limits(self) -> llguidance.LLParserLimits:
        """llguidance's limits; its messages do not quote the grammar (``verbose_errors``)."""
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size,
            initial_lexer_fuel=self.lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            verbose_errors=False,
        )


@attrs.frozen
class CompilerStatistics:
    """What a :class:`GrammarCompiler` has done (a snapshot).

    Attributes:
        num_hits: Compiles answered from the cache (refusals included).
        num_compiled: Constraints compiled.
        num_rejected: Constraints the backend refused (timeouts included).
        num_timed_out: Compiles given up after ``timeout``.
        num_cached: Outcomes in the cache now.
    """

    num_hits: int
    num_compiled: int
    num_rejected: int
    num_timed_out: int
    num_cached: int


@attrs.frozen(eq=False)
class CompiledConstraint:
    """A constraint compiled against one vocabulary; each request takes a :meth:`matcher`.

    Attributes:
        constraint: What was compiled.
        vocabulary: Against which vocabulary.
        seconds: How long compiling took (the first mask included).
    """

    constraint: Constraint
    vocabulary: Vocabulary
    _template: llguidance.LLMatcher = attrs.field(alias="template", repr=False)
    seconds: float

    def matcher(self) -> GuidanceMatcher:
        """A new matcher at the start of the output, for one request."""
        return GuidanceMatcher(
            self._template.deep_copy(), self.vocabulary.vocab_size, self.vocabulary.eos_token_ids
        )


def _compile(
    constraint: Constraint, vocabulary: Vocabulary, limits: llguidance.LLParserLimits
) -> CompiledConstraint | ConstraintRejected:
    """Compile in the calling thread; a refusal is returned, not raised (it is cached)."""
    start = time.perf_counter()
    field = field_of(constraint)
    try:
        grammar = grammar_of(constraint)
    except ConstraintRejected as refusal:
        return refusal
    # The constructor validates the grammar: a bad one leaves the matcher in its error state.
    template = llguidance.LLMatcher(vocabulary.backend, grammar, log_level=0, limits=limits)
    if not template.is_error():
        # The first mask builds the lexer (llguidance builds it lazily) and meets the limits
        # a grammar breaks from its first token.
        template.compute_bitmask()
    if template.is_error():
        return ConstraintRejected(field, reason_of(template.get_error()))
    return CompiledConstraint(constraint, vocabulary, template, time.perf_counter() - start)


class GrammarCompiler:
    """Compiles constraints for one vocabulary, and keeps what it compiled.

    Args:
        vocabulary: The tokenizer's vocabulary (:meth:`Vocabulary.from_tokenizer`).
        config: Time, cache and backend limits.
    """

    def __init__(self, vocabulary: Vocabulary, config: CompilerConfig | None = None) -> None:
        self.vocabulary = vocabulary
        self.config = config or CompilerConfig()
        self._limits = self.config.limits()
        self._cache: collections.OrderedDict[Constraint, CompiledConstraint | ConstraintRejected]
        self._cache = collections.OrderedDict()
        self._pending: dict[Constraint, anyio.Event] = {}
        self._limiter: anyio.CapacityLimiter | None = None
        self._hits = self._compiled = self._rejected = self._timed_out = 0

    @property
    def bitmask_words(self) -> int:
        """How many 32-bit words one bitmask row of this vocabulary takes."""
        return bitmask_words(self.vocabulary.vocab_size)

    def _cached(self, constraint: Constraint) -> CompiledConstraint | None:
        """The cached outcome (refreshed in the LRU order), raised if a refusal."""
        outcome = self._cache.get(constraint)
        if outcome is None:
            return None
        self._cache.move_to_end(constraint)
        self._hits += 1
        if isinstance(outcome, ConstraintRejected):
            raise ConstraintRejected(outcome.field, outcome.reason)
        return outcome

    def _store(
        self, constraint: Constraint, outcome: CompiledConstraint | ConstraintRejected
    ) -> CompiledConstraint:
        self._cache[constraint] = outcome
        while len(self._cache) > self.config.max_cached:
            self._cache.popitem(last=False)
        if isinstance(outcome, ConstraintRejected):
            self._rejected += 1
            raise ConstraintRejected(outcome.field, outcome.reason)
        self._compiled += 1
        return outcome

    async def compile(self, constraint: Constraint) -> CompiledConstraint:
        """The compiled constraint, from the cache or compiled in a worker thread.

        Always a checkpoint. Cancelling the caller abandons its compile (nothing is cached;
        a request waiting for the same constraint compiles it itself).

        Args:
            constraint: The constraint.

        Returns:
            The compiled constraint.

        Raises:
            ConstraintRejected: the backend refused it, now or before (cached), or it did
                not compile within ``config.timeout`` seconds.
        """
        await anyio.lowlevel.checkpoint()
        while True:
            cached = self._cached(constraint)
            if cached is not None:
                return cached
            pending = self._pending.get(constraint)
            if pending is None:
                break
            await pending.wait()
        done = self._pending[constraint] = anyio.Event()
        try:
            if self._limiter is None:
                self._limiter = anyio.CapacityLimiter(self.config.max_concurrent)
            async with self._limiter:
                outcome: CompiledConstraint | ConstraintRejected | None = None
                with anyio.move_on_after(self.config.timeout):
                    outcome = await anyio.to_thread.run_sync(
                        _compile, constraint, self.vocabulary, self._limits, abandon_on_cancel=True
                    )
            if outcome is None:
                self._timed_out += 1
                outcome = ConstraintRejected(
                    field_of(constraint),
                    f"did not compile within {self.config.timeout:g} s (too complex)",
                )
            return self._store(constraint, outcome)
        finally:
            del self._pending[constraint]
            done.set()

    def compile_now(self, constraint: Constraint) -> CompiledConstraint:
        """:meth:`compile` in the calling thread, without the time bound (scripts, tests).

        Raises:
            ConstraintRejected: the backend refused it, now or before (cached).
        """
        cached = self._cached(constraint)
        if cached is not None:
            return cached
        return self._store(constraint, _compile(constraint, self.vocabulary, self._limits))

    def statistics(self) -> CompilerStatistics:
        """What the compiler has done so far."""
        return CompilerStatistics(
            num_hits=self._hits,
            num_compiled=self._compiled,
            num_rejected=self._rejected,
            num_timed_out=self._timed_out,
            num_cached=len(self._cache),
        )

    def __repr__(self) -> str:
        return (
            f"<GrammarCompiler {self.vocabulary.vocab_size} tokens, "
            f"{len(self._cache)}/{self.config.max_cached} cached>"
        )
