"""Constrained requests through the whole engine, over the toy runner (arbitrary logits).

The property: whatever the toy's logits (a seeded random choice among the allowed tokens),
every output that finishes with ``stop`` parses and satisfies its constraint, at depth 1 and
2, with preemption (a tiny KV pool) and injected step failures.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Sequence

import anyio
import anyio.to_thread
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twostroke.engine import (
    ConstraintFailed,
    ConstraintRejected,
    Engine,
    EngineOverloaded,
    JsonSchema,
    RequestCancelled,
    RequestFailed,
    SamplingParams,
)
from twostroke.engine.runners.toy import EOS_TOKEN_ID, ByteTokenizer, ToyRunner
from twostroke.gpu.fake import FakeDevice
from twostroke.states.constraints import Choice, Constraint, Matcher, Regex
from twostroke.states.request import FinishReason
from twostroke.states.testing.strategies import choices, regexes

pytestmark = pytest.mark.anyio


def _schemas() -> st.SearchStrategy[dict[str, object]]:
    leaves = st.sampled_from(
        [
            {"type": "boolean"},
            {"type": "integer", "minimum": -5, "maximum": 120},
            {"enum": ["red", "green", 3]},
            {"type": "string", "maxLength": 4},
            {"type": "string", "pattern": "^[ab]{1,3}$"},
            {"type": "null"},
        ]
    )

    def objects(
        inner: st.SearchStrategy[dict[str, object]],
    ) -> st.SearchStrategy[dict[str, object]]:
        return st.one_of(
            st.dictionaries(st.sampled_from("xyz"), inner, min_size=1, max_size=3).map(
                lambda props: {
                    "type": "object",
                    "properties": props,
                    "required": sorted(props),
                    "additionalProperties": False,
                }
            ),
            inner.map(lambda item: {"type": "array", "items": item, "maxItems": 2}),
        )

    return st.recursive(leaves, objects, max_leaves=4)


def _chooser(seed: int) -> object:
    """Arbitrary logits: a seeded random pick among the allowed ids, EOS favoured."""

    def choose(token_ids: Sequence[int], allowed: frozenset[int]) -> int:
        rng = random.Random(hash((seed, len(token_ids), tuple(token_ids[-4:]))))
        if not allowed:
            return 0
        if EOS_TOKEN_ID in allowed and rng.random() < 0.5:
            return EOS_TOKEN_ID
        closers = sorted(allowed & set(b'"}]'))
        if closers and rng.random() < 0.4:
            return rng.choice(closers)
        return rng.choice(sorted(allowed))

    return choose


def _satisfies(constraint: Constraint, text: str) -> None:
    if isinstance(constraint, JsonSchema):
        jsonschema.validate(json.loads(text), constraint.parsed())
    elif isinstance(constraint, Regex):
        assert re.fullmatch(constraint.pattern, text, flags=re.DOTALL), (constraint, text)
    else:
        assert isinstance(constraint, Choice)
        assert text in constraint.choices, (constraint, text)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    constraints=st.lists(
        st.one_of(_schemas().map(JsonSchema), regexes(), choices()), min_size=1, max_size=4
    ),
    seed=st.integers(0, 2**16),
    depth=st.sampled_from([1, 2]),
    num_blocks=st.sampled_from([6, 64]),
    fail_step=st.none() | st.integers(0, 12),
)
async def test_every_output_that_stops_satisfies_its_constraint(
    constraints: list[Constraint], seed: int, depth: int, num_blocks: int, fail_step: int | None
) -> None:
    runner = ToyRunner(
        choose=_chooser(seed),  # type: ignore[arg-type]
        fail_when=lambda plan: plan.step_id == fail_step,
    )
    stopped: list[tuple[Constraint, str]] = []
    async with Engine.open(
        runner=runner, tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=num_blocks,
        block_size=4, pipeline_depth=depth,
    ) as engine:  # fmt: skip

        async def one(index: int, constraint: Constraint | None) -> None:
            params = SamplingParams(max_tokens=16, constraint=constraint)
            try:
                output = await engine.generate(f"request {index}", params)
            except (RequestFailed, ConstraintRejected):
                return
            if output.finish_reason is FinishReason.STOP and constraint is not None:
                stopped.append((constraint, output.text))

        async with anyio.create_task_group() as group:
            for index, constraint in enumerate(constraints):
                group.start_soon(one, index, constraint)
            group.start_soon(one, len(constraints), None)  # unconstrained beside them
        await engine.wait_idle()
        engine.check_invariants()
        assert engine.statistics().num_free_blocks == engine.statistics().num_blocks
    for constraint, text in stopped:
        _satisfies(constraint, text)
    STOPPED.append(len(stopped))


#: How many constrained outputs each example saw finish with stop (the property is not empty).
STOPPED: list[int] = []


def test_the_property_saw_outputs_that_stop() -> None:
    """Run after the property (same module, in order): some examples had outputs to check."""
    if STOPPED:
        assert sum(STOPPED) >= len(STOPPED), STOPPED


async def test_constrained_requests_overlap_on_the_cpu_device_at_depth_2() -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    async with Engine.open(
        runner=ToyRunner(), tokenizer=ByteTokenizer(), device="cpu", num_blocks=32,
        block_size=4, pipeline_depth=2,
    ) as engine:  # fmt: skip
        outputs = []
        async with anyio.create_task_group() as group:

            async def one(index: int) -> None:
                params = SamplingParams(max_tokens=24, constraint=JsonSchema(schema))
                outputs.append(await engine.generate(f"p{index}", params))

            for index in range(4):
                group.start_soon(one, index)
            group.start_soon(engine.generate, "plain", SamplingParams(max_tokens=8))
        stats = engine.statistics()
    for output in outputs:
        assert output.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(output.text), schema)
    # One mask per constrained token sampled (the grammar completes at the closing brace,
    # so no EOS is sampled after it); the plain request's tokens sample without one.
    assert stats.num_masked_rows == sum(len(output.token_ids) for output in outputs)
    assert stats.mask_fill_seconds > 0


async def test_a_readback_leaves_a_later_step_whose_masks_are_not_filled_alone() -> None:
    """On the CPU device the next step is launched (deferred: its masks not filled) on the
    device's thread while the step before is read back on the event loop's: reading back
    must not compute the later step, which would wait there for masks only that thread
    fills (it failed a request, "waiting would deadlock", in 4 runs of 4 on trio before the
    fix)."""
    async with Engine.open(model="toy", device="cpu", pipeline_depth=2) as engine:
        for index in range(16):
            params = SamplingParams(max_tokens=40, constraint=Regex("[a-z]{30}"))
            output = await engine.generate(f"request {index}", params)
            assert output.finish_reason is FinishReason.STOP


async def test_a_constraint_the_backend_refuses_ends_the_handle_with_constraint_rejected() -> None:
    async with Engine.open(
        runner=ToyRunner(), tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=16,
        block_size=4,
    ) as engine:  # fmt: skip
        with pytest.raises(ConstraintRejected) as refused:
            await engine.generate("x", SamplingParams(constraint=Regex("(?<=a)b")))
        assert refused.value.field == "constraint.pattern"
        output = await engine.generate("x", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(output.token_ids) == 3
        await engine.wait_idle()
        engine.check_invariants()


async def test_cancelling_a_request_while_its_constraint_compiles_drops_it() -> None:
    async with Engine.open(
        runner=ToyRunner(), tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=16,
        block_size=4,
    ) as engine:  # fmt: skip
        handle = engine.submit("x", SamplingParams(constraint=Choice(["yes", "no"])))
        handle.cancel()
        await engine.wait_idle()
        engine.check_invariants()
        assert engine.statistics().num_waiting == 0


async def test_a_constraint_whose_compile_raises_fails_only_its_own_request() -> None:
    """llguidance raises ValueError on a 401-digit bound; the engine died of it."""
    huge = JsonSchema({"type": "integer", "minimum": int("9" * 401)})
    async with Engine.open(
        runner=ToyRunner(), tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=16,
        block_size=4,
    ) as engine:  # fmt: skip
        with pytest.raises(ConstraintRejected, match=r"^constraint.schema: number out of range"):
            await engine.generate("x", SamplingParams(constraint=huge))
        engine.check_health()
        output = await engine.generate("x", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(output.token_ids) == 3
        await engine.wait_idle()
        engine.check_invariants()


async def test_a_request_whose_matcher_cannot_be_made_is_refused_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from twostroke.engine.structured import CompiledConstraint

    def broken(self: CompiledConstraint) -> object:
        raise MemoryError("no room for a matcher")

    monkeypatch.setattr(CompiledConstraint, "matcher", broken)
    async with Engine.open(
        runner=ToyRunner(), tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=16,
        block_size=4,
    ) as engine:  # fmt: skip
        message = "constraint.choices: MemoryError: no room for a matcher"
        with pytest.raises(ConstraintRejected, match=f"^{message}$"):
            await engine.generate("x", SamplingParams(constraint=Choice(["a", "b"])))
        output = await engine.generate("x", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(output.token_ids) == 3


async def test_requests_still_compiling_count_as_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """With max_waiting_requests=2 and 8 constrained requests compiling, none was refused."""
    from twostroke.engine.structured import compiler

    gate, real = threading.Event(), compiler._compile

    def gated(*args: object) -> object:
        gate.wait(timeout=60)  # a bound, not a sleep: the test opens it
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(compiler, "_compile", gated)
    async with Engine.open(
        runner=ToyRunner(), tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=16,
        block_size=4, max_waiting_requests=2,
    ) as engine:  # fmt: skip
        params = SamplingParams(max_tokens=4, constraint=Choice(["yes", "no"]))
        handles = [engine.submit("x", params), engine.submit("y", params)]
        assert engine.statistics().num_waiting == 2  # compiling, not queued yet
        message = (
            "the waiting queue is full: 2 requests wait for admission (2 of them compiling "
            "their constraint) and max_waiting_requests is 2; retry later"
        )
        for refused in (params, SamplingParams(max_tokens=4)):
            with pytest.raises(EngineOverloaded, match=f"^{re.escape(message)}$"):
                engine.submit("z", refused)
        gate.set()
        for handle in handles:
            assert (await handle.result()).text in {"yes", "no"}
        assert engine.statistics().num_waiting == 0


async def test_cancelling_a_request_drops_its_queued_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from twostroke.engine.structured import compiler

    gate, real, calls = threading.Event(), compiler._compile, []

    def gated(constraint: Constraint, *args: object) -> object:
        calls.append(constraint)
        gate.wait(timeout=60)  # a bound, not a sleep: the test opens it
        return real(constraint, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(compiler, "_compile", gated)
    async with Engine.open(
        runner=ToyRunner(), tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=16,
        block_size=4,
    ) as engine:  # fmt: skip
        # Two threads for any constraint and one for small ones: three compiles hold them.
        running = [
            engine.submit("x", SamplingParams(max_tokens=4, constraint=Choice([word])))
            for word in ("a", "b", "c")
        ]
        while len(calls) < 3:  # (trio starts the tasks in any order: these three first)
            await anyio.wait_all_tasks_blocked()
        queued = engine.submit("x", SamplingParams(max_tokens=4, constraint=Choice(["d"])))
        compiler_ = engine._constraining._compiler
        assert compiler_ is not None
        while compiler_.statistics().num_queued < 1:
            await anyio.wait_all_tasks_blocked()
        queued.cancel()
        with pytest.raises(RequestCancelled):
            await queued.result()
        await anyio.wait_all_tasks_blocked()
        assert compiler_.statistics().num_queued == 0
        assert engine.statistics().num_waiting == 3  # the three still compiling
        gate.set()
        for handle in running:
            await handle.result()
    assert Choice(["d"]) not in calls


#: 600 optional properties: the first mask is fine, the row after "{" has 2,407 Earley items.
WIDE = JsonSchema(
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
)
WIDE_REASON = (
    "the backend gave up at output token 1: a row of the parse reached 2407 Earley items, "
    "past max_items_in_row (2000)"
)


async def test_a_constraint_that_breaks_a_backend_limit_mid_output_fails_naming_the_rule() -> None:
    """It failed with a bare RequestFailed, which the server answered with a 500."""
    async with Engine.open(
        runner=ToyRunner(), tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=16,
        block_size=4,
    ) as engine:  # fmt: skip
        with pytest.raises(ConstraintFailed) as failed:
            await engine.generate("x", SamplingParams(max_tokens=8, constraint=WIDE))
        assert isinstance(failed.value, RequestFailed)
        assert (failed.value.field, failed.value.reason) == ("constraint.schema", WIDE_REASON)
        assert str(failed.value) == f"request 0 failed: constraint.schema: {WIDE_REASON}"
        output = await engine.generate("x", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(output.token_ids) == 3
        await engine.wait_idle()
        engine.check_invariants()


class LoopWatchedMatcher:
    """A matcher whose first mask waits until the event loop has run meanwhile: filled on
    the loop's own thread, it would wait for good (bounded here, then it fails)."""

    def __init__(self, inner: Matcher, filling: threading.Event, loop_ran: threading.Event) -> None:
        self._inner, self._filling, self._loop_ran = inner, filling, loop_ran

    @property
    def vocab_size(self) -> int:
        return self._inner.vocab_size

    @property
    def num_tokens(self) -> int:
        return self._inner.num_tokens

    @property
    def accepting(self) -> bool:
        return self._inner.accepting

    @property
    def terminated(self) -> bool:
        return self._inner.terminated

    def advance(self, token_id: int) -> bool:
        return self._inner.advance(token_id)

    def allowed_token_ids(self) -> frozenset[int]:
        return self._inner.allowed_token_ids()

    def fill_bitmask(self, row: memoryview) -> None:
        if not self._filling.is_set():
            self._filling.set()
            if not self._loop_ran.wait(timeout=10):  # a bound, not a sleep
                raise RuntimeError("the event loop did not run while the mask was filled")
        self._inner.fill_bitmask(row)

    def fork(self) -> Matcher:
        return self._inner.fork()


async def test_masks_are_filled_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows filled one at a time on the loop: a 60-row constrained request slowed a plain
    8-token completion beside it from 0.01 s to 2.2 s."""
    from twostroke.engine.structured import CompiledConstraint

    filling, loop_ran = threading.Event(), threading.Event()
    real = CompiledConstraint.matcher

    def watched(self: CompiledConstraint) -> Matcher:
        return LoopWatchedMatcher(real(self), filling, loop_ran)

    monkeypatch.setattr(CompiledConstraint, "matcher", watched)
    async with Engine.open(
        runner=ToyRunner(), tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=16,
        block_size=4,
    ) as engine:  # fmt: skip

        async def watch() -> None:
            await anyio.to_thread.run_sync(filling.wait)
            loop_ran.set()  # this task ran on the loop while the mask was filled

        async with anyio.create_task_group() as group:
            group.start_soon(watch)
            output = await engine.generate("x", SamplingParams(constraint=Choice(["yes", "no"])))
        assert output.text in {"yes", "no"}
