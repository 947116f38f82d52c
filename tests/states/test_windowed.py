"""The windowed layers' own pool (Gemma 2 and 3), as the scheduler admits against it: each
running request holds a reservation, a request waits where its own does not fit beside the
running ones', and one that never would is refused. The runner's tables on these plans are
checked in tests/engine/runners/test_window_kv.py."""

from __future__ import annotations

import re

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twostroke.states.blocks import blocks_for
from twostroke.states.errors import RequestRejected
from twostroke.states.params import SamplingParams
from twostroke.states.request import Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.testing import RequestSpec, SimulatedKV, Workload, drive, windowed_pools
from twostroke.states.windowed import WindowedKV, window_pool_blocks


def test_a_reservation_is_a_window_or_a_whole_table_and_a_step_sets_blocks_aside() -> None:
    windowed = WindowedKV(window=8, num_blocks=40)
    # Blocks of 4: a window of 8 (7 positions back) is 2 blocks, and 2 more for the rounding
    # of a row and of the window's first block; drafts lengthen it.
    assert windowed.reservation(100, block_size=4, max_drafts=0) == 4
    assert windowed.reservation(100, block_size=4, max_drafts=3) == blocks_for(10, 4) + 2
    # A request shorter than its window holds no more than its table, and one block.
    assert windowed.reservation(6, block_size=4, max_drafts=0) == blocks_for(5, 4) + 1
    assert windowed.step_reserve(block_size=4, max_num_batched_tokens=10) == 1 + 3
    # max_num_seqs whole windows beside a step.
    assert (
        window_pool_blocks(
            window=8, block_size=4, max_num_seqs=3, max_num_batched_tokens=10, max_drafts=3
        )
        == 1 + 3 * 5 + 3
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window": 0}, "window must be >= 1, got 0"),
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
        ({"max_drafts": -1}, "max_drafts must be >= 0, got -1"),
    ],
)
def test_the_pool_size_takes_positive_sizes(options: dict[str, int], message: str) -> None:
    sizes = {"window": 8, "block_size": 4, "max_num_seqs": 1, "max_num_batched_tokens": 4}
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        window_pool_blocks(**{**sizes, **options})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks"):
        WindowedKV(window=8, num_blocks=1)


def config(**overrides: object) -> SchedulerConfig:
    values: dict[str, object] = {
        "num_blocks": 32,
        "block_size": 4,
        "max_num_batched_tokens": 4,
        "max_num_seqs": 4,
        "max_model_len": 32,
        "enable_prefix_caching": False,
        "windowed_kv": WindowedKV(window=8, num_blocks=8),
    }
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def test_a_request_waits_for_room_and_one_that_never_fits_is_refused() -> None:
    """A step sets 1 + 1 blocks aside, a request of 20 positions reserves 4: a pool of 8
    runs one such request at a time; the second is admitted once the first has ended."""
    scheduler = Scheduler(config())
    kv = SimulatedKV(32, 4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for index in range(2):
        scheduler.add_request(Request(index, [1] * 10, params, 0.0))  # 20 positions each
    admitted: list[tuple[int, ...]] = []
    while (plan := scheduler.schedule()) is not None:
        admitted.append(plan.request_ids)
        scheduler.apply(kv.execute(plan))
        scheduler.check_invariants()
    assert (0, 1) not in admitted
    assert (1, 0) not in admitted
    assert admitted[0] == (0,)
    assert admitted[-1] == (1,)
    assert scheduler.is_idle()
    small = Scheduler(config(windowed_kv=WindowedKV(window=8, num_blocks=5)))
    message = (
        "prompt + max_tokens (20 tokens) needs 4 blocks of the windowed layers' pool beside "
        "a step's 2, but it has only 5"
    )
    with pytest.raises(RequestRejected, match=f"^{re.escape(message)}$"):
        small.add_request(Request(0, [1] * 10, params, 0.0))
    small.add_request(Request(1, [1] * 3, SamplingParams(max_tokens=3), 0.0))  # reserves 3


def test_the_pool_is_the_runners_so_prefix_caching_is_off() -> None:
    with pytest.raises(ValueError, match="windowed_kv needs enable_prefix_caching=False"):
        config(enable_prefix_caching=True)
    with pytest.raises(TypeError, match="windowed_kv"):
        config(windowed_kv=8)


@settings(max_examples=100, deadline=None)
@given(
    window=st.integers(1, 12),
    block_size=st.integers(1, 4),
    budget=st.integers(1, 12),
    depth=st.integers(1, 2),
    max_num_seqs=st.integers(1, 4),
    drafts=st.sampled_from([0, 2]),
    spare=st.integers(0, 4),
    lengths=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 16)), min_size=1, max_size=6),
    data=st.data(),
)
def test_the_reservations_fit_the_pool_whatever_runs(
    window: int,
    block_size: int,
    budget: int,
    depth: int,
    max_num_seqs: int,
    drafts: int,
    spare: int,
    lengths: list[tuple[int, int]],
    data: st.DataObject,
) -> None:
    """Pools from what the longest request needs alone to max_num_seqs whole windows, a
    global pool small enough to preempt: every request is served, each step's reservations
    fit (check_invariants after each call), every output is the reference's."""
    totals = [p + t for p, t in lengths]
    windowed = data.draw(
        windowed_pools(
            window=window,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_drafts=drafts,
            totals=totals,
        )
    )
    chosen = config(
        num_blocks=blocks_for(max(totals), block_size) + spare,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max(totals) + 1,
        pipeline_depth=depth,
        speculative_config={"method": "ngram", "num_speculative_tokens": drafts}
        if drafts
        else None,
        windowed_kv=windowed,
    )
    specs = [
        RequestSpec([i % 3 for i in range(p)], SamplingParams(max_tokens=t, ignore_eos=True))
        for p, t in lengths
    ]
    drive(Scheduler(chosen), Workload(requests=specs, arrivals=[0] * len(specs)))


def test_without_the_pool_nothing_is_reserved() -> None:
    scheduler = Scheduler(attrs.evolve(config(), windowed_kv=None))
    scheduler.add_request(Request(0, [1] * 10, SamplingParams(max_tokens=2), 0.0))
    assert scheduler.schedule() is not None
    scheduler.check_invariants()
