"""GrammarCompiler: off the loop, bounded in time, cached by value, one compile per constraint."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import llguidance
import pytest

from twostroke.engine.structured import (
    CompiledConstraint,
    CompilerConfig,
    CompilerStatistics,
    GrammarCompiler,
    Vocabulary,
    compiler,
)
from twostroke.engine.tools import GENERIC, MISTRAL, ToolSpec, tool_constraint
from twostroke.states.constraints import (
    AnyJsonObject,
    Choice,
    Constraint,
    Grammar,
    JsonSchema,
    Regex,
)
from twostroke.states.errors import ConstraintRejected

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class GatedCompile:
    """Stands in for the compile a worker thread runs: it waits until the test opens the gate.

    Counts its calls; the real compile runs once the gate opens, so results are real.
    """

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[Constraint] = []
        self.real = compiler._compile
        self._called = threading.Condition()
        #: Only these wait for the gate (all when ``None``); the others compile at once.
        self.gated: set[Constraint] | None = None
        #: How long a gated call waits at most (a bound, not a sleep: the test opens it).
        self.bound = 60.0

    def __call__(self, constraint: Constraint, *args: Any) -> Any:
        with self._called:
            self.calls.append(constraint)
            self._called.notify_all()
        if self.gated is None or constraint in self.gated:
            self.gate.wait(timeout=self.bound)
        return self.real(constraint, *args)

    async def called(self, times: int) -> None:
        """Return once the worker threads have made ``times`` calls in all."""

        def wait() -> None:
            with self._called:
                assert self._called.wait_for(lambda: len(self.calls) >= times, timeout=60)

        await anyio.to_thread.run_sync(wait)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedCompile]:
    gate = GatedCompile()
    monkeypatch.setattr(compiler, "_compile", gate)
    yield gate
    gate.gate.set()  # an abandoned worker thread ends


async def test_equal_constraints_compile_once(byte_vocabulary: Vocabulary) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary)
    first = await compiler_.compile(JsonSchema(SCHEMA))
    first_text = JsonSchema(SCHEMA).schema
    text = '{ "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"] }'
    again = await compiler_.compile(JsonSchema(text))
    assert again is first
    assert isinstance(first, CompiledConstraint)
    assert first.constraint == JsonSchema(SCHEMA)
    assert first.vocabulary is byte_vocabulary
    assert first.seconds > 0
    assert compiler_.statistics() == CompilerStatistics(
        num_hits=1,
        num_compiled=1,
        num_rejected=0,
        num_timed_out=0,
        num_cached=1,
        cached_bytes=compiler.ENTRY_BYTES + compiler.BYTES_PER_CHARACTER * len(first_text),
        num_queued=0,
        num_running=0,
    )
    assert compiler_.compile_now(JsonSchema(SCHEMA)) is first
    # each request gets a matcher of its own
    one, two = first.matcher(), first.matcher()
    assert one.advance(ord("{"))
    assert two.num_tokens == 0


async def test_refusals_are_cached_and_raised_afresh(byte_vocabulary: Vocabulary) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary)
    caught = []
    for _ in range(2):
        with pytest.raises(ConstraintRejected) as error:
            await compiler_.compile(JsonSchema({"type": "object", "$dynamicRef": "#a"}))
        caught.append(error.value)
    assert caught[0] is not caught[1]
    for error in caught:
        assert str(error) == 'constraint.schema: Unimplemented keys: ["$dynamicRef"]'
        assert (error.field, error.reason) == (
            "constraint.schema",
            'Unimplemented keys: ["$dynamicRef"]',
        )
    reason = 'Unimplemented keys: ["$dynamicRef"]'
    assert compiler_.statistics() == CompilerStatistics(
        num_hits=1,
        num_compiled=0,
        num_rejected=1,
        num_timed_out=0,
        num_cached=1,
        cached_bytes=256 + len(reason),
        num_queued=0,
        num_running=0,
    )


UNIQUE = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
BAD_RANGE = {"type": "object", "properties": {"s": {"type": "string", "pattern": "[z-a]"}}}
REFUSALS = [
    (Regex("(a"), "constraint.pattern: invalid regex: unclosed group"),
    (
        Regex("(?<=a)b"),
        "constraint.pattern: invalid regex: look-around, including look-ahead and look-behind, "
        "is not supported",
    ),
    (JsonSchema({"type": "strin"}), "constraint.schema: Invalid type: strin"),
    (
        JsonSchema({"type": "integer", "minimum": 3, "maximum": 1}),
        "constraint.schema: Unsatisfiable schema: minimum (3) is greater than maximum (1)",
    ),
    (
        JsonSchema({"$ref": "#/$defs/missing"}),
        "constraint.schema: Pointer '/$defs/missing' does not exist",
    ),
    (
        # a key's pattern (a string's pattern is relaxed and checked: test_schemas.py)
        JsonSchema({"type": "object", "patternProperties": {"(?=x)": {}}}),
        "constraint.schema: invalid regex '(?=x)': look-around, including look-ahead and "
        "look-behind, "
        "is not supported",
    ),
    (JsonSchema({"$dynamicRef": "#a"}), 'constraint.schema: Unimplemented keys: ["$dynamicRef"]'),
    (Grammar("start: foo"), 'constraint.grammar: line 1, column 8: unknown name: "foo"'),
    # A regex as written, not its place in the grammar generated from it.
    (
        JsonSchema({"type": "string", "pattern": "a(b"}),
        "constraint.schema: invalid regex 'a(b': unclosed group",
    ),
    # In the tools' grammar, the function whose parameters fail, not the engine's lines.
    (
        tool_constraint(GENERIC, [ToolSpec("ok"), ToolSpec("pick", None, UNIQUE)]),
        "constraint.grammar: the parameters of function 'pick': failed to compile JSON schema: "
        'Unimplemented keys: ["uniqueItems"]',
    ),
    (
        tool_constraint(MISTRAL, [ToolSpec("pick", None, BAD_RANGE)]),
        "constraint.grammar: the parameters of function 'pick': failed to compile JSON schema: "
        "invalid regex '[z-a]': invalid character class range, the start must be <= the end",
    ),
    (
        Grammar('root ::= ("a"'),
        "constraint.grammar: Failed to convert the grammar from GBNF to Lark: Expected ')' at "
        "line 1, 'root ::= (\"a\"' ^ ''",
    ),
]


@pytest.mark.parametrize(("constraint", "message"), REFUSALS, ids=[m for _, m in REFUSALS])
async def test_what_the_backend_cannot_enforce_is_refused_naming_field_and_reason(
    byte_vocabulary: Vocabulary, constraint: Constraint, message: str
) -> None:
    with pytest.raises(ConstraintRejected, match=f"^{re.escape(message)}$"):
        await GrammarCompiler(byte_vocabulary).compile(constraint)


@pytest.mark.parametrize(
    "constraint",
    [
        JsonSchema({"type": "string", "format": "email"}),
        AnyJsonObject(),
        Choice(["yes", "no"]),
        Grammar('start: "a"+ "b"'),
        Grammar('root ::= "yes" | "no"'),
        Regex(r"\d{3}-\d{4}"),
    ],
)
async def test_what_it_can_enforce_compiles(
    byte_vocabulary: Vocabulary, constraint: Constraint
) -> None:
    compiled = await GrammarCompiler(byte_vocabulary).compile(constraint)
    assert compiled.matcher().allowed_token_ids()


async def test_the_cache_keeps_the_most_recently_used(byte_vocabulary: Vocabulary) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary, CompilerConfig(max_cached=2))
    a, b, c = Regex("a"), Regex("b"), Regex("c")
    first_a = await compiler_.compile(a)
    await compiler_.compile(b)
    assert await compiler_.compile(a) is first_a  # a is now the most recent
    await compiler_.compile(c)  # b goes
    assert compiler_.statistics().num_cached == 2
    assert await compiler_.compile(a) is first_a
    await compiler_.compile(b)  # compiled again
    assert compiler_.statistics() == CompilerStatistics(
        num_hits=2,
        num_compiled=4,
        num_rejected=0,
        num_timed_out=0,
        num_cached=2,
        cached_bytes=2 * (compiler.ENTRY_BYTES + compiler.BYTES_PER_CHARACTER),
        num_queued=0,
        num_running=0,
    )
    assert repr(compiler_) == "<GrammarCompiler 257 tokens, 2/2 cached>"


async def test_the_cache_is_bounded_by_estimated_bytes(byte_vocabulary: Vocabulary) -> None:
    """24 distinct 4 MB choices took a server 605 MiB up: 256 entries of any size."""
    entry = compiler.ENTRY_BYTES + compiler.BYTES_PER_CHARACTER * 1_000
    compiler_ = GrammarCompiler(byte_vocabulary, CompilerConfig(max_cached_bytes=2 * entry))
    choices = [Choice([letter * 1_000]) for letter in "abc"]
    for choice in choices:
        await compiler_.compile(choice)
    stats = compiler_.statistics()
    assert (stats.num_cached, stats.cached_bytes) == (2, 2 * entry)  # "a" went
    await compiler_.compile(choices[1])
    assert compiler_.statistics().num_hits == 1
    await compiler_.compile(choices[0])
    assert compiler_.statistics().num_compiled == 4  # compiled again
    # The most recent entry stays, however large.
    alone = GrammarCompiler(byte_vocabulary, CompilerConfig(max_cached_bytes=1))
    await alone.compile(choices[0])
    assert alone.statistics().num_cached == 1


async def test_a_compile_past_its_time_is_refused_and_remembered(
    byte_vocabulary: Vocabulary, gated: GatedCompile
) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary, CompilerConfig(timeout=0.05))
    message = "constraint.pattern: did not compile within 0.05 s (too complex)"
    with pytest.raises(ConstraintRejected, match=f"^{re.escape(message)}$"):
        await compiler_.compile(Regex("a+"))
    # the same constraint again is refused at once, without another compile
    with pytest.raises(ConstraintRejected, match=f"^{re.escape(message)}$"):
        await compiler_.compile(Regex("a+"))
    assert gated.calls == [Regex("a+")]
    reason = "did not compile within 0.05 s (too complex)"
    assert compiler_.statistics() == CompilerStatistics(
        num_hits=1,
        num_compiled=0,
        num_rejected=1,
        num_timed_out=1,
        num_cached=1,
        cached_bytes=256 + len(reason),
        num_queued=0,
        num_running=1,  # given up, but its thread still computes: it holds its slot
    )


async def test_requests_with_one_new_constraint_share_one_compile(
    byte_vocabulary: Vocabulary, gated: GatedCompile
) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary)
    results: list[CompiledConstraint] = []

    async def compile_one() -> None:
        results.append(await compiler_.compile(Choice(["yes", "no"])))

    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(compile_one)
        await gated.called(1)
        await anyio.wait_all_tasks_blocked()  # the other two wait for that one
        gated.gate.set()
    assert len(gated.calls) == 1
    assert results[0] is results[1] is results[2]
    assert compiler_.statistics().num_hits == 2


async def test_cancelling_a_compile_caches_nothing(
    byte_vocabulary: Vocabulary, gated: GatedCompile
) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary)
    async with anyio.create_task_group() as group:
        group.start_soon(compiler_.compile, Regex("ab"))
        await gated.called(1)  # its compile runs in a worker thread
        group.cancel_scope.cancel()
    assert compiler_.statistics().num_cached == 0
    gated.gate.set()  # the abandoned thread ends; its result is dropped
    compiled = await compiler_.compile(Regex("ab"))
    assert compiled.constraint == Regex("ab")
    assert gated.calls == [Regex("ab"), Regex("ab")]


async def test_a_cancelled_compile_lets_a_waiter_compile_it(
    byte_vocabulary: Vocabulary, gated: GatedCompile
) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary)
    got: list[CompiledConstraint] = []

    async def first() -> None:
        await compiler_.compile(Regex("ab"))

    async def second() -> None:
        got.append(await compiler_.compile(Regex("ab")))

    async with anyio.create_task_group() as group:
        async with anyio.create_task_group() as inner:
            inner.start_soon(first)
            await gated.called(1)  # first compiles, in its thread
            group.start_soon(second)
            await anyio.wait_all_tasks_blocked()  # second waits for first
            inner.cancel_scope.cancel()
        await gated.called(2)  # second compiles now, in a thread of its own
        assert gated.calls == [Regex("ab"), Regex("ab")]
        gated.gate.set()
    assert len(got) == 1
    assert compiler_.statistics().num_compiled == 1


async def test_at_most_max_concurrent_compiles_run(
    byte_vocabulary: Vocabulary, gated: GatedCompile
) -> None:
    # No thread of its own for small constraints: these two are small.
    compiler_ = GrammarCompiler(byte_vocabulary, CompilerConfig(max_concurrent=1, small_size=0))
    async with anyio.create_task_group() as group:
        group.start_soon(compiler_.compile, Regex("a"))
        group.start_soon(compiler_.compile, Regex("b"))
        await gated.called(1)
        await anyio.wait_all_tasks_blocked()
        assert len(gated.calls) == 1  # the other waits for the limiter
        gated.gate.set()
    assert len(gated.calls) == 2
    assert compiler_.statistics().num_compiled == 2


async def test_a_compile_given_up_keeps_its_thread_until_it_ends(
    byte_vocabulary: Vocabulary, gated: GatedCompile
) -> None:
    """A timed-out compile went on in its thread while its slot let another start: the
    CPU of every abandoned compile at once (19.6 CPU-seconds in a 10 s idle window)."""
    config = CompilerConfig(timeout=0.05, max_concurrent=1, small_size=0)
    compiler_ = GrammarCompiler(byte_vocabulary, config)
    with pytest.raises(ConstraintRejected, match=r"did not compile within 0\.05 s"):
        await compiler_.compile(Regex("a+"))
    async with anyio.create_task_group() as group:
        group.start_soon(compiler_.compile, Regex("b+"))
        await anyio.wait_all_tasks_blocked()
        stats = compiler_.statistics()
        assert (stats.num_running, stats.num_queued) == (1, 1)  # the given-up one runs
        assert gated.calls == [Regex("a+")]
        gated.gate.set()  # the abandoned compile ends; then the queued one runs
    assert gated.calls == [Regex("a+"), Regex("b+")]
    stats = compiler_.statistics()
    assert (stats.num_running, stats.num_queued, stats.num_compiled) == (0, 0, 1)


async def test_small_constraints_never_wait_behind_large_ones(
    byte_vocabulary: Vocabulary, gated: GatedCompile
) -> None:
    """A small schema waited 9.1 s behind a flood of slow ones in the shared 2-slot queue."""
    large = [Choice(["x" * 4_096, "y" * 4_096, str(i)]) for i in range(3)]
    gated.gated = set(large)
    gated.bound = 10.0  # before the fix the small one waited for this
    compiler_ = GrammarCompiler(byte_vocabulary, CompilerConfig(max_concurrent=1))
    async with anyio.create_task_group() as group:
        for constraint in large:
            group.start_soon(compiler_.compile, constraint)
        await gated.called(1)  # one large compile holds the only general thread
        small = await compiler_.compile(JsonSchema(SCHEMA))  # on the small constraints' thread
        assert small.matcher().allowed_token_ids() == {ord("{")}
        assert len(gated.calls) == 2  # one large (trio starts tasks in any order), the small
        assert gated.calls[0] in large
        assert gated.calls[1] == JsonSchema(SCHEMA)
        assert compiler_.statistics().num_queued == 2
        gated.gate.set()
    assert compiler_.statistics().num_compiled == 4


async def test_the_queue_takes_the_smallest_constraint_first(
    byte_vocabulary: Vocabulary, gated: GatedCompile
) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary, CompilerConfig(max_concurrent=1, small_size=0))
    first, large, medium, small = Regex("x"), Regex("a{1,30}"), Regex("a{1,3}"), Regex("ab")
    async with anyio.create_task_group() as group:
        group.start_soon(compiler_.compile, first)
        await gated.called(1)
        for constraint in (large, medium, small):  # queued in this order
            group.start_soon(compiler_.compile, constraint)
            await anyio.wait_all_tasks_blocked()
        gated.gate.set()
    assert gated.calls == [first, small, medium, large]


async def test_a_queued_compile_given_up_is_never_run(
    byte_vocabulary: Vocabulary, gated: GatedCompile
) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary, CompilerConfig(max_concurrent=1, small_size=0))
    async with anyio.create_task_group() as group:
        group.start_soon(compiler_.compile, Regex("a"))
        await gated.called(1)
        async with anyio.create_task_group() as queued:
            queued.start_soon(compiler_.compile, Regex("b"))
            await anyio.wait_all_tasks_blocked()
            assert compiler_.statistics().num_queued == 1
            queued.cancel_scope.cancel()
        assert compiler_.statistics().num_queued == 0
        gated.gate.set()
    assert gated.calls == [Regex("a")]


async def test_compile_is_a_checkpoint_even_from_the_cache(byte_vocabulary: Vocabulary) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary)
    await compiler_.compile(Regex("a"))
    reached = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await compiler_.compile(Regex("a"))
        reached = True
    assert not reached
    assert compiler_.statistics().num_hits == 0


def test_compile_now_compiles_in_the_calling_thread(byte_vocabulary: Vocabulary) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary)
    compiled = compiler_.compile_now(Regex("a|b"))
    assert compiler_.compile_now(Regex("b|a")) is not compiled  # another pattern text
    assert compiler_.compile_now(Regex("a|b")) is compiled
    with pytest.raises(ConstraintRejected, match=r"^constraint.pattern: invalid regex"):
        compiler_.compile_now(Regex("a("))
    assert compiler_.bitmask_words == 9


CONFIG_ERRORS = [
    ({"timeout": 0}, ValueError, "timeout must be > 0, got 0"),
    ({"timeout": float("inf")}, ValueError, "timeout must be finite, got inf"),
    ({"max_cached": 0}, ValueError, "max_cached must be >= 1, got 0"),
    ({"max_concurrent": 0}, ValueError, "max_concurrent must be >= 1, got 0"),
    ({"max_grammar_size": 1.5}, TypeError, "max_grammar_size must be an int, got float 1.5"),
    ({"lexer_fuel": 0}, ValueError, "lexer_fuel must be >= 1, got 0"),
    ({"step_lexer_fuel": -1}, ValueError, "step_lexer_fuel must be >= 1, got -1"),
    ({"max_cached_bytes": 0}, ValueError, "max_cached_bytes must be >= 1, got 0"),
    ({"small_size": -1}, ValueError, "small_size must be >= 0, got -1"),
    ({"max_items_in_row": 0}, ValueError, "max_items_in_row must be >= 1, got 0"),
    ({"step_max_items": 0}, ValueError, "step_max_items must be >= 1, got 0"),
]


@pytest.mark.parametrize(("options", "error", "message"), CONFIG_ERRORS)
def test_compiler_config_is_validated(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        CompilerConfig(**options)


def test_compiler_config_gives_llguidance_its_limits() -> None:
    config = CompilerConfig(
        max_grammar_size=10,
        lexer_fuel=20,
        step_lexer_fuel=30,
        max_items_in_row=40,
        step_max_items=50,
    )
    limits = config.limits()
    assert isinstance(limits, llguidance.LLParserLimits)
    assert (
        limits.max_grammar_size,
        limits.initial_lexer_fuel,
        limits.step_lexer_fuel,
        limits.max_items_in_row,
        limits.step_max_items,
    ) == (10, 20, 30, 40, 50)
    defaults = CompilerConfig()
    assert (defaults.max_cached, defaults.max_cached_bytes, defaults.max_concurrent) == (
        256,
        256 << 20,
        2,
    )
    assert (defaults.small_size, defaults.max_items_in_row, defaults.step_max_items) == (
        8_192,
        2_000,
        50_000,
    )


#: A 401-digit bound: llguidance's JSON reader raises ValueError ("number out of range").
HUGE_MINIMUM = JsonSchema({"type": "integer", "minimum": int("9" * 401)})


async def test_a_backend_exception_is_the_constraints_refusal_not_the_callers(
    byte_vocabulary: Vocabulary,
) -> None:
    compiler_ = GrammarCompiler(byte_vocabulary)
    message = "constraint.schema: number out of range at line 1 column 429"
    for _ in range(2):  # cached like any refusal
        with pytest.raises(ConstraintRejected, match=f"^{re.escape(message)}$"):
            await compiler_.compile(HUGE_MINIMUM)
    assert compiler_.statistics().num_rejected == 1


async def test_any_exception_while_compiling_is_a_refusal(
    byte_vocabulary: Vocabulary, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(constraint: Constraint) -> str:
        raise RuntimeError("the backend broke\nsecond line")

    monkeypatch.setattr(compiler, "grammar_of", broken)
    with pytest.raises(
        ConstraintRejected, match=r"^constraint.choices: RuntimeError: the backend broke$"
    ):
        await GrammarCompiler(byte_vocabulary).compile(Choice(["a"]))


#: The deepest constraints the limits allow, compiled in a child process (a stack overflow
#: there is a SIGSEGV that no except catches) by the compiler's own threads.
DEEPEST = """
import sys
from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.structured import GrammarCompiler, Vocabulary
from twostroke.states.constraints import Grammar, JsonSchema
from twostroke.states.errors import ConstraintRejected

def items(inner, depth):
    for _ in range(depth):
        inner = {"items": inner}
    return inner

defs = {str(i): items({"$ref": f"#/$defs/{i + 1}"}, 44) for i in range(255)}
defs["255"] = {"type": "integer"}
chain = {str(i): {"anyOf": [{"$ref": f"#/$defs/{i + 1}"}, {"type": "null"}]} for i in range(1022)}
chain["1022"] = {"type": "integer"}
rules = "".join(f"r{i}: " + "(" * 25 + f"r{i + 1}" + ")" * 25 + "\\n" for i in range(1022))
deepest = [
    JsonSchema({"$defs": defs, "$ref": "#/$defs/0"}),
    JsonSchema({"$defs": chain, "$ref": "#/$defs/0"}),
    Grammar(f"start: r0\\n{rules}r1022: \\"a\\""),
]
compiler = GrammarCompiler(Vocabulary.from_tokenizer(ByteTokenizer()))
for constraint in deepest:
    try:
        compiler.compile_now(constraint)
    except ConstraintRejected as refusal:  # a refusal is fine: not a crash
        print(refusal, file=sys.stderr)
print("survived")
"""


def test_the_deepest_constraints_the_limits_allow_compile_without_overflowing() -> None:
    """A chain of 3,500 $refs, or of 4,000 grammar rules, killed the process (SIGSEGV)."""
    done = subprocess.run(
        [sys.executable, "-c", DEEPEST], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout == "survived\n"
