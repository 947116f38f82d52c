"""The simulated device and the reference model: what they catch, pinned one plan at a time.

The scheduler's property tests trust SimulatedKV to notice a wrong block table, a lost
position or a block overwritten under a request; these tests show that it does, with hand-made
plans, and that reference_output stops where the parameters say.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from twostroke.states.params import SamplingParams
from twostroke.states.plan import ScheduledRequest, StepPlan
from twostroke.states.simulation import (
    SimulatedKV,
    SimulationError,
    reference_output,
    toy_choose,
    toy_next_token,
)

PARAMS = SamplingParams(max_tokens=4)


def row(
    request_id: int,
    start: int,
    token_ids: Sequence[int],
    block_table: Sequence[int],
    *,
    sample: bool = True,
    pending_input: bool = False,
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id,
        start=start,
        token_ids=tuple(token_ids),
        pending_input=pending_input,
        sample=sample,
        sample_index=0,
        num_prompt_tokens=3,
        block_table=tuple(block_table),
        params=PARAMS,
    )


def plan(step_id: int, *rows: ScheduledRequest, finished: Sequence[int] = ()) -> StepPlan:
    return StepPlan(step_id=step_id, requests=rows, finished_request_ids=tuple(finished))


def test_a_step_samples_from_the_positions_read_back_through_the_block_table() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    first = kv.execute(plan(0, row(1, 0, [5, 6, 7], [2, 0])))
    token = toy_next_token([5, 6, 7])
    assert dict(first.sampled) == {1: token}
    # The next step feeds that token on the device (a pending input) and samples after it.
    second = kv.execute(plan(1, row(1, 3, [], [2, 0], pending_input=True)))
    assert dict(second.sampled) == {1: toy_next_token([5, 6, 7, token])}
    assert kv.num_steps == 2


def test_a_constrained_row_samples_from_its_allowed_ids_and_the_others_do_not() -> None:
    """Pinned here, not left to the property tests' draws: a row with a mask takes the
    constrained model's choice among the ids it allows, a row without one the plain model's."""
    kv = SimulatedKV(num_blocks=4, block_size=2)
    out = kv.execute(
        plan(0, row(1, 0, [5, 6, 7], [2, 0]), row(2, 0, [8, 9], [1])),
        allowed={1: frozenset({40, 41})},
    )
    assert dict(out.sampled) == {
        1: toy_choose([5, 6, 7], frozenset({40, 41})),
        2: toy_next_token([8, 9]),
    }
    assert out.sampled[1] in {40, 41}


def test_a_row_that_does_not_sample_writes_but_returns_nothing() -> None:
    kv = SimulatedKV(num_blocks=2, block_size=2)
    outcome = kv.execute(plan(0, row(1, 0, [5, 6], [0], sample=False)))
    assert dict(outcome.sampled) == {}
    # The chunk was written: the rest of the prompt samples from all of it.
    outcome = kv.execute(plan(1, row(1, 2, [7], [0, 1])))
    assert dict(outcome.sampled) == {1: toy_next_token([5, 6, 7])}


def test_a_position_past_the_block_table_is_refused() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    with pytest.raises(
        SimulationError, match=r"^step 3: position 2 lies past the block table \(1 blocks of 2\)$"
    ):
        kv.execute(plan(3, row(1, 0, [5, 6, 7], [0])))


def test_a_pending_input_needs_a_sample_of_the_step_before() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    kv.execute(plan(0, row(1, 0, [5, 6], [0], sample=False)))
    with pytest.raises(
        SimulationError,
        match=r"^step 1: request 1 has a pending input but the previous step sampled nothing",
    ):
        kv.execute(plan(1, row(1, 2, [], [0, 1], pending_input=True)))


def test_reading_a_position_nobody_wrote_is_refused() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    # Starts at position 2 as if positions 0 and 1 were computed, but nothing wrote them.
    with pytest.raises(
        SimulationError,
        match=r"^step 0: request 1 reads position 0 \(block 3, slot 0\) last written by nobody$",
    ):
        kv.execute(plan(0, row(1, 2, [7], [3, 1])))


def test_a_block_overwritten_under_a_request_is_caught() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    kv.execute(plan(0, row(1, 0, [5, 6], [0], sample=False)))
    # Another request is handed the same block and writes over request 1's positions.
    kv.execute(plan(1, row(2, 0, [8, 9], [0], sample=False)))
    with pytest.raises(
        SimulationError,
        match=r"^step 2: request 1 reads position 0 \(block 0, slot 0\) "
        r"last written by request 2 \(8\)$",
    ):
        kv.execute(plan(2, row(1, 2, [7], [0, 1])))


def test_a_prefix_hit_reads_what_another_request_wrote() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    kv.execute(plan(0, row(1, 0, [5, 6], [0], sample=False)))
    # Request 2 shares block 0 (a cache hit) and computes only its own last position.
    outcome = kv.execute(plan(1, row(2, 2, [7], [0, 1])))
    assert dict(outcome.sampled) == {2: toy_next_token([5, 6, 7])}


def test_a_position_another_request_writes_in_the_same_step_is_not_readable() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    kv.execute(plan(0, row(1, 0, [5, 6], [0], sample=False)))
    # Request 2 claims request 1's prompt block as a cache hit, but request 3 rewrites that
    # block in the same step: a batch computes its KV together, so 2 may not read it.
    with pytest.raises(
        SimulationError,
        match=r"^step 1: request 2 reads position 0 \(block 0, slot 0\), which request 3 "
        r"writes in the same step$",
    ):
        kv.execute(plan(1, row(3, 0, [8, 9], [0], sample=False), row(2, 2, [7], [0, 1])))


def test_a_row_that_does_not_sample_does_not_stop_the_rows_after_it() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    outcome = kv.execute(plan(0, row(1, 0, [5, 6], [0], sample=False), row(2, 0, [7], [1])))
    assert dict(outcome.sampled) == {2: toy_next_token([7])}


def test_a_finished_request_forgets_what_it_wrote() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    kv.execute(plan(0, row(1, 0, [5, 6], [0], sample=False)))
    # Once request 1 is finished its block may be reused: a later writer is no overwrite.
    kv.execute(plan(1, row(2, 0, [8, 9], [0], sample=False), finished=[1]))
    outcome = kv.execute(plan(2, row(1, 2, [7], [0, 1])))
    assert dict(outcome.sampled) == {1: toy_next_token([8, 9, 7])}


def test_a_poisoned_step_leaves_its_positions_unreadable() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    kept = plan(0, row(1, 0, [5, 6], [0], sample=False))
    kv.execute(kept)
    failed = plan(1, row(1, 2, [7, 8], [0, 1], sample=False))
    kv.execute(failed)
    kv.poison(failed)
    # Positions 0 and 1 of the earlier step survive; 2 and 3 are garbage now.
    with pytest.raises(SimulationError, match=r"reads position 2 \(block 1, slot 0\)"):
        kv.execute(plan(2, row(2, 4, [9], [0, 1, 2])))
    kv.execute(plan(3, row(1, 2, [7, 8], [0, 1], sample=False)))
    outcome = kv.execute(plan(4, row(1, 4, [9], [0, 1, 2])))
    assert dict(outcome.sampled) == {1: toy_next_token([5, 6, 7, 8, 9])}


def test_poison_forgets_what_the_failed_step_wrote_for_its_request() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    failed = plan(0, row(1, 0, [5, 6], [0], sample=False))
    kv.execute(failed)
    kv.poison(failed)
    # Another request writes the block: no longer an overwrite under request 1.
    kv.execute(plan(1, row(2, 0, [8, 9], [0], sample=False)))
    outcome = kv.execute(plan(2, row(1, 2, [7], [0, 1])))
    assert dict(outcome.sampled) == {1: toy_next_token([8, 9, 7])}


def test_poison_keeps_what_the_request_wrote_before_the_failed_step() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    kv.execute(plan(0, row(1, 0, [5, 6], [0], sample=False)))
    failed = plan(1, row(1, 2, [7, 8], [0, 1], sample=False))
    kv.execute(failed)
    kv.poison(failed)
    # Positions 0 and 1 are still request 1's own: a block handed to request 2 meanwhile
    # is an overwrite under request 1, caught when it recomputes the failed chunk.
    kv.execute(plan(2, row(2, 0, [8, 9], [0], sample=False)))
    with pytest.raises(
        SimulationError,
        match=r"^step 3: request 1 reads position 0 \(block 0, slot 0\) "
        r"last written by request 2 \(8\)$",
    ):
        kv.execute(plan(3, row(1, 2, [7, 8, 9], [0, 1, 2])))


def test_poisoning_a_step_that_failed_before_it_ran_erases_nothing_else() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    kv.execute(plan(0, row(1, 0, [5, 6], [0], sample=False)))
    # The device failed at launch: step 1 wrote nothing, for request 1 (which wrote before)
    # or for request 2 (never seen).
    kv.poison(plan(1, row(1, 2, [7, 8], [0, 1], sample=False), row(2, 0, [3, 4], [2])))
    outcome = kv.execute(plan(2, row(1, 2, [7, 8, 9], [0, 1, 3]), row(2, 0, [3, 4], [2])))
    assert dict(outcome.sampled) == {
        1: toy_next_token([5, 6, 7, 8, 9]),
        2: toy_next_token([3, 4]),
    }


def test_poison_checks_the_block_table_as_execute_does() -> None:
    kv = SimulatedKV(num_blocks=4, block_size=2)
    with pytest.raises(
        SimulationError, match=r"^step 3: position 2 lies past the block table \(1 blocks of 2\)$"
    ):
        kv.poison(plan(3, row(1, 0, [5, 6, 7], [0])))


def test_a_finished_request_it_never_ran_is_fine() -> None:
    # The runner may be told of a request whose only step failed before it ran.
    kv = SimulatedKV(num_blocks=2, block_size=2)
    outcome = kv.execute(plan(0, row(1, 0, [5, 6, 7], [0, 1]), finished=[7]))
    assert dict(outcome.sampled) == {1: toy_next_token([5, 6, 7])}


def test_the_model_is_pluggable() -> None:
    kv = SimulatedKV(num_blocks=2, block_size=2, next_token=len)
    outcome = kv.execute(plan(0, row(1, 0, [5, 6, 7], [0, 1])))
    assert dict(outcome.sampled) == {1: 3}


def test_toy_next_token_stays_in_the_vocabulary_and_sees_the_length() -> None:
    assert toy_next_token([]) == 0
    assert toy_next_token([0]) != toy_next_token([0, 0])
    assert all(0 <= toy_next_token([i], vocab_size=5) < 5 for i in range(50))
    assert {toy_next_token([i], vocab_size=5) for i in range(50)} == set(range(5))
    # The default vocabulary is 64 ids.
    assert {toy_next_token([i]) for i in range(2000)} == set(range(64))


def counting(token_ids: Sequence[int]) -> int:
    """A model that says how long the sequence is: output i is len(prompt) + i."""
    return len(token_ids)


@pytest.mark.parametrize(
    ("params", "eos", "expected"),
    [
        # Runs to max_tokens.
        (SamplingParams(max_tokens=3), frozenset(), ([2, 3, 4], "length")),
        # A stop token ends it, and is part of the output.
        (SamplingParams(max_tokens=9, stop_token_ids=[4]), frozenset(), ([2, 3, 4], "stop")),
        # EOS too, unless ignored.
        (SamplingParams(max_tokens=9), frozenset({3}), ([2, 3], "stop")),
        (SamplingParams(max_tokens=4, ignore_eos=True), frozenset({3}), ([2, 3, 4, 5], "length")),
        # min_tokens=n: a stop id counts from the (n+1)-th token on.
        (SamplingParams(max_tokens=9, stop_token_ids=[2]), frozenset(), ([2], "stop")),
        (
            SamplingParams(max_tokens=3, min_tokens=1, stop_token_ids=[2]),
            frozenset(),
            ([2, 3, 4], "length"),
        ),
        (
            SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=[3, 4]),
            frozenset(),
            ([2, 3, 4], "stop"),
        ),
        (SamplingParams(max_tokens=9, min_tokens=2), frozenset({3, 4}), ([2, 3, 4], "stop")),
        # A stop on the last allowed token is a stop, not a length.
        (SamplingParams(max_tokens=2, stop_token_ids=[3]), frozenset(), ([2, 3], "stop")),
    ],
)
def test_reference_output_stops_where_the_parameters_say(
    params: SamplingParams, eos: frozenset[int], expected: tuple[list[int], str]
) -> None:
    assert reference_output([7, 7], params, eos_token_ids=eos, next_token=counting) == expected


def test_reference_output_needs_max_tokens_as_a_number() -> None:
    message = "reference_output needs params.max_tokens as a number, got None"
    with pytest.raises(ValueError, match=f"^{message}$"):
        reference_output([7], SamplingParams(max_tokens=None))
