"""The KV block pool: a fixed number of fixed-size blocks, handed out by reference count.

A block is free when its reference count is zero. Counting references (rather than owners)
is what lets a prefix cache share one block between requests later; today every block has
one owner. The free list is FIFO so allocation order is deterministic.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import attrs

from twostroke.states.errors import SchedulerError
from twostroke.states.validators import check_int_at_least

__all__ = ["BlockPool", "BlockPoolStatistics", "blocks_for"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` positions."""
    return -(-num_tokens // block_size)


@attrs.frozen
class BlockPoolStatistics:
    """A snapshot of one block pool, taken by :meth:`BlockPool.statistics`."""

    #: Blocks in the pool (free + used).
    num_blocks: int
    #: Token positions per block.
    block_size: int
    #: Blocks with no reference, ready to allocate.
    num_free: int
    #: Blocks with at least one reference.
    num_used: int
    #: Blocks with more than one reference (shared between requests).
    num_shared: int


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` positions each.

    Args:
        num_blocks: How many blocks exist (>= 1).
        block_size: Token positions per block (>= 1).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        check_int_at_least("num_blocks", num_blocks, 1)
        check_int_at_least("block_size", block_size, 1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        """How many references block ``block_id`` has (0: it is free).

        Raises:
            SchedulerError: there is no such block (a negative id would otherwise silently
                read another block's count).
        """
        if not 0 <= block_id < self.num_blocks:
            raise SchedulerError(f"no block {block_id}: block ids are in [0, {self.num_blocks})")
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> tuple[int, ...]:
        """Take ``num_blocks`` free blocks, each with one reference.

        Raises:
            SchedulerError: fewer than ``num_blocks`` blocks are free (check first with
                :meth:`can_allocate`); nothing is taken.
        """
        check_int_at_least("num_blocks", num_blocks, 0)
        if num_blocks > len(self._free):
            raise SchedulerError(
                f"can't allocate {num_blocks} blocks: only {len(self._free)} are free"
            )
        block_ids = tuple(self._free.popleft() for _ in range(num_blocks))
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add one reference to blocks that are already in use (sharing them)."""
        block_ids = tuple(block_ids)
        for block_id in block_ids:
            self._check_used(block_id, "retain")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block with none left becomes free.

        Raises:
            SchedulerError: a block is already free (a double free); nothing is released.
        """
        block_ids = tuple(block_ids)
        drops = collections.Counter(block_ids)
        for block_id, count in drops.items():
            self._check_used(block_id, "release")
            if count > self._ref_counts[block_id]:
                raise SchedulerError(
                    f"can't release block {block_id} {count} times: "
                    f"it has {self._ref_counts[block_id]} references"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def _check_used(self, block_id: int, action: str) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise SchedulerError(f"can't {action} block {block_id}: no such block")
        if self._ref_counts[block_id] == 0:
            raise SchedulerError(f"can't {action} block {block_id}: it is free")

    def statistics(self) -> BlockPoolStatistics:
        used = self.num_blocks - len(self._free)
        shared = sum(1 for count in self._ref_counts if count > 1)
        return BlockPoolStatistics(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free=len(self._free),
            num_used=used,
            num_shared=shared,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the pool's own bookkeeping is inconsistent."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has {count} references"
            assert (count == 0) == (block_id in free), (
                f"block {block_id} has {count} references but is "
                f"{'' if block_id in free else 'not '}on the free list"
            )

    def __repr__(self) -> str:
        return f"<BlockPool {len(self._free)}/{self.num_blocks} free, block_size={self.block_size}>"
