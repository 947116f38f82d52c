"""The scheduler's values: the sizes and limits it runs under, and what it reports."""

from __future__ import annotations

from typing import Any

import attrs

from twostroke.states.speculation import (
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
    speculative_config,
)
from twostroke.states.statistics import count, per_position
from twostroke.states.validators import PIPELINE_DEPTH, boolean, int_at_least
from twostroke.states.windowed import WindowedKV

__all__ = ["PRIORITY_AGING_STEPS", "SchedulerConfig", "SchedulerStatistics", "SchedulingPolicy"]

#: Steps a waiting request waits to count as one level of ``priority`` better (the aging
#: that keeps a low-priority request from waiting forever): about one to a few seconds of
#: decode steps.
PRIORITY_AGING_STEPS = 64


@attrs.frozen(kw_only=True)
class SchedulingPolicy:
    """How requests are batched: the scheduler's values that whoever runs one chooses.

    Defined once for every layer: :class:`SchedulerConfig` adds the sizes of the pool and of
    the context, and the engine's configuration (``twostroke.engine.EngineConfig``) adds
    how it finds those sizes and how it runs; both take these fields, defaults and checks
    from here.

    Args:
        block_size: Token positions per KV block.
        max_num_batched_tokens: Token budget of one step (prefill chunks plus decodes;
            chunked prefill splits longer prompts).
        max_num_seqs: The most requests running at once, and so in one step.
        pipeline_depth: Steps in flight at once: 1 plans after each outcome (serial), 2
            plans one step ahead while the step before runs (the default).
        enable_prefix_caching: Keep the KV of full blocks after their requests end, and
            let a request whose prompt starts with the same tokens (a shared system prompt,
            the earlier turns of a chat) skip computing them. Outputs are the same either
            way.
        max_waiting_requests: The most requests the waiting queue may hold (new and
            preempted) when a new one arrives:
            :meth:`~twostroke.states.scheduler.Scheduler.add_request` refuses a request
            that would pass it with :class:`~twostroke.states.errors.EngineOverloaded`.
            Preempted requests always go back into the queue, so it may hold more of them.
            ``None`` (the default) sets no limit: an in-process caller decides what it queues.
        speculative_config: Speculative decoding from the requests' own tokens
            (:class:`~twostroke.states.speculation.SpeculativeConfig`, or a mapping of its
            fields such as ``{"method": "ngram", "num_speculative_tokens": 4}``); ``None``
            (the default) drafts nothing. Outputs are the same either way.
    """

    block_size: int = attrs.field(default=16, validator=int_at_least(1))
    max_num_batched_tokens: int = attrs.field(default=512, validator=int_at_least(1))
    max_num_seqs: int = attrs.field(default=64, validator=int_at_least(1))
    pipeline_depth: int = attrs.field(default=2, validator=PIPELINE_DEPTH)
    enable_prefix_caching: bool = attrs.field(default=True, validator=boolean)
    max_waiting_requests: int | None = attrs.field(
        default=None, validator=int_at_least(1, optional=True, note=" (or None for no limit)")
    )
    speculative_config: SpeculativeConfig | None = attrs.field(
        default=None, converter=speculative_config
    )


@attrs.frozen(kw_only=True)
class SchedulerConfig(SchedulingPolicy):
    """Sizes and limits of one scheduler: the fields of :class:`SchedulingPolicy`, and two sizes.

    Args:
        num_blocks: KV blocks in the pool.
        max_model_len: The model's context: prompt plus output may not exceed it.
        priority_aging_steps: Steps planned while a request waits that count as one level
            of its ``priority`` (:data:`PRIORITY_AGING_STEPS` by default; tests set small
            values to reach the aging in a few steps).
        sliding_window: The positions every layer's attention sees, its own included
            (Mistral's ``sliding_window``), or ``None``: some layer sees them all. With a
            window, a running request gives back each block once the window has passed its
            positions (:class:`~twostroke.states.request.BlocksReleased`), so its blocks
            held stay about ``sliding_window`` positions' and a step's however long it
            runs, and a request longer than the pool is accepted where those fit it
            (:meth:`Scheduler.most_blocks_held
            <twostroke.states.scheduler.Scheduler.most_blocks_held>`).
        windowed_kv: Where a model's sliding-window layers beside global ones keep their
            KV apart (the runner's pool; the pool here holds the global layers'), that pool:
            a request is admitted only where its reservation fits it beside the running
            ones' (:class:`~twostroke.states.windowed.WindowedKV`), and refused where it
            never would. Such a runner cannot serve a prefix-cache hit, so prefix caching
            must be off.
    """

    num_blocks: int = attrs.field(validator=int_at_least(1))
    max_model_len: int = attrs.field(default=2048, validator=int_at_least(2))
    priority_aging_steps: int = attrs.field(default=PRIORITY_AGING_STEPS, validator=int_at_least(1))
    sliding_window: int | None = attrs.field(default=None, validator=int_at_least(1, optional=True))
    windowed_kv: WindowedKV | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(WindowedKV))
    )

    def __attrs_post_init__(self) -> None:
        if self.windowed_kv is not None and self.enable_prefix_caching:
            raise ValueError(
                "windowed_kv needs enable_prefix_caching=False: the windowed layers keep no "
                "KV of the positions a prefix-cache hit would skip"
            )

    @classmethod
    def sized(
        cls,
        policy: SchedulingPolicy,
        *,
        num_blocks: int,
        max_model_len: int,
        sliding_window: int | None = None,
        windowed_kv: WindowedKV | None = None,
    ) -> SchedulerConfig:
        """The configuration that runs ``policy`` over a pool and a context of these sizes,
        for a model whose every layer attends within ``sliding_window`` positions (or not),
        or whose windowed layers keep their KV in the runner's ``windowed_kv`` pool.

        Raises:
            TypeError, ValueError: a size of the wrong type or out of range.
        """
        chosen: dict[str, Any] = {
            field.name: getattr(policy, field.name) for field in attrs.fields(SchedulingPolicy)
        }
        return cls(
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            sliding_window=sliding_window,
            windowed_kv=windowed_kv,
            **chosen,
        )


@attrs.frozen(kw_only=True)
class SchedulerStatistics:
    """A snapshot of one scheduler.

    Taken by :meth:`~twostroke.states.scheduler.Scheduler.statistics`. Every field is a
    count (declared with :func:`~twostroke.states.statistics.count`, so records add up over
    engines). The engine's statistics extend this record, and the counts it takes from the
    block pool have the names they have in
    :class:`~twostroke.states.blocks.BlockPoolStatistics`: one name per count, from the pool
    to the server's metrics.
    """

    #: Requests queued for admission (new or preempted), not holding blocks.
    num_waiting: int = count()
    #: Admitted requests (prefilling or decoding) that hold blocks.
    num_running: int = count()
    #: Ended requests (finished, cancelled, failed) whose blocks a step in flight still uses.
    num_ending: int = count()
    #: Steps planned whose outcome has not been applied yet (at most ``pipeline_depth``).
    num_inflight_steps: int = count()
    #: KV blocks free to allocate: empty ones and cached ones (evicted when needed).
    num_free_blocks: int = count()
    #: Free KV blocks that hold a cached prefix.
    num_cached_blocks: int = count()
    #: KV blocks held for finished requests' ``cache_ttl`` (a stored conversation's, for
    #: its next turn): not free, but given back as soon as a request needs the room.
    num_pinned_blocks: int = count()
    #: KV blocks in the pool.
    num_blocks: int = count()
    #: Token positions the pool holds: ``num_blocks`` × its block size (vLLM's
    #: ``kv_cache_size_tokens``). A count, so it adds up over engines where a block size
    #: would not; ``num_kv_cache_tokens / num_blocks`` is the block size.
    num_kv_cache_tokens: int = count()
    #: Steps planned since the scheduler was made (the next step's id).
    num_steps_planned: int = count()
    #: Steps whose outcome (or failure) has been applied.
    num_steps: int = count()
    #: Token positions put into planned steps (prefill chunks, recomputes and decodes).
    num_tokens_scheduled: int = count()
    #: Sampled tokens appended to live requests (tokens dropped for ended requests excluded).
    num_tokens_generated: int = count()
    #: Times a running request was preempted to free blocks (it is recomputed later).
    num_preemptions: int = count()
    #: Tokens of admitted requests looked up in the prefix cache (each admission counts).
    num_prefix_cache_queries: int = count()
    #: Of those, tokens whose KV was found in the cache and not computed.
    num_prefix_cache_hits: int = count()
    #: Drafts verified (speculative decoding): rows that carried drafted tokens.
    num_spec_decode_drafts: int = count()
    #: Drafted tokens verified.
    num_spec_decode_draft_tokens: int = count()
    #: Drafted tokens accepted (each one a token a step gave beyond its one).
    num_spec_decode_accepted_tokens: int = count()
    #: Accepted drafted tokens by their position in the draft (0 is the first).
    spec_decode_accepted_tokens_per_pos: tuple[int, ...] = per_position(MAX_SPECULATIVE_TOKENS)

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per verifying row (vLLM's; 1 before any draft)."""
        drafts = self.num_spec_decode_drafts
        return 1 + self.num_spec_decode_accepted_tokens / drafts if drafts else 1.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits over queries, in tokens (0 before the first query)."""
        queries = self.num_prefix_cache_queries
        return self.num_prefix_cache_hits / queries if queries else 0.0
