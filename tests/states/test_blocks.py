"""The KV block pool: a stateful test against reference counts, and pinned messages."""

from __future__ import annotations

import pathlib
import re

import pytest

from twostroke.states.blocks import (
    BLOCK_TRANSITIONS,
    ROOT_HASH,
    BlockPool,
    BlockPoolStatistics,
    BlockState,
    block_hashes,
    block_mermaid_diagram,
    blocks_for,
)
from twostroke.states.errors import EngineError, SchedulerError
from twostroke.states.testing import BlockPoolMachine

TestBlockPool = BlockPoolMachine.TestCase


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "blocks"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (7, 1, 7), (1, 16, 1)],
)
def test_blocks_for(num_tokens: int, block_size: int, blocks: int) -> None:
    assert blocks_for(num_tokens, block_size) == blocks


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    counts = tuple(pool.ref_count(b) for b in range(pool.num_blocks))
    return counts, pool.statistics()


def test_allocation_is_fifo_and_freed_blocks_go_to_the_back() -> None:
    pool = BlockPool(4, 16)
    assert pool.allocate(2) == (0, 1)
    pool.release([0])
    assert pool.allocate(2) == (2, 3)
    assert pool.allocate(1) == (0,)
    assert repr(pool) == "<BlockPool 0/4 free (0 cached), block_size=16>"
    assert pool.statistics() == BlockPoolStatistics(
        num_blocks=4,
        block_size=16,
        num_free_blocks=0,
        num_used_blocks=4,
        num_shared_blocks=0,
        num_cached_blocks=0,
        num_prefix_cache_queries=0,
        num_prefix_cache_hits=0,
    )


def test_a_shared_block_is_free_only_when_its_last_reference_goes() -> None:
    pool = BlockPool(2, 4)
    (block,) = pool.allocate(1)
    pool.retain([block, block])
    assert pool.ref_count(block) == 3
    assert pool.statistics().num_shared_blocks == 1
    pool.release([block, block])
    assert pool.ref_count(block) == 1
    assert pool.num_free == 1
    pool.release([block])
    assert pool.ref_count(block) == 0
    assert pool.num_free == 2
    pool.check_invariants()


REFUSALS = [
    ("allocate", 3, SchedulerError, "can't allocate 3 blocks: only 2 are free"),
    ("allocate", -1, ValueError, "num_blocks must be >= 0, got -1"),
    ("release", [2], SchedulerError, "can't release block 2: it is free"),
    ("release", [0, 2], SchedulerError, "can't release block 2: it is free"),
    ("release", [0, 0], SchedulerError, "can't release block 0 2 times: it has 1 references"),
    ("release", [4], SchedulerError, "can't release block 4: no such block"),
    ("release", [-1], SchedulerError, "can't release block -1: no such block"),
    ("retain", [1, 3], SchedulerError, "can't retain block 3: it is free"),
    ("retain", [9], SchedulerError, "can't retain block 9: no such block"),
    ("ref_count", -1, SchedulerError, "no block -1: block ids are in [0, 4)"),
    ("ref_count", 4, SchedulerError, "no block 4: block ids are in [0, 4)"),
]


@pytest.mark.parametrize(("method", "argument", "error", "message"), REFUSALS)
def test_refusals_name_the_rule_and_change_nothing(
    method: str, argument: object, error: type[Exception], message: str
) -> None:
    pool = BlockPool(4, 2)
    pool.allocate(2)  # blocks 0 and 1 are used, 2 and 3 free
    before = snapshot(pool)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        getattr(pool, method)(argument)
    assert snapshot(pool) == before
    pool.check_invariants()


def test_a_double_free_is_refused_with_nothing_released() -> None:
    pool = BlockPool(3, 2)
    blocks = pool.allocate(3)
    pool.release(blocks[:1])
    with pytest.raises(SchedulerError, match="it is free") as caught:
        pool.release(blocks)  # 1 and 2 are held, 0 is already free
    assert isinstance(caught.value, EngineError)
    assert [pool.ref_count(b) for b in blocks] == [0, 1, 1]


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "error", "message"),
    [
        (0, 16, ValueError, "num_blocks must be >= 1, got 0"),
        (4, 0, ValueError, "block_size must be >= 1, got 0"),
        (4.0, 16, TypeError, "num_blocks must be an int, got float 4.0"),
        (4, True, TypeError, "block_size must be an int, got bool True"),
    ],
)
def test_pool_sizes_are_validated(
    num_blocks: int, block_size: int, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        BlockPool(num_blocks, block_size)


def test_check_invariants_notices_corruption() -> None:
    pool = BlockPool(2, 2)
    pool.allocate(1)
    pool._ref_counts[0] = 0  # a leak: neither referenced nor on the free list
    with pytest.raises(AssertionError, match="block 0 has 0 references but is not on the free"):
        pool.check_invariants()


# --- the block lifecycle diagram --------------------------------------------------------------

DOCS = pathlib.Path(__file__).parents[2] / "docs" / "states.md"


def test_the_block_diagram_draws_every_transition() -> None:
    lines = block_mermaid_diagram().splitlines()
    assert lines[:2] == ["stateDiagram-v2", "    [*] --> EMPTY"]
    drawn: dict[str, dict[str, str]] = {str(state): {} for state in BlockState}
    for line in lines[2:]:
        source, _, rest = line.strip().partition(" --> ")
        target, _, operations = rest.partition(": ")
        for operation in operations.split(", "):
            drawn[source][operation] = target
    expected = {
        str(state): {op: str(to) for op, to in row.items()}
        for state, row in BLOCK_TRANSITIONS.items()
    }
    assert drawn == expected


def test_the_docs_show_the_block_diagram_of_the_code() -> None:
    blocks = re.findall(r"```mermaid\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert blocks[1].rstrip("\n") == block_mermaid_diagram(), (
        "docs/states.md is out of date: paste the output of "
        "twostroke.states.blocks.block_mermaid_diagram() into its second mermaid block"
    )


# --- the prefix cache, one refusal and one edge at a time ---------------------------------------


def cached_pool() -> tuple[BlockPool, tuple[int, ...], list[bytes]]:
    """A pool of 4 blocks of 2 whose blocks 0 and 1 hold [1, 2 | 3, 4], cached and released."""
    pool = BlockPool(4, 2)
    blocks = pool.allocate(2)
    hashes = block_hashes([1, 2, 3, 4], 2)
    assert pool.cache(blocks[0], ROOT_HASH, [1, 2]) == hashes[0]
    assert pool.cache(blocks[1], hashes[0], [3, 4]) == hashes[1]
    pool.release(blocks[::-1])
    return pool, blocks, hashes


def test_cached_blocks_count_as_free_and_are_allocated() -> None:
    pool, _, _ = cached_pool()
    assert pool.num_free == 4
    pool.allocate(3)  # the two empty blocks, then the least recently released cached one
    assert pool.num_free == 1
    with pytest.raises(SchedulerError, match=r"^can't allocate 2 blocks: only 1 are free$"):
        pool.allocate(2)
    assert len(pool.allocate(1)) == 1


def test_block_hash_names_the_prefix_a_block_holds() -> None:
    pool, blocks, hashes = cached_pool()
    assert [pool.block_hash(b) for b in blocks] == hashes
    assert pool.block_hash(2) is None
    with pytest.raises(SchedulerError, match=r"^no block 4: block ids are in \[0, 4\)$"):
        pool.block_hash(4)


def test_cache_refuses_a_block_that_is_not_full() -> None:
    pool = BlockPool(2, 2)
    (block,) = pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(SchedulerError, match=r"^can't cache block 0: it needs 2 tokens, got 1$"):
        pool.cache(block, ROOT_HASH, [7])
    assert snapshot(pool) == before
    assert pool.block_hash(block) is None


def test_cache_refuses_to_rename_a_cached_block_but_repeats_are_harmless() -> None:
    pool = BlockPool(2, 2)
    (block,) = pool.allocate(1)
    first = pool.cache(block, ROOT_HASH, [7, 8])
    assert pool.cache(block, ROOT_HASH, [7, 8]) == first
    with pytest.raises(SchedulerError, match=r"^can't cache block 0: it holds another prefix$"):
        pool.cache(block, ROOT_HASH, [7, 9])
    assert pool.block_hash(block) == first


def test_match_prefix_verifies_every_block_and_leaves_the_last_token() -> None:
    pool, blocks, hashes = cached_pool()
    # Both blocks match a longer sequence; exactly four tokens leave the last block out.
    assert pool.match_prefix([1, 2, 3, 4, 5], hashes) == blocks
    assert pool.match_prefix([1, 2, 3, 4], hashes) == blocks[:1]
    # A hash that names a cached block whose tokens differ (a collision, or a caller's wrong
    # hash) ends the match: the block is never trusted.
    assert pool.match_prefix([1, 2, 3, 9, 5], hashes) == blocks[:1]
    assert pool.match_prefix([9, 2, 3, 4, 5], hashes) == ()
    # The same tokens under another parent are another prefix.
    assert pool.match_prefix([3, 4, 5], hashes[1:]) == ()
    assert pool.statistics().num_prefix_cache_queries == 0  # looking changes nothing


def test_claim_prefix_refuses_a_block_that_holds_nothing() -> None:
    pool, blocks, _ = cached_pool()
    before = snapshot(pool)
    with pytest.raises(SchedulerError, match=r"^can't claim block 2: it holds no prefix$"):
        pool.claim_prefix([blocks[0], 2], 5)
    assert snapshot(pool) == before
    pool.claim_prefix(blocks, 5)
    assert [pool.ref_count(b) for b in blocks] == [1, 1]
    # A block in use is shared by the next request that matches it.
    pool.claim_prefix(blocks[:1], 3)
    assert [pool.ref_count(b) for b in blocks] == [2, 1]
    assert pool.statistics().num_shared_blocks == 1
    assert pool.statistics().num_prefix_cache_queries == 5 + 3
    assert pool.statistics().num_prefix_cache_hits == 4 + 2
    pool.check_invariants()


def test_forget_empties_a_cached_block_and_uncaches_one_in_use() -> None:
    pool, blocks, hashes = cached_pool()
    pool.claim_prefix(blocks[:1], 3)  # block 0 in use again, block 1 still cached
    pool.forget([*blocks, 3])  # block 3 holds no hash: left as it is
    assert [pool.state(b) for b in blocks] == [BlockState.IN_USE, BlockState.EMPTY]
    assert [pool.block_hash(b) for b in blocks] == [None, None]
    assert pool.num_cached == 0
    assert pool.num_free == 3
    assert pool.match_prefix([1, 2, 3, 4, 5], hashes) == ()
    pool.check_invariants()
