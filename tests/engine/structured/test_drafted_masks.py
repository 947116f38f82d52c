"""Drafts of constrained requests: the masks of the positions after a draft the constraint
refuses at its first token, for every kind of constraint, at pipeline depth 2.

At depth 2 a request's token is in flight when its next step is planned, so the scheduler
cannot cut its drafts on the matcher (it is one token behind): the masks of the drafted
positions end the draft instead, and past a refused draft those positions take the mask
before it again. They took it from the request's own matcher, handed to llguidance twice in
one call: ``RuntimeError: Already borrowed`` killed the engine at the first such request.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twostroke.engine import Engine, SamplingParams
from twostroke.engine.runners.toy import EOS_TOKEN_ID, ByteTokenizer, ToyRunner
from twostroke.engine.structured.constraining import Constraining
from twostroke.engine.structured.masks import StepMasks
from twostroke.engine.tools.formats import HERMES, ToolSpec
from twostroke.engine.tools.grammar import tool_constraint
from twostroke.gpu.fake import FakeDevice
from twostroke.states import scheduler as scheduler_module
from twostroke.states.constraints import (
    AnyJsonObject,
    Choice,
    Constraint,
    Grammar,
    JsonSchema,
    Regex,
)
from twostroke.states.request import FinishReason
from twostroke.states.speculation import SpeculativeConfig, Speculator

pytestmark = pytest.mark.anyio

#: Every kind of constraint a request may carry; none of them ever takes a control byte.
CONSTRAINTS: dict[str, Constraint] = {
    "regex": Regex("(ab){2,6}c(ba){2,6}"),
    "choice": Choice(["yes", "no", "maybe so"]),
    "json_schema": JsonSchema(
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["n"],
            "additionalProperties": False,
        }
    ),
    "json_object": AnyJsonObject(),
    "grammar": Grammar('start: "x" ("y" | "z")+ "."'),
    "tool_call": tool_constraint(
        HERMES,
        [ToolSpec("get_time", parameters={"type": "object", "properties": {"z": {"enum": [1]}}})],
        "required",
    ),
}
#: Tokens no constraint above allows anywhere (a draft starting with one is refused there),
#: and which the toy never picks where it may (so no draft of the plain request holds either).
NEVER = frozenset(range(1, 9))


def chooser(seed: int) -> Any:
    """Arbitrary logits: a seeded pick among the allowed ids but :data:`NEVER` (EOS and
    closers favoured, so that outputs end), a function of the tokens so far alone."""

    def choose(token_ids: Sequence[int], allowed: frozenset[int]) -> int:
        rng = random.Random(hash((seed, len(token_ids), tuple(token_ids[-4:]))))
        allowed -= NEVER
        if not allowed:
            return 0
        if EOS_TOKEN_ID in allowed and rng.random() < 0.5:
            return EOS_TOKEN_ID
        closers = sorted(allowed & set(b'"}].'))
        if closers and rng.random() < 0.4:
            return rng.choice(closers)
        return rng.choice(sorted(allowed))

    return choose


@contextmanager
def drafting(first: int, tail: Sequence[int]) -> Iterator[list[str]]:
    """Every engine opened inside drafts ``first`` then ``tail`` for every request, each step
    (prompt lookup's limits and counters, its proposals replaced).

    Yields where each mask row that allows nothing is named: every position a live
    constrained request samples at, drafted ones included, must allow something, since a
    real sampler has nothing to pick from a row of ``-inf`` (the toy picks token 0 there).
    """

    def propose(request_id: int, token_ids: Sequence[int], wanted: int) -> list[int]:
        # With a token in flight the proposal's first stands for it and the draft starts
        # after; without, at the first: either way the draft starts with ``first``.
        return [first, first, *tail][:wanted]

    def speculator(config: SpeculativeConfig) -> Speculator:
        return Speculator(config, propose=propose)

    empty: list[str] = []
    real_fill = Constraining._fill

    def fill(self: Constraining, rows: list[Any], masks: StepMasks) -> Any:
        failures = real_fill(self, rows, masks)
        failed = {request.request_id for request, _ in failures}
        for request, start, drafts in rows:
            for row in range(start, start + 1 + len(drafts)):
                if request.request_id not in failed and not masks.bitmask[row].any():
                    empty.append(f"step {masks.step_id} row {row}: {request!r}, drafts {drafts}")
        return failures

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler_module, "Speculator", speculator)
        patch.setattr(Constraining, "_fill", fill)
        yield empty


SPEC = {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False}


async def run(
    kinds: Sequence[str], seed: int, spec: dict[str, Any] | None
) -> tuple[list[tuple[str, tuple[int, ...], FinishReason | None]], Any]:
    """The outputs of one request of each kind and a plain one beside them, all at once."""
    runner = ToyRunner(choose=chooser(seed))
    async with Engine.open(
        runner=runner, tokenizer=ByteTokenizer(), device=FakeDevice(), num_blocks=64,
        block_size=4, pipeline_depth=2, speculative_config=spec,
    ) as engine:  # fmt: skip
        outputs: list[Any] = [None] * (len(kinds) + 1)

        async def one(index: int, constraint: Constraint | None) -> None:
            params = SamplingParams(max_tokens=24, constraint=constraint)
            output = await engine.generate(f"request {index}", params)
            outputs[index] = (output.text, output.token_ids, output.finish_reason)

        async with anyio.create_task_group() as group:
            for index, kind in enumerate(kinds):
                group.start_soon(one, index, CONSTRAINTS[kind])
            group.start_soon(one, len(kinds), None)
        await engine.wait_idle()
        engine.check_health()
        engine.check_invariants()
        stats = engine.statistics()
        assert stats.num_free_blocks == stats.num_blocks
    return outputs, stats


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(sorted(CONSTRAINTS)), min_size=1, max_size=4),
    first=st.sampled_from(sorted(NEVER)),
    tail=st.lists(st.integers(0, EOS_TOKEN_ID), max_size=7),
    seed=st.integers(0, 2**16),
)
async def test_a_draft_refused_at_its_first_token_changes_no_output(
    kinds: list[str], first: int, tail: list[int], seed: int
) -> None:
    """Every request's output is the one without drafts, every draft was refused, and the
    engine lives on."""
    plain, _ = await run(kinds, seed, None)
    with drafting(first, tail) as empty:
        drafted, stats = await run(kinds, seed, SPEC)
    assert drafted == plain
    assert empty == []
    assert stats.num_spec_decode_drafts > 0
    assert stats.num_spec_decode_accepted_tokens == 0


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
async def test_every_kind_of_constraint_survives_a_refused_first_draft(kind: str) -> None:
    """The property's examples, one kind at a time (each kind is run whatever it draws)."""
    plain, _ = await run([kind], 7, None)
    with drafting(1, [2, 3]) as empty:
        drafted, stats = await run([kind], 7, SPEC)
    assert drafted == plain
    assert empty == []
    assert stats.num_spec_decode_drafts > 0


async def test_prompt_lookup_past_the_regex_of_the_issue_keeps_the_engine_alive() -> None:
    """Issue 48's request on the toy model, prompt lookup drafting 8: the drafts run past
    the ``c`` into the prompt's space, which the regex refuses; the engine died of it."""
    spec = {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False}
    async with Engine.open(
        model="toy", device="cpu", speculative_config=spec, pipeline_depth=2
    ) as engine:
        params = SamplingParams(max_tokens=40, constraint=Regex("(ab){2,6}c(ba){2,6}"))
        output = await engine.generate("ababababc babababa", params)
        engine.check_health()
        assert output.finish_reason is FinishReason.STOP
        assert re.fullmatch("(ab){2,6}c(ba){2,6}", output.text), output.text
        assert engine.statistics().num_spec_decode_drafts > 0
        again = await engine.generate("x", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(again.token_ids) == 3
