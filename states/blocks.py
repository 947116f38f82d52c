"""The KV block pool and its prefix cache: fixed-size blocks handed out by reference count.

Every block is in exactly one of three states (:class:`BlockState`):

* **in use**: one or more references (a request's block table, a deferred release);
* **cached**: no reference, but it holds the KV of a full block of known tokens under a
  hash, so a later request with the same prefix can take it back instead of computing it.
  Cached blocks wait in least-recently-released order and are *evictable*;
* **empty**: no reference and no hash.

Allocation takes empty blocks first (FIFO, so the order is deterministic), then evicts the
least recently released cached block and drops its hash. Both kinds count as *free*
(:attr:`BlockPool.num_free`): the scheduler may allocate either. Callers release a request's
blocks deepest first, so eviction takes the leaves of a prefix before their parents.

A full block's hash chains its parent's, ``h_i = sha256(h_{i-1}, tokens of block i)`` from a
fixed root (:data:`ROOT_HASH`), so separate processes agree on it. The block keeps its tokens
and its parent's hash, and :meth:`BlockPool.match_prefix` compares both: a hit is verified,
never trusted. Every move between states is a row of :data:`BLOCK_TRANSITIONS`, from which
the docs' lifecycle diagram is drawn (:func:`block_mermaid_diagram`).
"""

from __future__ import annotations

import collections
import enum
import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence

import attrs

from twostroke.states.errors import SchedulerError
from twostroke.states.validators import check_int_at_least

__all__ = [
    "BLOCK_TRANSITIONS",
    "ROOT_HASH",
    "BlockHash",
    "BlockPool",
    "BlockPoolStatistics",
    "BlockState",
    "block_hashes",
    "block_mermaid_diagram",
    "blocks_for",
    "hash_block",
]

#: A block's chained content hash (32 bytes of sha256).
BlockHash = bytes

#: The parent hash of a sequence's first block: fixed, so every process computes the same.
ROOT_HASH: BlockHash = hashlib.sha256(b"twostroke prefix cache v1").digest()


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` positions."""
    return -(-num_tokens // block_size)


def hash_block(parent: BlockHash, token_ids: Sequence[int], salt: bytes = b"") -> BlockHash:
    """The hash of one full block: its parent's hash, its tokens and an optional salt.

    sha256, not Python's ``hash``: the value must not depend on the process (hash
    randomization), so that replicas of one model agree on which prefix a block holds.

    Args:
        parent: The hash of the block before it (:data:`ROOT_HASH` for the first block).
        token_ids: The block's token ids (each in ``[-2**63, 2**63)``).
        salt: Bytes that separate caches which must not share (e.g. per tenant).

    Returns:
        32 bytes.
    """
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(salt)
    return digest.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, start: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """The chained hashes of every full block of ``token_ids``.

    Args:
        token_ids: The sequence (prompt, then output).
        block_size: Positions per block.
        start: Hashes already computed for the first blocks (they are kept, not redone).

    Returns:
        One hash per full block, ``start`` first.
    """
    hashes = list(start)
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        block = token_ids[index * block_size : (index + 1) * block_size]
        hashes.append(hash_block(parent, block))
    return hashes


class BlockState(enum.Enum):
    """Where a block is in its life."""

    EMPTY = "empty"
    IN_USE = "in use"
    CACHED = "cached"

    def __str__(self) -> str:
        return self.name


_E, _U, _C = BlockState.EMPTY, BlockState.IN_USE, BlockState.CACHED

#: Every move of a block: ``BLOCK_TRANSITIONS[state][operation]`` is the next state.
#: ``release`` drops one of several references; ``release_last`` drops the last one of an
#: uncached block, ``release_cached`` that of a block with a hash.
BLOCK_TRANSITIONS: Mapping[BlockState, Mapping[str, BlockState]] = {
    _E: {"allocate": _U},
    _U: {
        "retain": _U,
        "cache": _U,
        "forget": _U,
        "release": _U,
        "release_last": _E,
        "release_cached": _C,
    },
    _C: {"hit": _U, "evict": _U, "forget": _E},
}


def block_mermaid_diagram() -> str:
    """The block lifecycle as a Mermaid ``stateDiagram-v2``, drawn from :data:`BLOCK_TRANSITIONS`.

    ``docs/states.md`` pastes it and a test fails when the two diverge.

    Returns:
        The diagram source, one statement per line, without a trailing newline.
    """
    lines = ["stateDiagram-v2", f"    [*] --> {_E}"]
    for state, row in BLOCK_TRANSITIONS.items():
        arrows: dict[BlockState, list[str]] = {}
        for operation, target in row.items():
            arrows.setdefault(target, []).append(operation)
        lines.extend(
            f"    {state} --> {target}: {', '.join(ops)}" for target, ops in arrows.items()
        )
    return "\n".join(lines)


@attrs.frozen(kw_only=True)
class BlockPoolStatistics:
    """A snapshot of one block pool, taken by :meth:`BlockPool.statistics`.

    A count the scheduler's statistics report too has the same name there.
    """

    #: Blocks in the pool (free + used).
    num_blocks: int
    #: Token positions per block.
    block_size: int
    #: Blocks with no reference, ready to allocate (empty or cached).
    num_free_blocks: int
    #: Blocks with at least one reference.
    num_used_blocks: int
    #: Blocks with more than one reference (shared between requests).
    num_shared_blocks: int
    #: Free blocks that hold a cached prefix (evicted, least recently released first).
    num_cached_blocks: int
    #: Prompt tokens looked up in the cache by :meth:`BlockPool.claim_prefix` callers.
    num_prefix_cache_queries: int
    #: Of those, tokens whose KV was found in the cache.
    num_prefix_cache_hits: int


@attrs.frozen
class _Entry:
    """What a hashed block holds, to verify a hit rather than trust the hash."""

    block_hash: BlockHash
    parent: BlockHash
    token_ids: tuple[int, ...]


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` positions each, with a prefix cache.

    A pool whose caller never calls :meth:`cache` never has a cached block and behaves as
    a plain reference-counted pool.

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
        # Cached blocks, least recently released first (dicts keep insertion order).
        self._cached: dict[int, None] = {}
        self._entries: dict[int, _Entry] = {}
        self._by_hash: dict[BlockHash, int] = {}
        self._num_queried = 0
        self._num_hits = 0

    # --- queries ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with no reference: empty ones and cached (evictable) ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks that hold a cached prefix."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        """How many references block ``block_id`` has (0: it is free).

        Raises:
            SchedulerError: there is no such block (a negative id would otherwise silently
                read another block's count).
        """
        if not 0 <= block_id < self.num_blocks:
            raise SchedulerError(f"no block {block_id}: block ids are in [0, {self.num_blocks})")
        return self._ref_counts[block_id]

    def state(self, block_id: int) -> BlockState:
        """Which of the three states block ``block_id`` is in.

        Raises:
            SchedulerError: there is no such block.
        """
        if self.ref_count(block_id):
            return _U
        return _C if block_id in self._cached else _E

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash block ``block_id`` is cached under, or ``None``.

        Raises:
            SchedulerError: there is no such block.
        """
        self.ref_count(block_id)
        entry = self._entries.get(block_id)
        return None if entry is None else entry.block_hash

    # --- references ---------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> tuple[int, ...]:
        """Take ``num_blocks`` free blocks, each with one reference.

        Empty blocks go first, oldest first; then cached blocks are evicted, least recently
        released first, and their hashes dropped.

        Raises:
            SchedulerError: fewer than ``num_blocks`` blocks are free (check first with
                :attr:`num_free`); nothing is taken.
        """
        check_int_at_least("num_blocks", num_blocks, 0)
        if num_blocks > self.num_free:
            raise SchedulerError(
                f"can't allocate {num_blocks} blocks: only {self.num_free} are free"
            )
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
                self._move(block_id, "allocate")
            else:
                block_id = next(iter(self._cached))
                self._move(block_id, "evict")
                del self._cached[block_id]
                self._drop_hash(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return tuple(block_ids)

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add one reference to blocks that are in use (sharing them).

        Raises:
            SchedulerError: a block does not exist or is free; nothing is retained.
        """
        block_ids = tuple(block_ids)
        for block_id in block_ids:
            self._check_used(block_id, "retain")
        for block_id in block_ids:
            self._move(block_id, "retain")
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order.

        A block whose last reference goes is cached if it has a hash (at the most recent
        end of the eviction order), else empty (at the back of the free list).

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
            if self._ref_counts[block_id] > 1:
                self._move(block_id, "release")
            elif block_id in self._entries:
                self._move(block_id, "release_cached")
                self._cached[block_id] = None
            else:
                self._move(block_id, "release_last")
                self._free.append(block_id)
            self._ref_counts[block_id] -= 1

    # --- the prefix cache ---------------------------------------------------------------

    def cache(self, block_id: int, parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
        """Cache a full block in use under the hash of its parent and tokens.

        Call it once the step that writes the block's KV has been planned: steps run in
        plan order on one stream, so a later step that reads the block reads it written.
        If another block already holds the same hash (two requests computed the same
        prefix at once), this one stays uncached.

        Args:
            block_id: The block (in use).
            parent: The hash of the block before it in its sequence (or :data:`ROOT_HASH`).
            token_ids: The ``block_size`` tokens whose KV it holds.

        Returns:
            The block's hash, to chain the next block to.

        Raises:
            SchedulerError: the block is free, already cached under another hash, or the
                tokens do not fill it; nothing changes.
        """
        self._check_used(block_id, "cache")
        if len(token_ids) != self.block_size:
            raise SchedulerError(
                f"can't cache block {block_id}: it needs {self.block_size} tokens, "
                f"got {len(token_ids)}"
            )
        block_hash = hash_block(parent, token_ids)
        entry = self._entries.get(block_id)
        if entry is not None and entry.block_hash != block_hash:
            raise SchedulerError(f"can't cache block {block_id}: it holds another prefix")
        if block_hash not in self._by_hash:
            self._move(block_id, "cache")
            self._entries[block_id] = _Entry(block_hash, parent, tuple(token_ids))
            self._by_hash[block_hash] = block_id
        return block_hash

    def match_prefix(
        self, token_ids: Sequence[int], hashes: Sequence[BlockHash]
    ) -> tuple[int, ...]:
        """The cached blocks of the longest prefix of ``token_ids`` that can be skipped.

        Only whole blocks match, each verified (same parent hash, same tokens), and at least
        the last token is left out, so the step that computes the rest has logits to sample.
        Nothing changes: take the blocks with :meth:`claim_prefix`.

        Args:
            token_ids: The sequence to compute.
            hashes: :func:`block_hashes` of its full blocks (at least those to look up).

        Returns:
            The blocks holding its first positions, in order (possibly none).
        """
        size = self.block_size
        found: list[int] = []
        parent = ROOT_HASH
        for index in range(min((len(token_ids) - 1) // size, len(hashes))):
            block_id = self._by_hash.get(hashes[index])
            if block_id is None:
                break
            entry = self._entries[block_id]
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            if entry.parent != parent or entry.token_ids != tokens:
                break  # a hash collision, or a caller's wrong hash: never trust it
            found.append(block_id)
            parent = entry.block_hash
        return tuple(found)

    def claim_prefix(self, block_ids: Sequence[int], num_queried_tokens: int) -> None:
        """Take a reference to each block of a match and count the query and its hits.

        Cached blocks leave the eviction order; blocks in use become shared.

        Args:
            block_ids: What :meth:`match_prefix` returned (in use or cached blocks).
            num_queried_tokens: The length of the sequence looked up.

        Raises:
            SchedulerError: a block is empty (no longer holds the prefix); nothing changes.
        """
        for block_id in block_ids:
            if self.state(block_id) is _E:
                raise SchedulerError(f"can't claim block {block_id}: it holds no prefix")
        for block_id in block_ids:
            if block_id in self._cached:
                self._move(block_id, "hit")
                del self._cached[block_id]
            else:
                self._move(block_id, "retain")
            self._ref_counts[block_id] += 1
        self._num_queried += num_queried_tokens
        self._num_hits += len(block_ids) * self.block_size

    def forget(self, block_ids: Iterable[int]) -> None:
        """Drop the hashes of blocks whose KV is not to be trusted (a failed step wrote them).

        A cached block becomes empty; a block in use stays in use, uncached. Blocks without
        a hash are left as they are.

        Raises:
            SchedulerError: there is no such block.
        """
        for block_id in block_ids:
            state = self.state(block_id)
            if block_id not in self._entries:
                continue
            self._move(block_id, "forget")
            self._drop_hash(block_id)
            if state is _C:
                del self._cached[block_id]
                self._free.append(block_id)

    # --- internals ----------------------------------------------------------------------

    def _move(self, block_id: int, operation: str) -> None:
        # Every change of state goes through a row of the table the docs draw.
        assert operation in BLOCK_TRANSITIONS[self.state(block_id)], (block_id, operation)

    def _drop_hash(self, block_id: int) -> None:
        entry = self._entries.pop(block_id)
        del self._by_hash[entry.block_hash]

    def _check_used(self, block_id: int, action: str) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise SchedulerError(f"can't {action} block {block_id}: no such block")
        if self._ref_counts[block_id] == 0:
            raise SchedulerError(f"can't {action} block {block_id}: it is free")

    # --- introspection ------------------------------------------------------------------

    def statistics(self) -> BlockPoolStatistics:
        used = self.num_blocks - self.num_free
        shared = sum(1 for count in self._ref_counts if count > 1)
        return BlockPoolStatistics(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=self.num_free,
            num_used_blocks=used,
            num_shared_blocks=shared,
            num_cached_blocks=len(self._cached),
            num_prefix_cache_queries=self._num_queried,
            num_prefix_cache_hits=self._num_hits,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the pool's own bookkeeping is inconsistent.

        Empty + cached + in use == total with no block in two places; hash and block are a
        bijection; every cached block has a hash; every entry's hash is its content's.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & set(self._cached), "a block is both empty and cached"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has {count} references"
            unreferenced = block_id in free or block_id in self._cached
            assert (count == 0) == unreferenced, (
                f"block {block_id} has {count} references but is "
                f"{'' if unreferenced else 'not '}on the free list"
            )
        for block_id in self._cached:
            assert block_id in self._entries, f"cached block {block_id} has no hash"
        for block_id in free:
            assert block_id not in self._entries, f"empty block {block_id} has a hash"
        assert len(self._by_hash) == len(self._entries), "hashes and blocks are not a bijection"
        for block_id, entry in self._entries.items():
            assert self._by_hash[entry.block_hash] == block_id, f"block {block_id}'s hash moved"
            assert hash_block(entry.parent, entry.token_ids) == entry.block_hash, (
                f"block {block_id}'s hash is not its content's"
            )

    def __repr__(self) -> str:
        return (
            f"<BlockPool {self.num_free}/{self.num_blocks} free ({len(self._cached)} cached), "
            f"block_size={self.block_size}>"
        )
