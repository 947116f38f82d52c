"""A model whose every layer attends within a sliding window: its requests give back the
blocks behind the window as they run (issue 50), and their tokens stay the window's."""

from __future__ import annotations

import re

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twostroke.states.errors import InvalidTransition, RequestRejected
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
from twostroke.states.validators import MAX_PIPELINE_DEPTH

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


def test_a_request_longer_than_the_pool_is_served_through_its_window() -> None:
    """44 positions would take 22 blocks of 2; a window of 3, chunks of 4 and one step in
    flight need at most blocks_for(3 - 1 + 4) + 1 = 4 at once, so a pool of 4 takes it,
    and one of 3 refuses it by that count."""
    config = windowed(num_blocks=4, max_model_len=64, pipeline_depth=2)
    scheduler = Scheduler(config)
    assert scheduler.most_blocks_held(44) == 4
    params = SamplingParams(max_tokens=38, ignore_eos=True)
    result = drive(scheduler, [Request(0, PROMPT, params, 0.0)])
    assert result.outputs[0] == tuple(reference_output(PROMPT, params, window=3)[0])
    small = Scheduler(attrs.evolve(config, num_blocks=3))
    message = "prompt + max_tokens (44 tokens) needs 4 KV blocks of 2, but the pool has only 3"
    with pytest.raises(RequestRejected, match=re.escape(message)):
        small.add_request(Request(0, PROMPT, params, 0.0))


@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(1, 9),
    block_size=st.integers(1, 4),
    budget=st.integers(1, 12),
    depth=st.integers(1, MAX_PIPELINE_DEPTH),
    max_num_seqs=st.integers(1, 3),
    caching=st.booleans(),
    drafts=st.sampled_from([0, 2]),
    spare=st.integers(0, 3),
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=4),
)
def test_requests_longer_than_the_pool_are_served_in_a_pool_of_their_window(
    window: int,
    block_size: int,
    budget: int,
    depth: int,
    max_num_seqs: int,
    caching: bool,
    drafts: int,
    spare: int,
    lengths: list[tuple[int, int]],
) -> None:
    """A pool of the fewest blocks most_blocks_held allows (and a few more) serves
    requests of up to 60 positions, shared prefixes and drafts included, every output the
    window's reference and every guarantee of the harness kept (drive checks each step and
    bounds the steps, which holds only if a request alone always fits)."""
    speculative = {"method": "ngram", "num_speculative_tokens": drafts} if drafts else None
    probe = windowed(
        num_blocks=1,
        block_size=block_size,
        max_num_batched_tokens=budget,
        pipeline_depth=depth,
        sliding_window=window,
        max_model_len=61,
    )
    fewest = Scheduler(probe).most_blocks_held(61)
    config = attrs.evolve(
        probe,
        num_blocks=fewest + spare,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=caching,
        speculative_config=speculative,
    )
    specs = [
        # Prompts that share a start (prefix hits) and repeat (drafts find matches).
        RequestSpec(
            [(i % 3) for i in range(prompt)], SamplingParams(max_tokens=tokens, ignore_eos=True)
        )
        for prompt, tokens in lengths
    ]
    result = drive(Scheduler(config), Workload(requests=specs, arrivals=[0] * len(specs)))
    for index, spec in enumerate(specs):
        expected = reference_output(spec.prompt_token_ids, spec.params, window=window)[0]
        assert result.outputs[index] == tuple(expected)
