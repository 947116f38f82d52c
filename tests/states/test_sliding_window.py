"""A model whose every layer attends within a sliding window: its requests give back the
blocks behind the window as they run (issue 50), and their tokens stay the window's."""

from __future__ import annotations

import pytest

from twostroke.states.errors import InvalidTransition
from twostroke.states.params import SamplingParams
from twostroke.states.request import (
    Admitted,
    BlocksAllocated,
    BlocksReleased,
    ChunkScheduled,
    Preempted,
    Request,
)
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.testing import RequestSpec, SimulatedKV, Workload, drive, reference_output

PROMPT = (1, 2, 3, 4, 5, 6)
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def windowed(**overrides: object) -> SchedulerConfig:
    values: dict[str, object] = {
        "num_blocks": 8,
        "block_size": 2,
        "max_num_batched_tokens": 4,
        "max_num_seqs": 1,
        "max_model_len": 17,
        "pipeline_depth": 1,
        "enable_prefix_caching": False,
        "sliding_window": 3,
    }
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def test_the_blocks_held_stay_the_windows_however_long_the_request_runs() -> None:
    """16 positions would take 8 blocks of 2; with a window of 3 the request never holds
    more than the blocks of its window and the chunk it computes, and each step's table
    pads the positions behind the window with block 0."""
    config = windowed()
    scheduler = Scheduler(config)
    kv = SimulatedKV(config.num_blocks, config.block_size, window=3)
    request = Request(0, PROMPT, PARAMS, 0.0)
    scheduler.add_request(request)
    held: list[int] = []
    tokens: list[int] = []
    while not scheduler.is_idle():
        plan = scheduler.schedule()
        assert plan is not None
        [entry] = plan.requests
        released = entry.num_released_blocks
        assert entry.block_table[:released] == (0,) * released
        assert entry.held_blocks == request.block_table
        # Every position the step's first query sees is in a block the request holds.
        assert released * config.block_size <= max(entry.start - 3 + 1, 0)
        held.append(len(request.block_table))
        tokens.extend(token for _, token in scheduler.apply(kv.execute(plan)).new_tokens)
        scheduler.check_invariants()
    assert tokens == reference_output(PROMPT, PARAMS, window=3)[0]
    # Two prefill chunks (4 and 2 tokens), then a decode a token: the one at position c
    # sees positions c - 2 .. c, which two blocks of 2 hold; the first chunk takes two too.
    assert len(held) == 2 + PARAMS.max_tokens - 1
    assert max(held) == 2
    assert scheduler.pool.num_free == config.num_blocks


def test_a_block_a_step_in_flight_reads_is_given_back_when_it_completes() -> None:
    """One step ahead, the next step's plan releases blocks the step in flight still reads:
    they stay held (deferred) until its outcome is applied."""
    config = windowed(block_size=1, sliding_window=2, pipeline_depth=2, max_num_batched_tokens=8)
    scheduler = Scheduler(config)
    kv = SimulatedKV(config.num_blocks, config.block_size, window=2)
    request = Request(0, (7, 8, 9), SamplingParams(max_tokens=3, ignore_eos=True), 0.0)
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first is not None
    first_blocks = request.block_table
    second = scheduler.schedule()  # its first query, position 3, sees positions 2 and 3
    assert second is not None
    [entry] = second.requests
    assert (entry.num_released_blocks, request.num_released_blocks) == (2, 2)
    assert entry.block_table[:2] == (0, 0)
    behind = first_blocks[:2]
    assert [scheduler.pool.ref_count(b) for b in behind] == [1, 1]  # the first step reads them
    scheduler.check_invariants()
    scheduler.apply(kv.execute(first))
    assert [scheduler.pool.ref_count(b) for b in behind] == [0, 0]
    scheduler.check_invariants()
    scheduler.apply(kv.execute(second))
    scheduler.check_invariants()


@pytest.mark.parametrize("depth", [1, 2])
def test_windowed_requests_share_a_cached_prefix_and_keep_their_tokens(depth: int) -> None:
    """The blocks given back are cached first: a later request with the same prompt takes
    them as a hit, and every output is the window's reference."""
    config = windowed(
        num_blocks=12,
        max_num_seqs=2,
        max_model_len=19,
        enable_prefix_caching=True,
        pipeline_depth=depth,
    )
    specs = [RequestSpec((*PROMPT, 9, 9), PARAMS)] * 3
    result = drive(Scheduler(config), Workload(requests=specs, arrivals=(0, 0, 6)))
    expected = tuple(reference_output((*PROMPT, 9, 9), PARAMS, window=3)[0])
    assert result.outputs == dict.fromkeys(range(3), expected)
    assert result.statistics.num_prefix_cache_hits > 0


def test_a_request_releases_only_blocks_it_holds() -> None:
    request = Request(3, PROMPT, PARAMS, 0.0)
    request.apply(Admitted(0.0))
    request.apply(BlocksAllocated((5, 6)))
    request.apply(ChunkScheduled(0, 4))
    for count in (0, 3):
        with pytest.raises(
            InvalidTransition,
            match=rf"BlocksReleased\(num_blocks={count}\) must release at least one of the 2 "
            r"blocks held, and no more",
        ):
            request.apply(BlocksReleased(count))
    request.apply(BlocksReleased(1))
    assert (request.block_table, request.num_released_blocks, request.num_table_blocks) == (
        (6,),
        1,
        2,
    )
    request.apply(Preempted())  # starts over: nothing held, nothing behind
    assert (request.block_table, request.num_released_blocks) == ((), 0)


def test_the_window_is_a_positive_number_of_positions() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        windowed(sliding_window=0)
