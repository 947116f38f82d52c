"""Compiling constraints, off the event loop, bounded in time and memory, cached by value.

A constraint compiles into a :class:`CompiledConstraint`: an llguidance matcher in its
initial state whose first mask has been computed, so that its lazily built lexer exists and
any limit the grammar breaks from its first token shows up here, as a
:class:`~twostroke.states.errors.ConstraintRejected`, not in the middle of a request. Each
request then gets its own :class:`~twostroke.engine.structured.matcher.GuidanceMatcher`, a
copy of that matcher (``deep_copy``: microseconds, and the lexer states built so far come
along; it copies the grammar's lexemes, about a byte per character of the constraint).

Anything the backend raises while compiling (llguidance raises ``ValueError`` on a number
its JSON reader cannot hold, or on text it cannot encode) is the constraint's refusal, never
the caller's exception: one request's input must not end the engine that compiles it.

:meth:`GrammarCompiler.compile` runs the work on a compile thread
(:class:`~twostroke.engine.structured.workers.CompilePool`: a stack deep enough for any
constraint within the size limits, at most ``max_concurrent`` compiles at once and one more
thread for small constraints, the smallest first) and gives up on one after ``timeout``
seconds of running: the caller gets ``ConstraintRejected`` at once, and the thread goes on,
holding its slot, until the compile ends (llguidance's fuel limits bound the work of every
compile). Outcomes are cached by the constraint, a hashable value equal for equal
constraints, in an LRU bounded in entries and in estimated bytes: refusals too, so a client
that repeats an over-complex schema costs one compile, not one per request. Requests that
bring one new constraint at once (the choices of one request) share one compile.
"""

from __future__ import annotations

import collections
import time
from functools import partial

import anyio
import anyio.lowlevel
import attrs

from twostroke.engine.structured.backend import llguidance
from twostroke.engine.structured.grammars import (
    field_of,
    grammar_of,
    json_grammar,
    reason_of,
    size_of,
)
from twostroke.engine.structured.matcher import GuidanceMatcher
from twostroke.engine.structured.schemas import SchemaCheck
from twostroke.engine.structured.vocabulary import Vocabulary
from twostroke.engine.structured.workers import CompilePool
from twostroke.states.constraints import Constraint, Grammar, JsonSchema, Regex, bitmask_words
from twostroke.states.errors import ConstraintRejected
from twostroke.states.validators import int_at_least, number_in

__all__ = [
    "BYTES_PER_CHARACTER",
    "DEFAULT_COMPILE_TIMEOUT",
    "ENTRY_BYTES",
    "CompiledConstraint",
    "CompilerConfig",
    "CompilerStatistics",
    "GrammarCompiler",
]

#: Seconds one compile may take before its constraint is refused. The tool-call schema of
#: docs/structured-output.md compiles in about 15 ms on a busy 2-core machine.
DEFAULT_COMPILE_TIMEOUT = 5.0
#: What a compiled constraint is taken to hold, for the cache's bound: this much, plus
#: :data:`BYTES_PER_CHARACTER` per character of its text. Measured on the toy's vocabulary
#: (llguidance 1.9.1): 20-47 bytes a character for constraints of 100,000-130,000
#: characters, 0.8-1.1 MiB for short regular expressions with large automata.
ENTRY_BYTES = 1 << 20
#: See :data:`ENTRY_BYTES`.
BYTES_PER_CHARACTER = 64


@attrs.frozen(kw_only=True)
class CompilerConfig:
    """How a :class:`GrammarCompiler` bounds its work.

    Args:
        timeout: Seconds one compile may run (> 0); past it the constraint is refused.
        max_cached: How many compiled constraints (and refusals) the LRU cache keeps (>= 1).
        max_cached_bytes: How many bytes its entries may hold together, estimated
            (:data:`ENTRY_BYTES` and :data:`BYTES_PER_CHARACTER`); the most recent one is
            kept whatever its size.
        max_concurrent: How many compiles run at once (>= 1); more wait their turn,
            smallest first (the wait does not count against ``timeout``). A compile given
            up keeps its slot until it ends.
        small_size: Constraints of at most this many characters also have a thread of
            their own, so that they never wait behind larger ones.
        max_grammar_size: llguidance's limit on the symbols of one grammar.
        lexer_fuel: llguidance's limit on the work of building the lexer for one grammar.
        step_lexer_fuel: llguidance's limit on the lexer work of one mask.
        max_items_in_row: llguidance's limit on the Earley items of one row of the parse
            (a grammar right-recursive in many alternatives breaks it, possibly only
            partway through an output).
        step_max_items: llguidance's limit on the Earley items one mask may add.
    """

    timeout: float = attrs.field(
        default=DEFAULT_COMPILE_TIMEOUT, validator=number_in(0, low_open=True)
    )
    max_cached: int = attrs.field(default=256, validator=int_at_least(1))
    max_cached_bytes: int = attrs.field(default=256 << 20, validator=int_at_least(1))
    max_concurrent: int = attrs.field(default=2, validator=int_at_least(1))
    small_size: int = attrs.field(default=8_192, validator=int_at_least(0))
    max_grammar_size: int = attrs.field(default=500_000, validator=int_at_least(1))
    lexer_fuel: int = attrs.field(default=1_000_000, validator=int_at_least(1))
    step_lexer_fuel: int = attrs.field(default=200_000, validator=int_at_least(1))
    max_items_in_row: int = attrs.field(default=2_000, validator=int_at_least(1))
    step_max_items: int = attrs.field(default=50_000, validator=int_at_least(1))

    def limits(self) -> llguidance.LLParserLimits:
        """llguidance's limits; its messages do not quote the grammar (``verbose_errors``)."""
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size,
            initial_lexer_fuel=self.lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            max_items_in_row=self.max_items_in_row,
            step_max_items=self.step_max_items,
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
        cached_bytes: What they hold, estimated.
        num_queued: Compiles waiting for a thread.
        num_running: Compiles running, given up ones included (each holds its thread).
    """

    num_hits: int
    num_compiled: int
    num_rejected: int
    num_timed_out: int
    num_cached: int
    cached_bytes: int
    num_queued: int
    num_running: int


@attrs.frozen(eq=False)
class CompiledConstraint:
    """A constraint compiled against one vocabulary; each request takes a :meth:`matcher`.

    Attributes:
        constraint: What was compiled.
        vocabulary: Against which vocabulary.
        seconds: How long compiling took (the first mask included).
        check: What validates a complete output, where the backend leaves keywords of a
            JSON schema to it (:mod:`~twostroke.engine.structured.schemas`); each matcher
            lets an output end only once it passes.
    """

    constraint: Constraint
    vocabulary: Vocabulary
    _template: llguidance.LLMatcher = attrs.field(alias="template", repr=False)
    seconds: float
    check: SchemaCheck | None = attrs.field(default=None, repr=False)

    def matcher(self) -> GuidanceMatcher:
        """A new matcher at the start of the output, for one request."""
        return GuidanceMatcher(
            self._template.deep_copy(),
            self.vocabulary.vocab_size,
            self.vocabulary.eos_token_ids,
            check=None if self.check is None else (self.check, self.vocabulary.backend),
        )


def _compile(
    constraint: Constraint, vocabulary: Vocabulary, limits: llguidance.LLParserLimits
) -> CompiledConstraint | ConstraintRejected:
    """Compile in the calling thread; a refusal is returned, not raised (it is cached).

    Whatever the backend raises is a refusal too, in its words: ``ValueError`` is how
    llguidance refuses input it cannot read; another exception's type is named.
    """
    start = time.perf_counter()
    field = field_of(constraint)
    lark = constraint.source if isinstance(constraint, Grammar) else None  # its positions'
    quote = not isinstance(constraint, Regex)  # a regex constraint's field is its pattern
    check = None
    try:
        if isinstance(constraint, JsonSchema):
            grammar, check = json_grammar(constraint)
        else:
            grammar = grammar_of(constraint)
        # The constructor validates the grammar: a bad one leaves the matcher in its error
        # state.
        template = llguidance.LLMatcher(vocabulary.backend, grammar, log_level=0, limits=limits)
        if not template.is_error():
            # The first mask builds the lexer (llguidance builds it lazily) and meets the
            # limits a grammar breaks from its first token.
            template.compute_bitmask()
    except ConstraintRejected as refusal:
        return refusal
    except Exception as exc:
        reason = reason_of(str(exc), lark, pattern=quote)
        if not isinstance(exc, ValueError):
            reason = f"{type(exc).__name__}: {reason}"
        return ConstraintRejected(field, reason)
    if template.is_error():
        return ConstraintRejected(field, reason_of(template.get_error(), lark, pattern=quote))
    seconds = time.perf_counter() - start
    return CompiledConstraint(constraint, vocabulary, template, seconds, check)


def _estimated_bytes(
    constraint: Constraint, outcome: CompiledConstraint | ConstraintRejected
) -> int:
    """What a cache entry holds, estimated (see :data:`ENTRY_BYTES`)."""
    if isinstance(outcome, ConstraintRejected):
        return 256 + len(outcome.reason)
    return ENTRY_BYTES + BYTES_PER_CHARACTER * size_of(constraint)


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
        self._cache: collections.OrderedDict[
            Constraint, tuple[CompiledConstraint | ConstraintRejected, int]
        ] = collections.OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[Constraint, anyio.Event] = {}
        self._pool = CompilePool(
            max_concurrent=self.config.max_concurrent, small_size=self.config.small_size
        )
        self._hits = self._compiled = self._rejected = self._timed_out = 0

    @property
    def bitmask_words(self) -> int:
        """How many 32-bit words one bitmask row of this vocabulary takes."""
        return bitmask_words(self.vocabulary.vocab_size)

    def _cached(self, constraint: Constraint) -> CompiledConstraint | None:
        """The cached outcome (refreshed in the LRU order), raised if a refusal."""
        entry = self._cache.get(constraint)
        if entry is None:
            return None
        self._cache.move_to_end(constraint)
        self._hits += 1
        outcome = entry[0]
        if isinstance(outcome, ConstraintRejected):
            raise ConstraintRejected(outcome.field, outcome.reason)
        return outcome

    def _store(
        self, constraint: Constraint, outcome: CompiledConstraint | ConstraintRejected
    ) -> CompiledConstraint:
        size = _estimated_bytes(constraint, outcome)
        self._cache[constraint] = (outcome, size)
        self._cached_bytes += size
        config = self.config
        while len(self._cache) > 1 and (
            len(self._cache) > config.max_cached or self._cached_bytes > config.max_cached_bytes
        ):
            _, (_, evicted) = self._cache.popitem(last=False)
            self._cached_bytes -= evicted
        if isinstance(outcome, ConstraintRejected):
            self._rejected += 1
            raise ConstraintRejected(outcome.field, outcome.reason)
        self._compiled += 1
        return outcome

    async def compile(self, constraint: Constraint) -> CompiledConstraint:
        """The compiled constraint, from the cache or compiled on a compile thread.

        Always a checkpoint. Cancelling the caller abandons its compile (nothing is cached;
        a request waiting for the same constraint compiles it itself); a compile not
        started yet is dropped, a running one ends on its thread.

        Args:
            constraint: The constraint.

        Returns:
            The compiled constraint.

        Raises:
            ConstraintRejected: the backend refused it (or raised), now or before (cached),
                or it did not compile within ``config.timeout`` seconds of running.
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
            work = partial(_compile, constraint, self.vocabulary, self._limits)
            outcome = await self._pool.run(size_of(constraint), work, self.config.timeout)
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
        """:meth:`compile` for synchronous callers (scripts, tests), without the time bound.

        The compile still runs on a thread with the compile stack (this one waits for it).

        Raises:
            ConstraintRejected: the backend refused it, now or before (cached).
        """
        cached = self._cached(constraint)
        if cached is not None:
            return cached
        work = partial(_compile, constraint, self.vocabulary, self._limits)
        return self._store(constraint, self._pool.run_now(work))

    def statistics(self) -> CompilerStatistics:
        """What the compiler has done so far, and what its threads do now."""
        pool = self._pool.statistics()
        return CompilerStatistics(
            num_hits=self._hits,
            num_compiled=self._compiled,
            num_rejected=self._rejected,
            num_timed_out=self._timed_out,
            num_cached=len(self._cache),
            cached_bytes=self._cached_bytes,
            num_queued=pool.num_queued,
            num_running=pool.num_running,
        )

    def __repr__(self) -> str:
        return (
            f"<GrammarCompiler {self.vocabulary.vocab_size} tokens, "
            f"{len(self._cache)}/{self.config.max_cached} cached>"
        )
