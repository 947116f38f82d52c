"""GrammarCompiler: off the loop, bounded in time, cached by value, one compile per constraint."""

from __future__ import annotations

import re
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

    def __call__(self, constraint: Constraint, *args: Any) -> Any:
        with self._called:
            self.calls.append(constraint)
            self._called.notify_all()
        self.gate.wait(timeout=60)  # a bound, not a sleep: the test opens the gate
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
    text = '{ "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"] }'
    again = await compiler_.compile(JsonSchema(text))
    assert again is first
    assert isinstance(first, CompiledConstraint)
    assert first.constraint == JsonSchema(SCHEMA)
    assert first.vocabulary is byte_vocabulary
    assert first.seconds > 0
    assert compiler_.statistics() == CompilerStatistics(
        num_hits=1, num_compiled=1, num_rejected=0, num_timed_out=0, num_cached=1
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
            await compiler_.compile(JsonSchema({"type": "object", "if": {}}))
        caught.append(error.value)
    assert caught[0] is not caught[1]
    for error in caught:
        assert str(error) == 'constraint.schema: Unimplemented keys: ["if"]'
        assert (error.field, error.reason) == ("constraint.schema", 'Unimplemented keys: ["if"]')
    assert compiler_.statistics() == CompilerStatistics(
        num_hits=1, num_compiled=0, num_rejected=1, num_timed_out=0, num_cached=1
    )


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
        JsonSchema({"type": "string", "pattern": "(?=x)"}),
        "constraint.schema: invalid regex: look-around, including look-ahead and look-behind, "
        "is not supported",
    ),
    (
        JsonSchema({"type": "string", "format": "colour"}),
        "constraint.schema: Unknown format: colour",
    ),
    (JsonSchema({"not": {"type": "string"}}), 'constraint.schema: Unimplemented keys: ["not"]'),
    (Grammar("start: foo"), 'constraint.grammar: at 1(8): unknown name: "foo"'),
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
        num_hits=2, num_compiled=4, num_rejected=0, num_timed_out=0, num_cached=2
    )
    assert repr(compiler_) == "<GrammarCompiler 257 tokens, 2/2 cached>"


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
    assert compiler_.statistics() == CompilerStatistics(
        num_hits=1, num_compiled=0, num_rejected=1, num_timed_out=1, num_cached=1
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
    compiler_ = GrammarCompiler(byte_vocabulary, CompilerConfig(max_concurrent=1))
    async with anyio.create_task_group() as group:
        group.start_soon(compiler_.compile, Regex("a"))
        group.start_soon(compiler_.compile, Regex("b"))
        await gated.called(1)
        await anyio.wait_all_tasks_blocked()
        assert len(gated.calls) == 1  # the other waits for the limiter
        gated.gate.set()
    assert len(gated.calls) == 2
    assert compiler_.statistics().num_compiled == 2


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
]


@pytest.mark.parametrize(("options", "error", "message"), CONFIG_ERRORS)
def test_compiler_config_is_validated(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        CompilerConfig(**options)


def test_compiler_config_gives_llguidance_its_limits() -> None:
    limits = CompilerConfig(max_grammar_size=10, lexer_fuel=20, step_lexer_fuel=30).limits()
    assert isinstance(limits, llguidance.LLParserLimits)
    assert (limits.max_grammar_size, limits.initial_lexer_fuel, limits.step_lexer_fuel) == (
        10,
        20,
        30,
    )
