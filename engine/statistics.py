"""The engine's statistics: a snapshot of its queues, its pool and its two strokes.

:meth:`twostroke.engine.Engine.statistics` returns one; the coordinator's record extends it
(:class:`twostroke.engine.coordinator.statistics.CoordinatorStatistics`).
"""

from __future__ import annotations

import attrs

__all__ = ["EngineStatistics"]


@attrs.frozen(kw_only=True)
class EngineStatistics:
    """A snapshot of the engine, cheap to take at any time (:meth:`Engine.statistics`)."""

    #: Requests queued and not yet admitted (new or preempted).
    num_waiting: int
    #: Requests admitted and computing (prefilling or decoding).
    num_running: int
    #: Requests submitted whose handle has not ended yet.
    num_open_requests: int
    #: KV blocks free now (blocks of ended requests come back once no step in flight uses
    #: them); cached blocks count as free, since allocation evicts them when needed.
    num_free_blocks: int
    #: KV blocks in the pool.
    num_blocks: int
    #: Free KV blocks that hold a cached prefix (matchable by a later prompt).
    num_cached_blocks: int
    #: Prompt tokens looked up in the prefix cache at admission.
    num_prefix_cache_queries: int
    #: Of those, the tokens whose KV the cache held (not computed again).
    num_prefix_cache_hits: int
    #: Steps whose outcome has been applied (failed ones included).
    num_steps: int
    #: Token positions computed over all steps (prompt chunks and decodes).
    num_tokens_scheduled: int
    #: Output tokens sampled for live requests.
    num_tokens_generated: int
    #: Times a running request's KV was taken back under memory pressure.
    num_preemptions: int
    #: Steps that failed (each failed exactly the requests in it).
    num_failed_steps: int
    #: Seconds the bookkeeping stroke spent in its own work (planning, applying, delivering).
    bookkeeping_seconds: float
    #: Seconds the device spent launching steps, timed where they run: on the CPU, computing
    #: them on the device's forward thread; on a GPU, enqueueing their kernels.
    forward_seconds: float
    #: Seconds the device sat between the end of one launch and the start of the next while
    #: the engine was busy (the next plan was made while a step was in flight, or right
    #: after one was applied): the time it waited on Python. Not counted: idle time with
    #: nothing to run.
    forward_idle_seconds: float

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits over queries, in tokens (0 before any query)."""
        queries = self.num_prefix_cache_queries
        return self.num_prefix_cache_hits / queries if queries else 0.0
