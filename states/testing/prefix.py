"""A hypothesis state machine for the prefix cache of the block pool, and its reference model.

The model is as plain as a prefix cache can be: a dict from a token prefix (a tuple of ids,
a whole number of blocks long) to the block that holds its last block's KV, beside reference
counts, a FIFO list of empty blocks and an eviction list of cached ones. The machine drives
:class:`~twostroke.states.blocks.BlockPool` the way the scheduler does (look a prompt up,
claim the hits, allocate the rest, cache the full blocks, release deepest first) and compares
every answer and every block's state with the model. Test support: imports hypothesis.
"""

from __future__ import annotations

import collections
import sys
from typing import ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from twostroke.states.blocks import (
    ROOT_HASH,
    BlockPool,
    BlockState,
    block_hashes,
    blocks_for,
)
from twostroke.states.simulation import SimulationError

__all__ = ["PrefixCacheMachine", "PrefixModel"]


class PrefixModel:
    """A prefix cache as a dict from token prefixes to blocks.

    Args:
        num_blocks: How many blocks exist.
        block_size: Positions per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.refs = dict.fromkeys(range(num_blocks), 0)
        self.empty = collections.deque(range(num_blocks))
        self.cached: list[int] = []  # least recently released first
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.block_of: dict[tuple[int, ...], int] = {}
        self.queried = 0
        self.hits = 0

    def match(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        """The blocks of the longest cached whole-block prefix, leaving the last token."""
        found = []
        for index in range((len(prompt) - 1) // self.block_size):
            block_id = self.block_of.get(prompt[: (index + 1) * self.block_size])
            if block_id is None:
                break
            found.append(block_id)
        return tuple(found)

    def num_free(self) -> int:
        return len(self.empty) + len(self.cached)

    def claim(self, block_ids: tuple[int, ...], num_queried: int) -> None:
        for block_id in block_ids:
            if not self.refs[block_id]:
                self.cached.remove(block_id)
            self.refs[block_id] += 1
        self.queried += num_queried
        self.hits += len(block_ids) * self.block_size

    def allocate(self, count: int) -> tuple[int, ...]:
        taken = []
        for _ in range(count):
            if self.empty:
                block_id = self.empty.popleft()
            else:
                block_id = self.cached.pop(0)
                self._drop(block_id)
            self.refs[block_id] = 1
            taken.append(block_id)
        return tuple(taken)

    def cache(self, block_id: int, prefix: tuple[int, ...]) -> None:
        if prefix not in self.block_of:
            self.block_of[prefix] = block_id
            self.prefix_of[block_id] = prefix

    def release(self, block_ids: tuple[int, ...]) -> None:
        for block_id in block_ids:
            self.refs[block_id] -= 1
            if self.refs[block_id]:
                continue
            if block_id in self.prefix_of:
                self.cached.append(block_id)
            else:
                self.empty.append(block_id)

    def forget(self, block_id: int) -> None:
        if block_id not in self.prefix_of:
            return
        self._drop(block_id)
        if not self.refs[block_id]:
            self.cached.remove(block_id)
            self.empty.append(block_id)

    def state(self, block_id: int) -> BlockState:
        if self.refs[block_id]:
            return BlockState.IN_USE
        return BlockState.CACHED if block_id in self.prefix_of else BlockState.EMPTY

    def _drop(self, block_id: int) -> None:
        del self.block_of[self.prefix_of.pop(block_id)]


@attrs.define
class _Holder:
    """A request's prompt and block table, as the machine handed them out."""

    prompt: tuple[int, ...]
    table: tuple[int, ...]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Drives a :class:`BlockPool` with its prefix cache beside a :class:`PrefixModel`.

    Prompts start with one of a few shared prefixes (or one of an earlier prompt's), so
    hits, shared blocks, eviction of cached blocks and duplicates computed twice all
    happen on a pool of a handful of blocks. Checked after every rule: every block is in
    the state the model says, empty + cached + in use == total, hash and block are a
    bijection and each hash is that of the prefix its block holds, every hit's stored
    tokens are the prompt's and hits are prefixes, blocks in use are never evicted, the
    query and hit counters equal the totals; at teardown, with every holder gone, nothing
    is in use.

    Class attributes to override in a subclass:
        sizes: Strategy for ``(num_blocks, block_size)``.
        vocab_size: Token ids lie in ``range(vocab_size)`` (small, so prefixes repeat).
    """

    sizes: ClassVar[st.SearchStrategy[tuple[int, int]]] = st.tuples(
        st.integers(1, 8), st.integers(1, 3)
    )
    vocab_size: ClassVar[int] = 3

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(1, 1)
        self.model = PrefixModel(1, 1)
        self.holders: list[_Holder] = []
        self.prompts: list[tuple[int, ...]] = []

    @initialize(data=st.data())
    def create(self, data: st.DataObject) -> None:
        num_blocks, block_size = data.draw(self.sizes, label="sizes")
        self.pool = BlockPool(num_blocks, block_size)
        self.model = PrefixModel(num_blocks, block_size)

    def _prompt(self, data: st.DataObject) -> tuple[int, ...]:
        size = self.pool.block_size
        tokens = st.lists(st.integers(0, self.vocab_size - 1), max_size=3 * size + 1)
        head: tuple[int, ...] = ()
        share: bool = bool(self.prompts) and data.draw(st.booleans(), label="share")
        if share:
            earlier: tuple[int, ...] = data.draw(st.sampled_from(self.prompts), label="earlier")
            head = earlier[: data.draw(st.integers(0, len(earlier)), label="shared")]
        prompt = head + tuple(data.draw(tokens, label="tail"))
        return prompt or (0,)

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Look a prompt up, claim its hits, allocate and cache the rest (if it fits)."""
        pool, model = self.pool, self.model
        prompt = self._prompt(data)
        self.prompts.append(prompt)
        hashes = block_hashes(prompt, pool.block_size)
        hits = pool.match_prefix(prompt, hashes)
        expected = model.match(prompt)
        if hits != expected:
            raise SimulationError(f"match_prefix({prompt}) = {hits}, reference {expected}")
        size = pool.block_size
        for index, block_id in enumerate(hits):
            if model.prefix_of[block_id] != prompt[: (index + 1) * size]:
                raise SimulationError(f"hit block {block_id} holds another prefix")
        needed = blocks_for(len(prompt), size) - len(hits)
        reclaimed = sum(1 for block_id in hits if not model.refs[block_id])
        if needed + reclaimed > model.num_free():
            return  # does not fit: the scheduler would leave it waiting, claiming nothing
        pool.claim_prefix(hits, len(prompt))
        model.claim(hits, len(prompt))
        table = hits + pool.allocate(needed)
        if table[len(hits) :] != model.allocate(needed):
            raise SimulationError(f"allocate({needed}) took {table[len(hits) :]}, not the model's")
        for index in range(len(hits), len(prompt) // size):
            parent = hashes[index - 1] if index else ROOT_HASH
            tokens = prompt[index * size : (index + 1) * size]
            if pool.cache(table[index], parent, tokens) != hashes[index]:
                raise SimulationError(f"cache() of block {table[index]} returned another hash")
            model.cache(table[index], prompt[: (index + 1) * size])
        self.holders.append(_Holder(prompt, table))

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """A holder ends: its blocks go back deepest first."""
        holder = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        deepest_first = holder.table[::-1]
        self.pool.release(deepest_first)
        self.model.release(deepest_first)

    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        """A step that wrote some blocks failed: their hashes go."""
        block_ids = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=3))
        self.pool.forget(block_ids)
        for block_id in block_ids:
            self.model.forget(block_id)

    @invariant()
    def agrees_with_the_model(self) -> None:
        pool, model = self.pool, self.model
        pool.check_invariants()
        states = [pool.state(b) for b in range(pool.num_blocks)]
        expected = [model.state(b) for b in range(pool.num_blocks)]
        if states != expected:
            raise SimulationError(f"block states {states} != reference {expected}")
        stats = pool.statistics()
        counts = collections.Counter(states)
        if (stats.num_free_blocks, stats.num_cached_blocks) != (
            model.num_free(),
            len(model.cached),
        ):
            raise SimulationError(f"{stats} != reference free {model.num_free()}")
        if (
            stats.num_free_blocks + stats.num_used_blocks != stats.num_blocks
            or stats.num_used_blocks != counts[BlockState.IN_USE]
        ):
            raise SimulationError(f"blocks not conserved: {stats}")
        for block_id in range(pool.num_blocks):
            block_hash = pool.block_hash(block_id)
            prefix = model.prefix_of.get(block_id)
            if (block_hash is None) != (prefix is None):
                raise SimulationError(f"block {block_id}: hash {block_hash!r}, prefix {prefix}")
            if prefix is not None and block_hash != block_hashes(prefix, pool.block_size)[-1]:
                raise SimulationError(f"block {block_id}'s hash is not that of {prefix}")
        if (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) != (
            model.queried,
            model.hits,
        ):
            raise SimulationError(f"counters {stats} != reference {model.queried, model.hits}")
        held = collections.Counter(b for holder in self.holders for b in holder.table)
        for block_id in range(pool.num_blocks):
            if pool.ref_count(block_id) != held[block_id]:
                raise SimulationError(f"block {block_id} was evicted or leaked while held")

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return  # a rule failed: report that, not a teardown error
        for holder in self.holders:
            self.pool.release(holder.table[::-1])
        self.holders = []
        if self.pool.statistics().num_used_blocks:
            raise SimulationError(f"idle but blocks are in use: {self.pool!r}")
