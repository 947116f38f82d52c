"""Prefix caching: the pool against a plain prefix model, the scheduler with caching on and
off, the lookahead's rules, and pinned messages."""

from __future__ import annotations

import re

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twostroke.states.blocks import ROOT_HASH, BlockPool, BlockState, block_hashes, hash_block
from twostroke.states.errors import InvalidTransition, SchedulerError
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, StepPlan
from twostroke.states.prefix_cache import PrefixCache
from twostroke.states.request import Admitted, PrefixCacheHit, Request, RequestStatus
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.testing import (
    PrefixCacheMachine,
    RequestSpec,
    SchedulerMachine,
    SimulatedEngine,
    Workload,
    drive,
    scheduler_configs,
)
from twostroke.states.validators import MAX_PIPELINE_DEPTH

TestPrefixCache = PrefixCacheMachine.TestCase

#: Tiny pools with caching on, at both depths: hits, preemption and eviction all at once.
TestSchedulerWithPrefixCaching = SchedulerMachine.for_config(
    scheduler_configs(
        num_blocks=st.integers(2, 8),
        block_size=st.integers(1, 3),
        max_num_seqs=st.integers(2, 4),
        max_num_batched_tokens=st.integers(2, 16),
        enable_prefix_caching=True,
    )
).TestCase


def config(**overrides: object) -> SchedulerConfig:
    values: dict[str, object] = {
        "num_blocks": 16,
        "block_size": 4,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "max_model_len": 64,
        "pipeline_depth": 2,
    }
    return SchedulerConfig(**(values | overrides))  # type: ignore[arg-type]


def spec(prompt: list[int], max_tokens: int = 4) -> RequestSpec:
    return RequestSpec(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


# --- hashing ------------------------------------------------------------------------------


def test_hashes_chain_from_a_fixed_root() -> None:
    first, second = block_hashes([1, 2, 3, 4, 5], 2)
    assert first == hash_block(ROOT_HASH, [1, 2]) == hash_block(ROOT_HASH, (1, 2))
    assert second == hash_block(first, [3, 4])
    assert hash_block(ROOT_HASH, [3, 4]) != second  # the same tokens under another parent
    assert hash_block(ROOT_HASH, [1, 2], b"tenant") != first
    assert block_hashes([1, 2, 3, 4, 5], 2, start=[first]) == [first, second]


def test_hashes_are_pinned_so_that_every_process_agrees() -> None:
    # Python's hash() differs between processes; replicas must compute the same values, so
    # a change here is a new format, made on purpose.
    assert ROOT_HASH.hex() == "76b20aff3bfa1f72ceacb2d6c8f3bd0f7ca19c0e84d5bab1ca285e371bd44720"
    assert hash_block(ROOT_HASH, [1, 2]).hex() == (
        "d88047b630fcb91ab2d8358c717fa2d9b6c58c2e3a421510ae20700845cf60c7"
    )


# --- the pool -----------------------------------------------------------------------------


def cached_pool() -> tuple[BlockPool, list[bytes]]:
    """A pool of 4 blocks of 2 whose blocks 0 and 1 hold the prefix [1, 2, 3, 4], released."""
    pool = BlockPool(4, 2)
    hashes = block_hashes([1, 2, 3, 4], 2)
    table = pool.allocate(2)
    pool.cache(table[0], ROOT_HASH, [1, 2])
    pool.cache(table[1], hashes[0], [3, 4])
    pool.release(table[::-1])
    return pool, hashes


def test_released_blocks_with_a_hash_are_cached_and_evicted_leaves_first() -> None:
    pool, hashes = cached_pool()
    assert [pool.state(b) for b in range(4)] == [
        BlockState.CACHED,
        BlockState.CACHED,
        BlockState.EMPTY,
        BlockState.EMPTY,
    ]
    assert (pool.num_free, pool.num_cached) == (4, 2)
    assert pool.allocate(3) == (2, 3, 1)  # empty first, then the leaf (released first)
    assert pool.block_hash(1) is None
    assert pool.block_hash(0) == hashes[0]
    assert pool.match_prefix([1, 2, 3, 4, 5], hashes) == (0,)
    assert repr(pool) == "<BlockPool 1/4 free (1 cached), block_size=2>"
    pool.check_invariants()


def test_a_hit_is_verified_and_leaves_the_last_token() -> None:
    pool, hashes = cached_pool()
    assert pool.match_prefix([1, 2, 3, 4, 5], hashes) == (0, 1)
    assert pool.match_prefix([1, 2, 3, 4], hashes) == (0,)  # the last token is computed
    assert pool.match_prefix([1, 2, 3, 4], []) == ()
    assert pool.match_prefix([], hashes) == ()
    # A caller's wrong hash (or a collision) finds a block whose tokens differ: no hit.
    assert pool.match_prefix([1, 2, 9, 9, 5], hashes) == (0,)
    assert pool.match_prefix([9, 9, 3, 4, 5], [hashes[0], hashes[1]]) == ()
    # The right tokens under the wrong parent are no hit either.
    wrong_parent = [hash_block(ROOT_HASH, [7, 7]), hashes[1]]
    assert pool.match_prefix([7, 7, 3, 4, 5], wrong_parent) == ()


def test_claiming_shares_blocks_in_use_and_takes_cached_ones_back() -> None:
    pool, _hashes = cached_pool()
    pool.claim_prefix((0, 1), 5)
    assert pool.state(0) is BlockState.IN_USE
    assert pool.num_cached == 0
    pool.claim_prefix((0,), 3)
    assert pool.ref_count(0) == 2
    assert pool.statistics().num_shared_blocks == 1
    stats = pool.statistics()
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (8, 6)
    pool.check_invariants()


def test_a_prefix_computed_twice_is_cached_once() -> None:
    pool = BlockPool(3, 2)
    first, second = pool.allocate(2)
    assert pool.cache(first, ROOT_HASH, [1, 2]) == pool.cache(second, ROOT_HASH, [1, 2])
    assert pool.block_hash(first) is not None
    assert pool.block_hash(second) is None
    assert pool.cache(first, ROOT_HASH, [1, 2]) == pool.block_hash(first)  # idempotent
    pool.release([first, second])
    assert [pool.state(b) for b in (first, second)] == [BlockState.CACHED, BlockState.EMPTY]


def test_forget_uncaches_in_use_and_cached_blocks() -> None:
    pool, hashes = cached_pool()
    pool.claim_prefix((0,), 3)
    pool.forget([0, 1, 2])  # in use, cached, empty
    assert [pool.state(b) for b in range(3)] == [
        BlockState.IN_USE,
        BlockState.EMPTY,
        BlockState.EMPTY,
    ]
    assert pool.block_hash(0) is None
    assert pool.match_prefix([1, 2, 3], hashes) == ()
    pool.release([0])
    assert pool.state(0) is BlockState.EMPTY
    assert pool.num_cached == 0
    pool.check_invariants()


POOL_REFUSALS = [
    (lambda p: p.cache(2, ROOT_HASH, [1, 2]), "can't cache block 2: it is free"),
    (lambda p: p.cache(9, ROOT_HASH, [1, 2]), "can't cache block 9: no such block"),
    (lambda p: p.claim_prefix((2,), 4), "can't claim block 2: it holds no prefix"),
    (lambda p: p.claim_prefix((0, 2), 4), "can't claim block 2: it holds no prefix"),
    (lambda p: p.forget([4]), "no block 4: block ids are in [0, 4)"),
    (lambda p: p.state(-1), "no block -1: block ids are in [0, 4)"),
    (lambda p: p.block_hash(4), "no block 4: block ids are in [0, 4)"),
]


@pytest.mark.parametrize(("call", "message"), POOL_REFUSALS)
def test_pool_refusals_name_the_rule_and_change_nothing(call: object, message: str) -> None:
    pool, _ = cached_pool()
    before = pool.statistics(), [pool.state(b) for b in range(4)]
    with pytest.raises(SchedulerError, match=f"^{re.escape(message)}$"):
        call(pool)  # type: ignore[operator]
    assert (pool.statistics(), [pool.state(b) for b in range(4)]) == before


def test_cache_refuses_a_partial_block_and_another_prefix() -> None:
    pool = BlockPool(2, 2)
    (block,) = pool.allocate(1)
    with pytest.raises(SchedulerError, match=r"^can't cache block 0: it needs 2 tokens, got 1$"):
        pool.cache(block, ROOT_HASH, [1])
    pool.cache(block, ROOT_HASH, [1, 2])
    with pytest.raises(SchedulerError, match=r"^can't cache block 0: it holds another prefix$"):
        pool.cache(block, ROOT_HASH, [3, 4])
    pool.check_invariants()


def test_check_invariants_notices_a_hash_that_moved() -> None:
    pool, hashes = cached_pool()
    pool._by_hash[hashes[0]] = 1
    with pytest.raises(AssertionError, match="block 0's hash moved"):
        pool.check_invariants()


@settings(max_examples=50)
@given(
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    block_size=st.integers(1, 5),
)
def test_with_room_a_repeated_prompt_hits_every_full_block_but_the_last_tokens(
    prompt: list[int], block_size: int
) -> None:
    hashes = block_hashes(prompt, block_size)
    pool = BlockPool(64, block_size)
    table = pool.allocate(-(-len(prompt) // block_size))
    for index, block_hash in enumerate(hashes):
        parent = hashes[index - 1] if index else ROOT_HASH
        tokens = prompt[index * block_size : (index + 1) * block_size]
        assert pool.cache(table[index], parent, tokens) == block_hash
    pool.release(table[::-1])
    assert pool.match_prefix(prompt, hashes) == table[: (len(prompt) - 1) // block_size]


# --- the request event --------------------------------------------------------------------


def test_a_prefix_hit_starts_the_block_table_and_counts_once() -> None:
    request = Request(1, range(10), SamplingParams(max_tokens=2), arrival_time=0)
    request.apply(Admitted(0.0))
    request.apply(PrefixCacheHit((3, 4), 8))
    assert (request.block_table, request.num_computed_tokens) == ((3, 4), 8)
    assert request.num_cached_tokens == 8
    with pytest.raises(
        InvalidTransition,
        match=r"^request 1: PrefixCacheHit\(num_tokens=4\) must come first: the request "
        r"already holds blocks$",
    ):
        request.apply(PrefixCacheHit((5,), 4))


@pytest.mark.parametrize(("block_ids", "num_tokens"), [((), 4), ((1,), 0), ((1,), 3)])
def test_a_prefix_hit_must_cover_a_block_and_leave_a_token(
    block_ids: tuple[int, ...], num_tokens: int
) -> None:
    request = Request(1, range(3), SamplingParams(), arrival_time=0)
    request.apply(Admitted(0.0))
    with pytest.raises(
        InvalidTransition,
        match=rf"^request 1: PrefixCacheHit\(num_tokens={num_tokens}\) must cover at least one "
        r"block and leave at least one of the 3 tokens to compute$",
    ):
        request.apply(PrefixCacheHit(block_ids, num_tokens))
    assert request.block_table == ()
    assert request.num_cached_tokens == 0


# --- the scheduler ------------------------------------------------------------------------


SYSTEM = list(range(20, 40))  # a shared "system prompt" of 20 tokens (5 blocks of 4)


def test_a_shared_prompt_is_computed_once_and_the_output_does_not_change() -> None:
    workload = Workload(
        [spec([*SYSTEM, 1, 2]), spec([*SYSTEM, 3]), spec([*SYSTEM, 1, 2])], arrivals=[0, 1, 1]
    )
    for depth in (1, 2):
        cached = drive(Scheduler(config(pipeline_depth=depth)), workload)
        plain = drive(
            Scheduler(config(pipeline_depth=depth, enable_prefix_caching=False)), workload
        )
        assert cached.outputs == plain.outputs
        stats = cached.statistics
        assert stats.num_prefix_cache_queries == 22 + 21 + 22
        # Request 0 arrives first and computes everything; the two others hit 5 blocks.
        assert stats.num_prefix_cache_hits == 40
        assert stats.prefix_cache_hit_rate == pytest.approx(40 / 65)
        assert cached.statistics.num_tokens_scheduled < plain.statistics.num_tokens_scheduled
        assert plain.statistics.num_prefix_cache_queries == 0
        assert plain.statistics.prefix_cache_hit_rate == 0.0
        assert stats.num_cached_blocks > 0


def test_a_block_is_matched_only_by_steps_planned_after_the_one_that_writes_it() -> None:
    # Two requests with one prompt arrive together: the second cannot use the first's
    # blocks in the same step (the batch writes them), so both compute the prompt. A third,
    # admitted in the next step while the first is in flight, reads them.
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    for request_id in (0, 1):
        engine.submit(spec([*SYSTEM, 1]).build(request_id))
    first = engine.plan()
    assert first is not None
    assert [entry.start for entry in first.requests] == [0, 0]
    engine.submit(spec([*SYSTEM, 2]).build(2))
    second = engine.plan()
    assert second is not None
    (entry,) = [entry for entry in second.requests if entry.request_id == 2]
    assert entry.start == 20
    assert scheduler.get(2).num_cached_tokens == 20
    engine.run_until_idle()


def test_a_token_in_flight_completes_a_block_once_it_arrives() -> None:
    # At depth 2 the block holding a placeholder is cached when its token is known.
    scheduler = Scheduler(config(block_size=2))
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([5, 6, 7], max_tokens=3).build(0))
    engine.plan()  # computes [5, 6, 7], samples t0
    engine.plan()  # computes t0 (a pending input): block 1 = [7, t0], its id still unknown
    assert scheduler.pool.block_hash(scheduler.get(0).block_table[1]) is None  # type: ignore[union-attr]
    engine.complete()  # t0 arrives: block 1 is now cached
    assert scheduler.pool.block_hash(scheduler.get(0).block_table[1]) is not None  # type: ignore[union-attr]
    engine.run_until_idle()
    follow_up = [5, 6, 7, *engine.streams[0][:1], 9]
    engine.submit(spec(follow_up).build(1))
    engine.run_until_idle()
    assert engine.requests[1].num_cached_tokens == 4


def test_preemption_reuses_hits_and_keeps_the_first_cached_count() -> None:
    cfg = config(num_blocks=7, block_size=2, max_num_batched_tokens=4, max_model_len=15)
    workload = Workload(
        [spec(list(range(8)), max_tokens=6), spec([*list(range(8)), 9], max_tokens=6)],
        arrivals=[0, 2],
    )
    cached = drive(Scheduler(cfg), workload)
    plain = drive(Scheduler(attrs.evolve(cfg, enable_prefix_caching=False)), workload)
    assert cached.outputs == plain.outputs
    assert cached.statistics.num_preemptions > 0


def test_a_failed_step_uncaches_its_blocks_and_recomputes_the_requests_that_read_them() -> None:
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM, 1]).build(0))
    engine.plan()  # step 0 writes the system prompt's blocks for request 0
    engine.submit(spec([*SYSTEM, 2]).build(1))
    engine.plan()  # step 1 admits request 1 on them
    assert scheduler.get(1).num_cached_tokens == 20  # type: ignore[union-attr]
    report = engine.complete(failure="device lost")  # step 0 fails
    # Only step 0's own request fails; the reader did nothing wrong and is recomputed.
    assert report.failed == (0,)
    reader = scheduler.get(1)
    assert reader is not None
    assert reader.status is RequestStatus.PREEMPTED
    assert reader.num_placeholders == 1  # step 1 still samples for it, from missing KV
    report = engine.complete()  # step 1: its sample for request 1 is discarded
    assert report.new_tokens == ()
    assert reader.num_placeholders == 0
    assert reader.num_output_tokens == 0
    assert scheduler.pool.num_cached == 0  # nothing step 0 wrote stays matchable
    engine.run_until_idle()
    assert engine.requests[1].status is RequestStatus.FINISHED  # its output: the reference
    assert scheduler.statistics().num_preemptions == 1
    # The recomputed reader wrote the system prompt again: a later request hits that KV,
    # and the harness checks its output against the reference.
    engine.submit(spec([*SYSTEM, 3]).build(2))
    engine.run_until_idle()
    assert engine.requests[2].num_cached_tokens == 20
    assert engine.requests[2].status is RequestStatus.FINISHED


def test_a_failure_spares_unrelated_requests_and_a_discarded_chunk_samples_nothing() -> None:
    scheduler = Scheduler(config(max_num_batched_tokens=12))
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([1, 2, 3, 4, 5]).build(0))
    engine.plan()  # step 0: request 0's prompt; its first block is matchable from now on
    engine.submit(spec([9, 8, 7, 6, 5]).build(1))  # shares nothing
    engine.submit(spec([1, 2, 3, 4, *range(10, 26)]).build(2))  # reads request 0's block
    plan = engine.plan()  # step 1: request 0 decodes, 1 prefills, 2 takes a chunk
    assert plan is not None
    assert [(row.request_id, row.sample) for row in plan.requests] == [
        (0, True),
        (1, True),
        (2, False),
    ]
    assert engine.complete(failure="device lost").failed == (0,)  # step 0 fails
    # Request 1 touched nothing step 0 wrote: it runs on; request 2 read it: recomputed.
    assert scheduler.get(1).status is RequestStatus.DECODING  # type: ignore[union-attr]
    assert scheduler.get(2).status is RequestStatus.PREEMPTED  # type: ignore[union-attr]
    report = engine.complete()  # step 1: request 2's chunk is discarded, it sampled nothing
    assert [request_id for request_id, _ in report.new_tokens] == [1]
    # Nothing step 0 wrote, nor the block request 2 wrote from it in step 1, is matchable.
    assert scheduler.pool.num_cached == 0
    engine.run_until_idle()
    assert engine.requests[1].status is RequestStatus.FINISHED
    assert engine.requests[2].status is RequestStatus.FINISHED


def test_a_discarded_sample_spares_the_rows_after_it() -> None:
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([1, 2, 3, 4, 5]).build(0))
    engine.plan()  # step 0: request 0's prompt; its first block is matchable from now on
    engine.submit(spec([1, 2, 3, 4, 6]).build(1))  # reads request 0's block
    engine.submit(spec([9, 8, 7, 6, 5]).build(2))  # shares nothing, admitted after 1
    plan = engine.plan()
    assert plan is not None
    assert [(row.request_id, row.sample) for row in plan.requests] == [
        (0, True),
        (1, True),
        (2, True),
    ]
    assert engine.complete(failure="device lost").failed == (0,)  # step 0 fails
    report = engine.complete()  # step 1: request 1's sample is garbage, request 2's is not
    assert [request_id for request_id, _ in report.new_tokens] == [2]
    assert scheduler.get(1).num_output_tokens == 0  # type: ignore[union-attr]
    assert scheduler.get(2).num_output_tokens == 1  # type: ignore[union-attr]
    engine.run_until_idle()
    assert engine.requests[1].status is RequestStatus.FINISHED
    assert engine.requests[2].status is RequestStatus.FINISHED


def test_once_its_discarded_step_is_applied_a_recomputed_reader_owes_its_tokens_again() -> None:
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM, 1]).build(0))
    engine.plan()  # step 0 writes the system prompt's blocks
    engine.submit(spec([*SYSTEM, 2]).build(1))
    engine.plan()  # step 1 admits request 1 on them
    engine.complete(failure="device lost")  # step 0 fails: request 1 is recomputed
    assert engine.complete().new_tokens == ()  # step 1: its sample is discarded
    plan = scheduler.schedule()  # step 2 recomputes request 1 and samples
    assert plan is not None
    assert [(row.request_id, row.sample) for row in plan.requests] == [(1, True)]
    # Its sample of step 2 is owed: an outcome without it is refused, not taken as a discard.
    with pytest.raises(SchedulerError, match=r"^step 2 outcome lacks tokens for \[1\]$"):
        scheduler.apply(RunnerOutput(2, {}))
    assert scheduler.num_inflight_steps == 1


def test_a_recomputed_reader_still_in_flight_waits_without_holding_up_the_running() -> None:
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM, 1]).build(0))
    engine.plan()  # step 0 writes the system prompt's blocks
    engine.submit(spec([*SYSTEM, 2]).build(1))
    engine.submit(spec([90, 91, 92]).build(2))
    engine.plan()  # step 1: request 1 on those blocks, request 2 on its own
    engine.complete(failure="device lost")  # step 0 fails: request 1 is recomputed
    # Request 1 heads the waiting queue but step 1 still owes it a (discarded) sample: it
    # waits, and the running request 2 is planned all the same.
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.request_ids == (2,)
    assert scheduler.statistics().num_inflight_steps == 2


def test_a_failure_without_prefix_caching_fails_only_its_own_requests() -> None:
    scheduler = Scheduler(config(enable_prefix_caching=False))
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM, 1]).build(0))
    engine.plan()
    engine.submit(spec([*SYSTEM, 2]).build(1))
    engine.plan()
    assert engine.complete(failure="device lost").failed == (0,)
    engine.run_until_idle()


def test_preemption_counts_only_deferred_blocks_that_come_back() -> None:
    # Request 1 shares request 0's prompt blocks. Cancelling request 0 while its step is in
    # flight defers its releases, but the shared blocks stay with request 1: they must not
    # count as coming back.
    scheduler = Scheduler(config(num_blocks=8, block_size=4, max_model_len=32))
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM[:16], 1], max_tokens=8).build(0))
    engine.plan()
    engine.submit(spec([*SYSTEM[:16], 2], max_tokens=8).build(1))
    engine.plan()
    engine.cancel(0)
    assert scheduler._num_returning_blocks() == 1  # only request 0's own last block
    engine.run_until_idle()


def test_prefix_cache_invariants_notice_a_wrong_block() -> None:
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM, 1]).build(0))
    engine.submit(spec([9] * 8 + [1]).build(1))
    engine.plan()
    first, second = scheduler.get(0), scheduler.get(1)
    assert first is not None
    assert second is not None
    second._block_table[0] = first.block_table[0]  # a wrong hit
    with pytest.raises(
        AssertionError, match=r"^<Request 1 .*> holds block \d+ at 0, cached for another prefix$"
    ):
        PrefixCache.check_invariants(scheduler._prefix, [second])


def test_prefix_cache_invariants_notice_a_live_request_forgotten() -> None:
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM, 1]).build(0))
    engine.plan()  # the plan is complete: request 0's full blocks are cached
    request = scheduler.get(0)
    assert request is not None
    block_id = request.block_table[0]
    assert scheduler.pool.block_hash(block_id) is not None
    scheduler.check_invariants()
    scheduler._prefix.drop(0)  # the bug: forgetting a request that is still running
    with pytest.raises(
        AssertionError,
        match=f"^{re.escape(repr(request))} holds block {block_id} at 0, cached for another "
        "prefix$",
    ):
        scheduler.check_invariants()


def test_enable_prefix_caching_is_validated() -> None:
    with pytest.raises(TypeError, match=r"^enable_prefix_caching must be a bool, got int 1$"):
        config(enable_prefix_caching=1)


def test_eviction_takes_the_leaves_of_an_ended_request_first() -> None:
    # Request 0's three blocks are cached when it ends (released deepest first). A request
    # that needs one block evicts the deepest, so the first two still hit.
    scheduler = Scheduler(config(num_blocks=3, block_size=2, max_model_len=7))
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([1, 2, 3, 4, 5, 6], max_tokens=1).build(0))
    engine.run_until_idle()
    assert scheduler.pool.num_cached == 3
    engine.submit(spec([9], max_tokens=1).build(1))  # one new block: an eviction
    engine.run_until_idle()
    assert scheduler.pool.num_cached == 2
    engine.submit(spec([1, 2, 3, 4, 5], max_tokens=1).build(2))
    engine.run_until_idle()
    assert engine.requests[2].num_cached_tokens == 4


def test_a_reader_that_already_ended_is_not_failed_twice() -> None:
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM, 1]).build(0))
    engine.plan()
    engine.submit(spec([*SYSTEM, 2]).build(1))
    engine.plan()  # request 1 reads step 0's blocks ...
    engine.cancel(1)  # ... and is cancelled before step 0 fails
    assert engine.complete(failure="device lost").failed == (0,)
    assert engine.requests[1].status is RequestStatus.CANCELLED
    engine.run_until_idle()


def test_cached_blocks_count_as_free() -> None:
    pool, _ = cached_pool()
    assert pool.num_free == 4
    with pytest.raises(SchedulerError, match=r"^can't allocate 5 blocks: only 4 are free$"):
        pool.allocate(5)
    assert len(pool.allocate(4)) == 4


def test_a_failed_step_uncaches_what_its_readers_write_after_it() -> None:
    # Request 1 reads step 0's blocks and writes a full block of its own in step 1; request
    # 0 continues in step 1 from its own (garbage) KV. Neither's step 1 KV may stay cached.
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM, 1, 2, 3, 4, 5]).build(0))
    engine.plan()
    engine.submit(spec([*SYSTEM, 6, 7, 8, 9, 10]).build(1))
    step_1 = engine.plan()
    assert step_1 is not None
    own = scheduler.get(1).block_table[5]  # type: ignore[union-attr]
    assert scheduler.pool.block_hash(own) is not None  # written by step 1, matchable
    engine.complete(failure="device lost")
    for entry in step_1.requests:
        assert [scheduler.pool.block_hash(b) for b in entry.block_table] == [None] * len(
            entry.block_table
        )
    engine.run_until_idle()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_failure_looks_back_one_step_only(enabled: bool) -> None:
    # With at most MAX_PIPELINE_DEPTH steps in flight, one plan at most follows a failed one.
    cache = PrefixCache(BlockPool(4, 2), enabled=enabled)
    failed = StepPlan(0, ())
    later = [StepPlan(step, (), planned_behind=step - 1) for step in (1, 2)]
    assert len(later) == MAX_PIPELINE_DEPTH
    with pytest.raises(AssertionError, match=r"^2 steps in flight after a failed one$"):
        cache.distrust(failed, later)
    assert cache.distrust(failed, later[:1]) == set()


def test_prefix_cache_invariants_notice_a_removed_request_kept() -> None:
    scheduler = Scheduler(config())
    engine = SimulatedEngine(scheduler)
    engine.submit(spec([*SYSTEM, 1], max_tokens=1).build(0))
    engine.run_until_idle()
    scheduler._prefix._hashes[0] = []  # a leak: request 0 is gone
    with pytest.raises(AssertionError, match=r"^a removed request is kept$"):
        scheduler.check_invariants()


def corrupted(change: str) -> BlockPool:
    """A pool whose bookkeeping ``change`` broke, as a bug would."""
    pool, _ = cached_pool()  # blocks 0 and 1 cached, 2 and 3 empty
    if change == "free twice":
        pool._free.append(pool._free[0])
    elif change == "empty and cached":
        pool._free.append(0)
    elif change == "used and free":
        pool._ref_counts[2] = 1
    else:
        pool._by_hash[b"stray"] = 3
    return pool


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("free twice", "a block is on the free list twice"),
        ("empty and cached", "a block is both empty and cached"),
        ("used and free", "block 2 has 1 references but is on the free list"),
        ("stray hash", "hashes and blocks are not a bijection"),
    ],
)
def test_pool_invariants_name_what_broke(change: str, message: str) -> None:
    with pytest.raises(AssertionError, match=f"^{re.escape(message)}$"):
        corrupted(change).check_invariants()


class Clock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pinned(prompt: list[int], ttl: float, max_tokens: int = 4) -> RequestSpec:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_ttl=ttl)
    return RequestSpec(prompt, params)


def _conversation_hit(ttl: float) -> tuple[int, int]:
    """A finished turn, then two unrelated requests that each fill most of the pool, then
    the turn's continuation: the continuation's cached tokens, and the blocks pinned while
    the unrelated ones ran."""
    scheduler = Scheduler(config(num_blocks=8, block_size=4), clock=Clock())
    engine = SimulatedEngine(scheduler)
    turn = list(range(1, 13))  # three blocks
    engine.submit(pinned(turn, ttl).build(0))
    engine.run_until_idle()
    answer = engine.streams[0]
    during = 0
    for request_id, first in ((1, 100), (2, 200)):  # 5 blocks each, newer than the turn's
        engine.submit(pinned(list(range(first, first + 16)), 0).build(request_id))
        engine.run_until_idle()
        during = max(during, len(scheduler.pinned_blocks))
    engine.submit(pinned([*turn, *answer, 7], 0).build(3))
    engine.run_until_idle()
    return engine.requests[3].num_cached_tokens, during


def test_a_pinned_turn_is_not_evicted_by_other_requests_cached_blocks() -> None:
    # Without a pin the two unrelated requests evict the turn's blocks (the least recently
    # used); pinned, its three full blocks (the prompt's 12 tokens) stay for the next turn.
    assert _conversation_hit(0) == (0, 0)
    assert _conversation_hit(60) == (12, 3)


def test_pins_end_with_their_time_or_give_way_to_any_request() -> None:
    clock = Clock()
    scheduler = Scheduler(config(num_blocks=8, block_size=4), clock=clock)
    engine = SimulatedEngine(scheduler)
    engine.submit(pinned(list(range(1, 13)), 10).build(0))
    engine.submit(pinned(list(range(20, 28)), 30).build(1))
    engine.run_until_idle()
    assert len(scheduler.pinned_blocks) == 3 + 2
    clock.now = 10.0
    assert engine.plan() is None  # nothing to run; the first pin's time is up
    assert len(scheduler.pinned_blocks) == 2
    assert scheduler.pool.num_free == 6
    # A request that needs the whole pool takes the pinned blocks too: a pin delays no one.
    engine.submit(pinned(list(range(40, 69)), 0, max_tokens=3).build(2))
    plan = engine.plan()
    assert plan is not None
    assert [entry.request_id for entry in plan.requests] == [2]
    assert scheduler.pinned_blocks == ()
    engine.run_until_idle()


def test_only_a_finished_request_pins_and_only_with_prefix_caching() -> None:
    scheduler = Scheduler(config(), clock=Clock())
    engine = SimulatedEngine(scheduler)
    engine.submit(pinned(list(range(1, 13)), 60, max_tokens=8).build(0))
    engine.plan()
    engine.complete()
    engine.cancel(0)
    engine.run_until_idle()
    assert scheduler.pinned_blocks == ()
    plain = Scheduler(config(enable_prefix_caching=False), clock=Clock())
    engine = SimulatedEngine(plain)
    engine.submit(pinned(list(range(1, 13)), 60).build(0))
    engine.run_until_idle()
    assert plain.pinned_blocks == ()
    assert plain.pool.num_free == plain.config.num_blocks


def test_cache_ttl_is_checked() -> None:
    assert SamplingParams(cache_ttl=3600).cache_ttl == 3600
    with pytest.raises(ValueError, match=r"cache_ttl must be .*3600.*got 3601"):
        SamplingParams(cache_ttl=3601)
    with pytest.raises(ValueError, match=r"cache_ttl must be .*got -1"):
        SamplingParams(cache_ttl=-1)
