"""The scheduler's side of prefix caching: which blocks a request may skip, and when a block
it computes may be shared.

The pool (:mod:`twostroke.states.blocks`) keeps cached blocks under chained hashes; this
module decides what goes in and what comes out, following one rule: **a block becomes
matchable only once every step that writes its KV has been planned**. Steps run in plan order
on one device stream, so a request admitted in a later step reads the block written. That is
why a block is cached after the plan that writes it is complete (not while it is being
built: a request admitted into the *same* step would read KV that the batch is still
writing), and, with the one-step lookahead, why a block whose last token is a placeholder
(sampled by a step in flight, its id unknown to the host) waits until that token arrives:
its hash needs the id, and by then the step that writes it was planned long ago.

The hashes of each live request's full blocks are computed once and kept here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from twostroke.states.blocks import ROOT_HASH, BlockHash, BlockPool, block_hashes
from twostroke.states.plan import StepPlan
from twostroke.states.request import PrefixCacheHit, Request
from twostroke.states.validators import MAX_PIPELINE_DEPTH

__all__ = ["PrefixCache"]


class PrefixCache:
    """Lookups at admission and caching of computed blocks, over one :class:`BlockPool`.

    Args:
        pool: The scheduler's pool.
        enabled: With ``False`` nothing is looked up or cached: the pool stays a plain
            reference-counted pool.
    """

    def __init__(self, pool: BlockPool, *, enabled: bool) -> None:
        self.pool = pool
        self.enabled = enabled
        self._hashes: dict[int, list[BlockHash]] = {}
        # How many of each live request's first blocks have been offered to the cache.
        self._num_cached: dict[int, int] = {}

    def _chain(self, request: Request) -> list[BlockHash]:
        known = request.token_ids(0, request.num_known_tokens)
        hashes = block_hashes(known, self.pool.block_size, self._hashes.get(request.request_id, ()))
        self._hashes[request.request_id] = hashes
        return hashes

    def match(self, request: Request) -> tuple[int, ...]:
        """The cached blocks a waiting request (new or preempted) may start with.

        Args:
            request: A request with an empty block table.

        Returns:
            Blocks of its longest cached prefix, leaving at least its last token to compute.
        """
        if not self.enabled:
            return ()
        known = request.token_ids(0, request.num_known_tokens)
        return self.pool.match_prefix(known, self._chain(request))

    def claim(self, request: Request, block_ids: tuple[int, ...]) -> None:
        """Give a just admitted request the blocks :meth:`match` found (counting the query).

        Args:
            request: The request, admitted, with an empty block table.
            block_ids: The match (possibly empty).
        """
        if not self.enabled:
            return
        self.pool.claim_prefix(block_ids, request.num_tokens)
        self._num_cached[request.request_id] = len(block_ids)
        if block_ids:
            num_tokens = len(block_ids) * self.pool.block_size
            request.apply(PrefixCacheHit(block_ids, num_tokens))

    def commit(self, requests: Iterable[Request]) -> None:
        """Cache every full block of ``requests`` whose KV planned steps write and whose
        tokens the host knows.

        Call it once a plan is complete, and after an outcome delivered new tokens.
        """
        if not self.enabled:
            return
        size = self.pool.block_size
        for request in requests:
            done = self._num_cached[request.request_id]  # set when it was admitted
            full = min(request.num_computed_tokens, request.num_known_tokens) // size
            if full <= done:
                continue  # the common case, every step of every decode: keep it cheap
            # (Blocks a sliding window gave back were cached before: see Scheduler._slide.)
            released = request.num_released_blocks
            assert released <= done, (request, done)
            table = request.block_table
            hashes = self._chain(request)
            known = request.token_ids(done * size, full * size)
            for index in range(done, full):
                parent = hashes[index - 1] if index else ROOT_HASH
                offset = (index - done) * size
                self.pool.cache(table[index - released], parent, known[offset : offset + size])
            self._num_cached[request.request_id] = full

    def distrust(self, failed: StepPlan, later: Collection[StepPlan]) -> set[int]:
        """Uncache every block whose KV a failed step, or a reader of that KV, writes.

        The rows that the failure strands in the plan after it
        (:meth:`~twostroke.states.plan.StepPlan.stranded_by`: the failed step's own requests,
        and those that took a block it was writing as a hit) read garbage, and so does every
        block they write. With at most :data:`~twostroke.states.validators.MAX_PIPELINE_DEPTH`
        steps in flight, that one plan is all there is, and nobody can have matched a
        stranded row's own blocks yet: a block is matchable only by steps planned after every
        step that writes it, and such a step would still be in flight after it.

        Args:
            failed: The plan of the step that failed.
            later: The plans still in flight after it, oldest first.

        Returns:
            The requests outside ``failed`` that read such KV (the scheduler recomputes them).
        """
        assert len(later) < MAX_PIPELINE_DEPTH, f"{len(later)} steps in flight after a failed one"
        if not self.enabled:
            return set()  # no block is shared, so only the failed step's requests read it
        size = self.pool.block_size
        distrusted = set(failed.written_blocks(size))
        readers: set[int] = set()
        for plan in later:
            stranded = plan.stranded_by(failed, size)
            readers |= stranded
            for entry in plan.requests:
                if entry.request_id in stranded:
                    distrusted |= entry.written_blocks(size)
        self.pool.forget(sorted(distrusted))
        return readers - set(failed.request_ids)

    def drop(self, request_id: int) -> None:
        """Forget a request that the scheduler removed."""
        self._hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)

    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Raise ``AssertionError`` if a request holds a block cached as another prefix.

        Every block of a request's table that has a hash must have the hash of the
        request's own tokens at that place: a wrong hit would break it. And nothing is kept
        for a request the scheduler no longer has.

        Args:
            requests: Every request the scheduler keeps.
        """
        requests = tuple(requests)
        for request in requests:
            hashes = self._hashes.get(request.request_id, [])
            held = enumerate(request.block_table, start=request.num_released_blocks)
            for index, block_id in held:
                block_hash = self.pool.block_hash(block_id)
                if block_hash is not None:
                    assert hashes[index : index + 1] == [block_hash], (
                        f"{request!r} holds block {block_id} at {index}, cached for another prefix"
                    )
        kept = {request.request_id for request in requests}
        assert set(self._hashes) | set(self._num_cached) <= kept, "a removed request is kept"
