"""A simulated device and a reference model, to check the scheduler without a model.

:class:`SimulatedKV` executes step plans the way a real runner does, against a paged "KV
cache" that stores token ids instead of tensors. Every position a step computes is written
into the request's blocks, and every sampled token is a pure function of the ids *read back
through the block table*. So a scheduler bug that loses a position, hands one block to two
live requests, or feeds a wrong pending input changes the output, and
:func:`reference_output` (the same function, iterated without any scheduler) exposes it.
A request may read positions that another request wrote (a prefix cache hit): a wrong hit
reads other tokens, and so changes the output too. With a sliding ``window`` the "model"
sees only the last ``window`` tokens before each sample, as a model whose every layer attends
within that window: a block given back while a position in the window still needs it is read
as whatever was written there since, which changes the output.

A constrained request's token is chosen among the tokens its mask allows (:data:`ChooseToken`,
by default :func:`toy_choose`), still a pure function of the sequence, so the reference can
follow the same constraint without a scheduler.

This module is pure and synchronous, like the rest of :mod:`twostroke.states`; the
hypothesis tools built on it live in :mod:`twostroke.states.testing`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from twostroke.states.constraints import Matcher
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, StepPlan, verify_draft

__all__ = [
    "ChooseToken",
    "NextToken",
    "SimulatedKV",
    "SimulationError",
    "reference_output",
    "toy_choose",
    "toy_next_token",
]

#: A "model": maps a whole token sequence to the id of the next token.
NextToken = Callable[[Sequence[int]], int]
#: A constrained "model": maps a sequence and the ids its mask allows to the next id.
ChooseToken = Callable[[Sequence[int], frozenset[int]], int]


def toy_next_token(token_ids: Sequence[int], vocab_size: int = 64) -> int:
    """A deterministic "model": the next id is a hash of the whole sequence.

    Every earlier token influences the result, so a lost or corrupted position changes it.

    Args:
        token_ids: The sequence so far (prompt, then output).
        vocab_size: Ids are drawn from ``range(vocab_size)``.

    Returns:
        The next token id.
    """
    value = len(token_ids)
    for token_id in token_ids:
        value = (value * 1_000_003 + token_id + 1) % 2_147_483_647
    return value % vocab_size


def toy_choose(token_ids: Sequence[int], allowed: frozenset[int]) -> int:
    """A deterministic constrained "model": one of the allowed ids, by a hash of the sequence.

    Args:
        token_ids: The sequence so far.
        allowed: The ids the mask allows; with none (a dead end), the unconstrained
            :func:`toy_next_token`, which the constraint then refuses.

    Returns:
        The next token id.
    """
    if not allowed:
        return toy_next_token(token_ids)
    ordered = sorted(allowed)
    return ordered[toy_next_token(token_ids, vocab_size=1_000_003) % len(ordered)]


class SimulationError(AssertionError):
    """The scheduler did something a real device or a real caller would get wrong.

    It subclasses ``AssertionError`` so that test frameworks (and hypothesis' shrinking)
    treat it as a failed check.
    """


class SimulatedKV:
    """A fake device with a paged cache of token ids.

    Args:
        num_blocks: Blocks in the cache (the scheduler's pool size).
        block_size: Positions per block.
        next_token: The "model": maps a whole sequence to the next token id.
        choose: The constrained "model", for rows with a mask.
        window: Each sample sees only the last ``window`` positions (``None``: all), and
            only they are read back.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        next_token: NextToken = toy_next_token,
        choose: ChooseToken = toy_choose,
        *,
        window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.window = window
        self.next_token = next_token
        self.choose = choose
        # Each slot holds (writer request id, token id), or None before it is written.
        self._slots: list[list[tuple[int, int] | None]] = [
            [None] * block_size for _ in range(num_blocks)
        ]
        self._previous: dict[int, int] = {}
        # What each request itself wrote at each position, to catch a block overwritten
        # under it; positions it did not write are prefix hits, read as stored.
        self._written: dict[int, dict[int, int]] = {}
        self.num_steps = 0

    def execute(
        self,
        plan: StepPlan,
        allowed: Mapping[int, frozenset[int] | Sequence[frozenset[int]]] | None = None,
    ) -> RunnerOutput:
        """Run one step: write every computed position, then sample from what is stored.

        Steps must be executed in plan order, as a device stream would.

        Args:
            plan: The step to run.
            allowed: For constrained requests, the ids their masks allow in this step: one
                set, or one per position a row with drafts samples at.

        Returns:
            The token sampled for every request of the plan that samples.

        Raises:
            SimulationError: a pending input with no sample from the previous step, a block
                table too short, or a read of a position that this request never wrote.
        """
        sampled: dict[int, int] = {}
        for request_id in plan.finished_request_ids:
            self._written.pop(request_id, None)
        # Who writes each slot in this very step: another request of the same step must not
        # read it (a batch computes its KV together; only a later step sees it written).
        fresh: dict[tuple[int, int], int] = {}
        for entry in plan.requests:
            inputs = list(entry.token_ids)
            if entry.pending_input:
                if entry.request_id not in self._previous:
                    raise SimulationError(
                        f"step {plan.step_id}: request {entry.request_id} has a pending "
                        "input but the previous step sampled nothing for it"
                    )
                inputs.append(self._previous[entry.request_id])
            inputs.extend(entry.draft_token_ids)
            written = self._written.setdefault(entry.request_id, {})
            for offset, token_id in enumerate(inputs):
                block, slot = self._locate(entry.block_table, entry.start + offset, plan)
                self._slots[block][slot] = (entry.request_id, token_id)
                fresh[block, slot] = entry.request_id
                written[entry.start + offset] = token_id
        speculated: dict[int, tuple[int, ...]] = {}
        for entry in plan.requests:
            if not entry.sample:
                continue
            drafts = entry.draft_token_ids
            # The positions the first sample sees and after: the window of each.
            low = 0 if self.window is None else max(entry.end - len(drafts) - self.window, 0)
            context = {
                position: self._read(entry.request_id, entry.block_table, position, plan, fresh)
                for position in range(low, entry.end)
            }
            masks = None if allowed is None else allowed.get(entry.request_id)
            sets = (masks,) if isinstance(masks, frozenset) else masks
            # One token after each of the last 1 + len(drafts) positions, as a step without
            # drafts would sample it; the drafts hold while each equals the token before it.
            seen = [
                [context[p] for p in self._seen(entry.end - len(drafts) + offset)]
                for offset in range(len(drafts) + 1)
            ]
            tokens = [
                self.next_token(seen[offset])
                if sets is None
                else self.choose(seen[offset], sets[offset])
                for offset in range(len(drafts) + 1)
            ]
            kept = tokens[: verify_draft(drafts, tokens) + 1]
            sampled[entry.request_id] = kept[0]
            if drafts:
                speculated[entry.request_id] = tuple(kept[1:])
        self._previous = {
            request_id: token_id
            for request_id, token_id in sampled.items()
            if request_id not in speculated  # no row follows one with drafts on its sample
        }
        self.num_steps += 1
        return RunnerOutput(step_id=plan.step_id, sampled=sampled, speculated=speculated)

    def _seen(self, end: int) -> range:
        """The positions a sample after the first ``end`` sees."""
        return range(0 if self.window is None else max(end - self.window, 0), end)

    def _locate(self, block_table: Sequence[int], position: int, plan: StepPlan) -> tuple[int, int]:
        index, slot = divmod(position, self.block_size)
        if index >= len(block_table):
            raise SimulationError(
                f"step {plan.step_id}: position {position} lies past the block table "
                f"({len(block_table)} blocks of {self.block_size})"
            )
        return block_table[index], slot

    def _read(
        self,
        request_id: int,
        block_table: Sequence[int],
        position: int,
        plan: StepPlan,
        fresh: Mapping[tuple[int, int], int],
    ) -> int:
        block, slot = self._locate(block_table, position, plan)
        if fresh.get((block, slot), request_id) != request_id:
            raise SimulationError(
                f"step {plan.step_id}: request {request_id} reads position {position} "
                f"(block {block}, slot {slot}), which request {fresh[block, slot]} writes in "
                "the same step"
            )
        stored = self._slots[block][slot]
        own = self._written[request_id].get(position)  # every reader of a step wrote in it
        if stored is None or (own is not None and stored[1] != own):
            writer = "nobody" if stored is None else f"request {stored[0]} ({stored[1]})"
            raise SimulationError(
                f"step {plan.step_id}: request {request_id} reads position {position} "
                f"(block {block}, slot {slot}) last written by {writer}"
            )
        return stored[1]

    def poison(self, plan: StepPlan) -> None:
        """Erase every position ``plan`` wrote: the step failed, its KV is garbage.

        A later step that reads one of them (a prefix hit on a block the failed step wrote)
        raises :class:`SimulationError`.
        """
        for entry in plan.requests:
            for position in range(entry.start, entry.end):
                block, slot = self._locate(entry.block_table, position, plan)
                self._slots[block][slot] = None
            for position in range(entry.start, entry.end):
                self._written.get(entry.request_id, {}).pop(position, None)


def reference_output(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    eos_token_ids: frozenset[int] = frozenset(),
    next_token: NextToken = toy_next_token,
    matcher: Matcher | None = None,
    choose: ChooseToken = toy_choose,
    window: int | None = None,
) -> tuple[list[int], str]:
    """What a request must produce, computed without any scheduler.

    Args:
        prompt_token_ids: The prompt.
        params: Its sampling parameters (``max_tokens``, ``min_tokens``, stop ids, EOS).
        eos_token_ids: The model's end-of-sequence ids.
        next_token: The "model" the simulated device uses.
        matcher: A fresh matcher of the request's constraint, for a constrained request
            (it is advanced here): each token is chosen among the ones it allows.
        choose: The constrained "model" the simulated device uses.
        window: The simulated device's sliding window: each token is chosen from the last
            ``window`` tokens before it (``None``: all of them).

    Returns:
        The output ids and the finish reason: ``"stop"`` or ``"length"``, or ``"failed"``
        where the constraint reached a dead end (the output holds the tokens before it).

    Raises:
        ValueError: ``params.max_tokens`` is ``None``: this reference knows no context.
    """
    most = params.max_tokens
    if most is None:
        raise ValueError("reference_output needs params.max_tokens as a number, got None")
    tokens = list(prompt_token_ids)
    output: list[int] = []
    while True:
        seen = tokens if window is None else tokens[-window:]
        if matcher is not None:
            token_id = choose(seen, matcher.allowed_token_ids())
            if not matcher.advance(token_id) or (matcher.terminated and not matcher.accepting):
                return output, "failed"
            if matcher.terminated:
                return [*output, token_id], "stop"
        else:
            token_id = next_token(seen)
        stop = len(output) >= params.min_tokens and (
            token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in eos_token_ids)
        )
        tokens.append(token_id)
        output.append(token_id)
        if stop:
            return output, "stop"
        if len(output) >= most:
            return output, "length"
