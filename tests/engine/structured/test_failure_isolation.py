"""One constrained request's failure is its own: the engine and the requests beside it go on.

A failure is injected into one request's constraint where the engine meets it (compiling it,
making its matcher, filling its masks, advancing its matcher), with drafts at depth 2 so the
masks of drafted positions are filled too. That request fails with a typed error; every
other request of the same engine gives the output it gives without it; the engine keeps
serving. An exception of the engine's that had escaped there killed it (issue 48: a matcher
handed to llguidance twice, ``RuntimeError: Already borrowed``, answered every request after
with 503).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from twostroke.engine import ConstraintRejected, Engine, RequestFailed, SamplingParams
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.engine.structured import CompiledConstraint, GuidanceMatcher
from twostroke.engine.structured import compiler as compiler_module
from twostroke.engine.structured.constraining import Constraining
from twostroke.gpu.fake import FakeDevice
from twostroke.states.constraints import Choice, Constraint

from .test_drafted_masks import CONSTRAINTS, SPEC, chooser, drafting

pytestmark = pytest.mark.anyio

#: The constraint whose engine-side work fails.
POISONED = Choice(["poisoned", "toxic"])
#: The requests beside it (prompt and constraint): every other kind of constraint, and none.
BESIDE: list[tuple[str, Constraint | None]] = [
    (f"request {index}", constraint)
    for index, constraint in enumerate([*CONSTRAINTS.values(), None])
]


class Poisoned(GuidanceMatcher):
    """An llguidance matcher that raises ``RuntimeError`` at one ``place``: ``"num_tokens"``
    (saying how many tokens it took, which the engine asks as it attaches the matcher),
    ``"fill"`` (computing its masks, alone or with others), ``"advance"`` (taking a token,
    its own and its forks') or ``"terminated"`` (saying whether the output is over, once it
    has a token). Asked why it failed, it raises too: a backend that broke cannot say."""

    def __init__(self, real: GuidanceMatcher, place: str) -> None:
        super().__init__(real._matcher, real.vocab_size, real._eos, check=real._check_output)
        self._num_tokens = real.num_tokens
        self.place = place

    @property
    def num_tokens(self) -> int:
        if self.place == "num_tokens":
            raise RuntimeError("injected at num_tokens")
        return super().num_tokens

    def _check(self) -> None:
        if self.place == "fill":
            raise RuntimeError("injected at fill")
        super()._check()

    def advance(self, token_id: int) -> bool:
        if self.place == "advance":
            raise RuntimeError("injected at advance")
        return super().advance(token_id)

    @property
    def terminated(self) -> bool:
        if self.place == "terminated" and self.num_tokens:
            raise RuntimeError("injected at terminated")
        return super().terminated

    @property
    def failure(self) -> str | None:
        raise RuntimeError("injected at failure")

    def fork(self) -> GuidanceMatcher:
        return Poisoned(super().fork(), self.place)


def inject(patch: pytest.MonkeyPatch, place: str) -> None:
    """Make the engine's work on :data:`POISONED` raise at ``place``."""
    if place == "compile":
        real_compile = compiler_module._compile

        def compile_(constraint: Constraint, *args: Any) -> Any:
            if constraint == POISONED:
                raise RuntimeError("injected at compile")
            return real_compile(constraint, *args)

        patch.setattr(compiler_module, "_compile", compile_)
        return
    real_matcher = CompiledConstraint.matcher

    def matcher(self: CompiledConstraint) -> GuidanceMatcher:
        made = real_matcher(self)
        if self.constraint != POISONED:
            return made
        if place == "matcher":
            raise RuntimeError("injected at matcher")
        return Poisoned(made, place)

    patch.setattr(CompiledConstraint, "matcher", matcher)


async def serve_all(requests: Sequence[tuple[str, Constraint | None]]) -> list[Any]:
    """Every request at once on one engine (drafting, depth 2): each one's output or error,
    then the text of a constrained request after them on the same engine."""
    results: list[Any] = [None] * len(requests)
    async with Engine.open(
        runner=ToyRunner(choose=chooser(5)), tokenizer=ByteTokenizer(), device=FakeDevice(),
        num_blocks=64, block_size=4, pipeline_depth=2, speculative_config=SPEC,
    ) as engine:  # fmt: skip

        async def one(index: int, prompt: str, constraint: Constraint | None) -> None:
            params = SamplingParams(max_tokens=24, constraint=constraint)
            try:
                output = await engine.generate(prompt, params)
            except (RequestFailed, ConstraintRejected) as exc:
                results[index] = exc
            else:
                results[index] = (output.text, output.token_ids, output.finish_reason)

        async with anyio.create_task_group() as group:
            for index, (prompt, constraint) in enumerate(requests):
                group.start_soon(one, index, prompt, constraint)
        await engine.wait_idle()
        engine.check_health()
        engine.check_invariants()
        stats = engine.statistics()
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.num_spec_decode_drafts > 0
        after = await engine.generate("after", SamplingParams(constraint=Choice(["after"])))
        results.append(after.text)
    return results


@pytest.mark.parametrize(
    ("place", "error", "message"),
    [
        ("compile", ConstraintRejected, "constraint.choices: RuntimeError: injected at compile"),
        ("matcher", ConstraintRejected, "constraint.choices: RuntimeError: injected at matcher"),
        (
            "num_tokens",
            ConstraintRejected,
            "constraint.choices: RuntimeError: injected at num_tokens",
        ),
        ("fill", RequestFailed, "the constraint failed: injected at fill"),
        ("advance", RequestFailed, "the constraint failed: injected at advance"),
        ("terminated", RequestFailed, "the constraint failed: injected at terminated"),
    ],
)
async def test_a_constraint_that_raises_fails_its_own_request_alone(
    place: str, error: type[Exception], message: str
) -> None:
    with drafting(1, [2, 3]):
        alone = await serve_all(BESIDE)
        with pytest.MonkeyPatch.context() as patch:
            inject(patch, place)
            # The poisoned request in the middle: planned in the same steps as the others.
            middle = len(BESIDE) // 2
            poisoned = ("poisoned", POISONED)
            together = await serve_all([*BESIDE[:middle], poisoned, *BESIDE[middle:]])
    failed = together.pop(middle)
    assert isinstance(failed, error), failed
    assert message in str(failed)
    assert all(isinstance(result, tuple) for result in alone[:-1]), alone
    assert together == alone  # the constrained request after them too


async def test_filling_a_steps_masks_that_raises_fails_that_steps_constrained_requests_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What fills all of a step's rows raises (not one matcher: the engine's own bug): the
    constrained requests of that step fail, the plain one beside them finishes, and the
    engine serves constrained requests after."""
    real_fill = Constraining._fill
    calls: list[int] = []

    def fill(self: Constraining, *args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected into the step's fill")
        return real_fill(self, *args)

    monkeypatch.setattr(Constraining, "_fill", fill)
    async with Engine.open(
        runner=ToyRunner(choose=chooser(5)), tokenizer=ByteTokenizer(), device=FakeDevice(),
        num_blocks=64, block_size=4, pipeline_depth=2,
    ) as engine:  # fmt: skip
        plain = engine.submit("plain", SamplingParams(max_tokens=8, ignore_eos=True))
        constrained = engine.submit("c", SamplingParams(max_tokens=8, constraint=POISONED))
        with pytest.raises(RequestFailed, match=r"the constraint failed: injected into the step"):
            await constrained.result()
        assert len((await plain.result()).token_ids) == 8
        engine.check_health()
        again = await engine.generate("c", SamplingParams(max_tokens=8, constraint=POISONED))
        assert again.text in {"poisoned", "toxic"}
        await engine.wait_idle()
        engine.check_invariants()
