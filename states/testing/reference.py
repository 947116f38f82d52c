"""Plain reference models of a request and of the block pool, for the state machines.

A stateful test is only as good as the model it compares against, so these are written as
plainly as possible: a request as a handful of counts that follows whatever transition table
it is given, a pool as a dict of reference counts and a FIFO free list. The hypothesis
machines in :mod:`twostroke.states.testing` drive the real object and one of these side by
side and compare them after every rule. Pure (attrs and the standard library).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence

import attrs

from twostroke.states.constraints import Constraint
from twostroke.states.request import (
    Admitted,
    BlocksAllocated,
    BlocksReleased,
    ChunkScheduled,
    ConstraintCompiled,
    DraftVerified,
    Failed,
    Finished,
    FinishReason,
    Preempted,
    PrefixCacheHit,
    Request,
    RequestEvent,
    RequestStatus,
    SampleDiscarded,
    SampleScheduled,
    TokenSampled,
)
from twostroke.states.testing.constraints import ReferenceMatcher
from twostroke.states.testing.workload import SIMULATED_VOCABULARY

__all__ = ["PoolModel", "RequestModel", "Transitions", "request_snapshot"]

#: A transition table: status, then event type, to the next status.
Transitions = Mapping[RequestStatus, Mapping[type[RequestEvent], RequestStatus]]

_TIMES = ("first_scheduled", "first_token", "last_token", "end")


def request_snapshot(request: Request) -> dict[str, object]:
    """Everything observable about a request, to compare before and after an event.

    Args:
        request: The request.

    Returns:
        Its status, output, block table, counts, last step, finish reason, failure,
        timestamps, and how many tokens its matcher has taken (``None`` without one).
    """
    times = (
        request.first_scheduled_time,
        request.first_token_time,
        request.last_token_time,
        request.end_time,
    )
    return {
        "status": request.status,
        "output": request.output_token_ids,
        "blocks": request.block_table,
        "released": request.num_released_blocks,
        "computed": request.num_computed_tokens,
        "cached": request.num_cached_tokens,
        "placeholders": request.num_placeholders,
        "drafts": request.num_drafts,
        "last_step": request.last_step_id,
        "reason": request.finish_reason,
        "failure": request.failure,
        "preemptions": request.num_preemptions,
        "times": dict(zip(_TIMES, times, strict=True)),
        "matcher": None if request.matcher is None else request.matcher.num_tokens,
    }


@attrs.define
class RequestModel:
    """A request as plain counts, changed by the transition table it was given.

    A constrained request's model follows the constraint with a :class:`ReferenceMatcher` of
    its own (over :data:`~twostroke.states.testing.workload.SIMULATED_VOCABULARY`), made when
    it takes :class:`ConstraintCompiled` and moved only by the tokens it takes.

    Attributes:
        table: The lifecycle the model follows.
        prompt: The prompt ids.
        max_tokens: The request's ``max_tokens`` (drafts may not pass it).
        constraint: The request's constraint (a choice or a regex), or ``None``.
        eos_token_ids: The request's EOS ids, which its matcher knows.
        matcher: The model's matcher, once compiled.
    """

    table: Transitions
    prompt: tuple[int, ...]
    constraint: Constraint | None = None
    eos_token_ids: frozenset[int] = frozenset()
    matcher: ReferenceMatcher | None = None
    status: RequestStatus = RequestStatus.WAITING
    output: list[int] = attrs.Factory(list)
    blocks: list[int] = attrs.Factory(list)
    released: int = 0
    computed: int = 0
    cached: int = 0
    placeholders: int = 0
    drafts: int = 0
    last_step: int | None = None
    reason: FinishReason | None = None
    failure: str | None = None
    preemptions: int = 0
    times: dict[str, float] = attrs.Factory(dict)
    max_tokens: int = 1 << 30

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output) + self.placeholders

    def resolve(self, event: RequestEvent) -> tuple[RequestEvent, ReferenceMatcher | None]:
        """The event the request takes for ``event``, and the model's matcher after it.

        A :class:`TokenSampled` the request accepts but its constraint does not take is a
        :class:`Failed` that says why: a token the matcher refuses (which leaves it where it
        was) or one that leads it to a dead end (which it took). :class:`ConstraintCompiled`
        gives the model a matcher of its own at its start. Any other event is itself.
        """
        matcher = self.matcher
        if self.next_status(event) is None:
            return event, matcher
        if isinstance(event, ConstraintCompiled):
            assert self.constraint is not None  # next_status refuses it otherwise
            fresh = ReferenceMatcher(self.constraint, SIMULATED_VOCABULARY, self.eos_token_ids)
            return event, fresh
        if not isinstance(event, TokenSampled) or matcher is None:
            return event, matcher
        after = matcher.copy()
        if not after.advance(event.token_id):
            reason = f"the constraint does not allow token {event.token_id} here"
            return Failed(reason, event.time), matcher
        if after.terminated and not after.accepting:
            reason = "the constraint reached a dead end: no token of the vocabulary continues it"
            return Failed(reason, event.time), after
        return event, after

    def next_status(self, event: RequestEvent) -> RequestStatus | None:
        """The status after ``event`` (as :meth:`resolve` gives it), or ``None`` if the
        request must refuse it."""
        if isinstance(event, ConstraintCompiled) and (
            self.constraint is None or self.matcher is not None or event.matcher.num_tokens
        ):
            return None
        if isinstance(event, Admitted) and self.constraint is not None and self.matcher is None:
            return None
        if isinstance(event, ChunkScheduled | SampleScheduled):
            end = self.computed + event.num_tokens
            if self.drafts or event.num_tokens < 1 or end > self.num_tokens:
                return None
            if isinstance(event, SampleScheduled) != (end == self.num_tokens):
                return None
            if isinstance(event, SampleScheduled) and event.num_drafts:
                generated = len(self.output) + self.placeholders
                if event.num_drafts < 0 or generated + 1 + event.num_drafts > self.max_tokens:
                    return None
        if isinstance(event, DraftVerified) and not (
            self.drafts
            and 0 <= event.num_accepted <= self.drafts
            and self.placeholders == self.drafts - event.num_accepted
        ):
            return None
        if isinstance(event, TokenSampled | SampleDiscarded) and self.placeholders == 0:
            return None
        if isinstance(event, BlocksReleased) and not 1 <= event.num_blocks <= len(self.blocks):
            return None
        if (
            isinstance(event, SampleDiscarded)
            and self.drafts
            and event.step_id == self.last_step
            and self.placeholders < 1 + self.drafts
        ):
            return None  # a row with drafts is discarded whole, never after a delivery
        if isinstance(event, PrefixCacheHit) and (
            self.blocks
            or self.computed
            or not event.block_ids
            or not 0 < event.num_tokens < self.num_tokens
        ):
            return None
        return self.table[self.status].get(type(event))

    def apply(
        self, event: RequestEvent, target: RequestStatus, matcher: ReferenceMatcher | None
    ) -> None:
        """Change the model as ``event`` must change the request (``target`` is the status,
        ``matcher`` the model's matcher after it: both as :meth:`resolve` and
        :meth:`next_status` said)."""
        self.matcher = matcher
        if isinstance(event, ConstraintCompiled):
            pass
        elif isinstance(event, Admitted):
            self.times.setdefault("first_scheduled", event.time)
        elif isinstance(event, PrefixCacheHit):
            self.blocks += event.block_ids
            self.computed = event.num_tokens
            if not self.preemptions:
                self.cached = event.num_tokens
        elif isinstance(event, BlocksAllocated):
            self.blocks += event.block_ids
        elif isinstance(event, BlocksReleased):
            self.blocks = self.blocks[event.num_blocks :]
            self.released += event.num_blocks
        elif isinstance(event, ChunkScheduled):
            self.computed += event.num_tokens
            self.last_step = event.step_id
        elif isinstance(event, SampleScheduled):
            self.computed += event.num_tokens + event.num_drafts
            self.placeholders += 1 + event.num_drafts
            self.drafts = event.num_drafts
            self.last_step = event.step_id
        elif isinstance(event, DraftVerified):
            rejected = self.drafts - event.num_accepted
            self.placeholders -= rejected
            if self.status is not RequestStatus.PREEMPTED:
                self.computed -= rejected
            self.drafts = 0
        elif isinstance(event, TokenSampled):
            self.placeholders -= 1
            self.output.append(event.token_id)
            self.times.setdefault("first_token", event.time)
            self.times["last_token"] = event.time
        elif isinstance(event, SampleDiscarded):
            whole = self.drafts and event.step_id == self.last_step
            self.placeholders -= 1 + self.drafts if whole else 1
            if whole:
                self.drafts = 0
        elif isinstance(event, Preempted):
            self.blocks = []
            self.released = 0
            self.computed = 0
            self.preemptions += 1
        else:
            if isinstance(event, Finished):
                self.reason = event.reason
            elif isinstance(event, Failed):
                self.failure = event.message
            self.blocks = []
            self.released = 0
            self.times["end"] = event.time
        self.status = target

    def snapshot(self) -> dict[str, object]:
        """The same record as :func:`request_snapshot`, from the model."""
        return {
            "status": self.status,
            "output": tuple(self.output),
            "blocks": tuple(self.blocks),
            "released": self.released,
            "computed": self.computed,
            "cached": self.cached,
            "placeholders": self.placeholders,
            "drafts": self.drafts,
            "last_step": self.last_step,
            "reason": self.reason,
            "failure": self.failure,
            "preemptions": self.preemptions,
            "times": {key: self.times.get(key) for key in _TIMES},
            "matcher": None if self.matcher is None else self.matcher.num_tokens,
        }


class PoolModel:
    """A block pool as a dict of reference counts and a FIFO free list.

    Args:
        num_blocks: How many blocks exist.
    """

    def __init__(self, num_blocks: int) -> None:
        self.refs = dict.fromkeys(range(num_blocks), 0)
        self.free = collections.deque(range(num_blocks))

    def allocate(self, count: int) -> tuple[int, ...] | None:
        """The blocks ``allocate(count)`` must return, or ``None`` if it must refuse."""
        if not 0 <= count <= len(self.free):
            return None
        block_ids = tuple(self.free.popleft() for _ in range(count))
        for block_id in block_ids:
            self.refs[block_id] = 1
        return block_ids

    def can_retain(self, block_ids: Iterable[int]) -> bool:
        """Whether every block is in use (only used blocks can be shared)."""
        return all(self.refs.get(block_id, 0) > 0 for block_id in block_ids)

    def retain(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.refs[block_id] += 1

    def can_release(self, block_ids: Sequence[int]) -> bool:
        """Whether each block has at least as many references as it is released."""
        counts = collections.Counter(block_ids)
        return all(self.refs.get(block_id, 0) >= n for block_id, n in counts.items())

    def release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                self.free.append(block_id)

    @property
    def held(self) -> list[int]:
        """Every reference, one entry each (a block with two references appears twice)."""
        return [block_id for block_id, count in self.refs.items() for _ in range(count)]

    def counts(self) -> tuple[int, int, int]:
        """``(free, used, shared)`` block counts."""
        used = sum(1 for count in self.refs.values() if count)
        shared = sum(1 for count in self.refs.values() if count > 1)
        return len(self.refs) - used, used, shared
