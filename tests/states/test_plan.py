"""Plans and runner outputs are frozen all the way down: their mappings are read-only copies."""

from __future__ import annotations

import pytest

from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, ScheduledRequest, StepPlan, TokenLogprobs


def test_runner_output_mappings_are_read_only_copies() -> None:
    sampled = {4: 1}
    logprobs = {4: TokenLogprobs(token_id=1, logprob=-0.5)}
    output = RunnerOutput(step_id=3, sampled=sampled, logprobs=logprobs)
    sampled.clear()
    logprobs.clear()
    assert dict(output.sampled) == {4: 1}
    assert output.logprobs[4].logprob == -0.5
    with pytest.raises(TypeError, match="does not support item assignment"):
        output.sampled[4] = 2  # type: ignore[index]
    with pytest.raises(TypeError, match="does not support item assignment"):
        output.logprobs[5] = TokenLogprobs(token_id=2, logprob=-1.0)  # type: ignore[index]
    assert dict(RunnerOutput(step_id=0, sampled={}).logprobs) == {}
    assert output == RunnerOutput(3, {4: 1}, {4: TokenLogprobs(1, -0.5)})


def entry(request_id: int, *, tokens: int, pending_input: bool, sample: bool) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id,
        start=10,
        token_ids=tuple(range(tokens)),
        pending_input=pending_input,
        sample=sample,
        sample_index=0,
        num_prompt_tokens=4,
        block_table=(0, 1, 2),
        params=SamplingParams(),
    )


def test_a_row_counts_its_pending_input_as_a_token() -> None:
    decode = entry(1, tokens=0, pending_input=True, sample=True)
    chunk = entry(2, tokens=3, pending_input=False, sample=False)
    assert (decode.num_tokens, decode.end) == (1, 11)
    assert (chunk.num_tokens, chunk.end) == (3, 13)


def test_a_plan_sums_its_rows() -> None:
    rows = (
        entry(4, tokens=0, pending_input=True, sample=True),
        entry(2, tokens=3, pending_input=False, sample=False),
        entry(9, tokens=2, pending_input=True, sample=True),
    )
    plan = StepPlan(step_id=5, requests=rows, finished_request_ids=(7,))
    assert plan.num_tokens == 1 + 3 + 3
    assert plan.num_samples == 2
    assert plan.request_ids == (4, 2, 9)


def test_without_drops_only_the_rows_named_and_keeps_the_rest() -> None:
    rows = tuple(entry(rid, tokens=1, pending_input=False, sample=True) for rid in (4, 2, 9, 6))
    plan = StepPlan(step_id=5, requests=rows, finished_request_ids=(7,))
    kept = plan.without({2, 6, 8})
    assert kept == StepPlan(step_id=5, requests=(rows[0], rows[2]), finished_request_ids=(7,))
    assert plan.without(()) == plan
    assert plan.without([4, 2, 9, 6]).requests == ()


def row(request_id: int, start: int, end: int, blocks: tuple[int, ...]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id,
        start=start,
        token_ids=tuple(range(end - start)),
        pending_input=False,
        sample=True,
        sample_index=0,
        num_prompt_tokens=end,
        block_table=blocks,
        params=SamplingParams(),
    )


def test_a_row_writes_the_blocks_covering_its_positions() -> None:
    # block size 4: positions [6, 13) lie in blocks 1, 2 and 3 of the table
    assert row(1, 6, 13, (10, 11, 12, 13, 14)).written_blocks(4) == {11, 12, 13}
    assert row(1, 8, 9, (10, 11, 12)).written_blocks(4) == {12}
    assert row(1, 0, 4, (10, 11)).written_blocks(4) == {10}
    plan = StepPlan(0, (row(1, 0, 4, (10, 11)), row(2, 4, 6, (20, 21))))
    assert plan.written_blocks(4) == {10, 21}
    assert StepPlan(0, ()).written_blocks(4) == frozenset()


def test_a_failed_step_strands_its_requests_and_the_readers_of_what_it_wrote() -> None:
    failed = StepPlan(7, (row(1, 8, 12, (5, 6, 7)), row(2, 0, 3, (9,))))
    later = StepPlan(
        step_id=8,
        planned_behind=7,
        requests=(
            row(1, 12, 13, (5, 6, 7, 8)),  # the failed request itself
            row(3, 12, 14, (5, 6, 7, 30)),  # a prefix hit on block 7, which step 7 filled
            row(4, 8, 10, (5, 6, 31)),  # a hit on blocks 5 and 6 only, written earlier
            row(5, 0, 2, (32,)),  # unrelated
        ),
    )
    assert later.stranded_by(failed, 4) == {1, 3}
    assert later.without(later.stranded_by(failed, 4)).request_ids == (4, 5)


def test_a_step_planned_after_the_failure_was_applied_is_not_stranded() -> None:
    # At depth 1 (or when nothing else was in flight) the next plan comes after the failure
    # is applied: the failed requests are gone, and the blocks they held may be reallocated.
    failed = StepPlan(7, (row(1, 8, 12, (5, 6, 7)),))
    after = StepPlan(8, (row(3, 0, 4, (7,)),), planned_behind=None)
    assert after.stranded_by(failed, 4) == frozenset()
    behind_another = StepPlan(8, (row(1, 12, 13, (5, 6, 7, 8)),), planned_behind=6)
    assert behind_another.stranded_by(failed, 4) == frozenset()
