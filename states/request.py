"""The request state machine.

A request's status changes only through :meth:`Request.apply`, and every legal change is one
row of :data:`TRANSITIONS`, a module-level table from status and event type to the next
status (h11's design). An event the current status does not accept raises
:class:`~twostroke.states.errors.InvalidTransition` and leaves the request unchanged.
Terminal statuses accept nothing.

The token counts, the block table and the timestamps live on the request too, and they also
change only through events, so that "what happened to this request" is always the sequence
of events applied to it.

Token bookkeeping follows vLLM. ``num_tokens`` counts the prompt, the output tokens the host
knows, and *placeholders*: tokens a step in flight will sample but whose ids the host has not
read yet. ``num_computed_tokens`` counts the positions whose KV is written (or will be, by a
step already planned). The scheduler plans a step for every request with
``num_tokens > num_computed_tokens``.

A constrained request owns its :class:`~twostroke.states.constraints.Matcher` the same way:
:class:`ConstraintCompiled` attaches it while the request waits, and each
:class:`TokenSampled` advances it. A token the matcher refuses, one that leads it to a dead
end, or a matcher that raises, fails the request through the table's row for
:class:`Failed`: the token never reaches the output. A sample that is discarded (a finished
request's lookahead token, :class:`SampleDiscarded`) is never applied, so it never reaches
the matcher either, and there is nothing to roll back.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence

import attrs

from twostroke.states.constraints import Matcher
from twostroke.states.errors import InvalidTransition
from twostroke.states.params import SamplingParams

__all__ = [
    "TERMINAL",
    "TRANSITIONS",
    "Admitted",
    "BlocksAllocated",
    "BlocksReleased",
    "Cancelled",
    "ChunkScheduled",
    "ConstraintCompiled",
    "DraftVerified",
    "Failed",
    "FinishReason",
    "Finished",
    "Preempted",
    "PrefixCacheHit",
    "Request",
    "RequestEvent",
    "RequestStatus",
    "SampleDiscarded",
    "SampleScheduled",
    "TokenSampled",
    "mermaid_diagram",
]


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.name


class FinishReason(enum.Enum):
    """Why a request finished: a stop condition (EOS, stop token, stop string) or its length."""

    STOP = "stop"
    LENGTH = "length"

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED})


# --- events ---------------------------------------------------------------------------------


@attrs.frozen
class ConstraintCompiled:
    """The request's constraint was compiled: ``matcher`` follows its output from now on.

    A constrained request takes it once, while it waits and before its first admission (the
    engine compiles the constraint off the event loop, then queues the request), with the
    matcher at its start. From then on the request owns it: each :class:`TokenSampled`
    advances it.
    """

    matcher: Matcher


@attrs.frozen
class Admitted:
    """The scheduler took the request from the waiting queue into the running set."""

    time: float


@attrs.frozen
class BlocksAllocated:
    """KV blocks were appended to the request's block table."""

    block_ids: tuple[int, ...]


@attrs.frozen
class BlocksReleased:
    """The first ``num_blocks`` blocks of the request's table left it: every layer of the
    model attends within a sliding window, and no position the request computes from now on
    reads theirs (:attr:`SchedulerConfig.sliding_window
    <twostroke.states.scheduler_config.SchedulerConfig.sliding_window>`).

    The positions they covered stay behind the table: :attr:`Request.num_released_blocks`
    counts them, so the table's first block holds the positions after them.
    """

    num_blocks: int


@attrs.frozen
class PrefixCacheHit:
    """At admission, the KV of the first ``num_tokens`` positions was found in the cache.

    ``block_ids`` (shared with other requests or taken back from the cache) start the
    empty block table, and the computed count starts after them, so no step computes them.
    The first admission's hit is the request's ``num_cached_tokens``.
    """

    block_ids: tuple[int, ...]
    num_tokens: int


@attrs.frozen
class ChunkScheduled:
    """Step ``step_id`` will compute ``num_tokens`` more prompt positions without sampling."""

    step_id: int
    num_tokens: int


@attrs.frozen
class SampleScheduled:
    """Step ``step_id`` will compute ``num_tokens`` positions, reaching the end, and sample.

    Until the step's outcome is applied, the sampled token is a placeholder. With
    ``num_drafts`` drafted tokens (speculative decoding), the step also computes their
    positions and samples after each: the request holds ``1 + num_drafts`` placeholders and
    counts their positions computed, until :class:`DraftVerified` settles how many held.
    """

    step_id: int
    num_tokens: int
    num_drafts: int = 0


@attrs.frozen
class DraftVerified:
    """The step that verified the request's drafts delivered its tokens (one
    :class:`TokenSampled` each, the accepted drafts and the token after them): the
    ``num_drafts - num_accepted`` placeholders left are dropped, and so are their positions
    from the computed count (their KV holds rejected drafts, written over when those
    positions are computed again).
    """

    step_id: int
    num_accepted: int


@attrs.frozen
class TokenSampled:
    """A step's outcome delivered the token for the oldest placeholder.

    A constrained request advances its matcher by the token. If the matcher refuses it,
    reaches a dead end with it (terminated, not accepting) or raises, the request takes
    :class:`Failed` instead, with the reason as its message, and the token is not output.
    """

    token_id: int
    time: float


@attrs.frozen
class SampleDiscarded:
    """The oldest placeholder is dropped: its step read KV that was never written.

    A preempted request that took a prefix-cache hit on blocks a step was still filling, and
    that step then failed, is recomputed; the token its own step in flight samples from the
    missing KV is garbage and never reaches the output.
    """

    step_id: int


@attrs.frozen
class Preempted:
    """The request's KV was taken back; it will be recomputed from its tokens later.

    Its block table is emptied (the scheduler returns the blocks to the pool) and its
    computed count drops to zero. Placeholders stay: a step in flight still owes it a token.
    """


@attrs.frozen
class Finished:
    """The request's output is complete."""

    reason: FinishReason
    time: float


@attrs.frozen
class Cancelled:
    """The caller gave up on the request."""

    time: float


@attrs.frozen
class Failed:
    """A step the request was in failed; ``message`` says why."""

    message: str
    time: float


RequestEvent = (
    ConstraintCompiled
    | Admitted
    | PrefixCacheHit
    | BlocksAllocated
    | BlocksReleased
    | ChunkScheduled
    | SampleScheduled
    | TokenSampled
    | SampleDiscarded
    | DraftVerified
    | Preempted
    | Finished
    | Cancelled
    | Failed
)

_W, _P, _D, _X = (
    RequestStatus.WAITING,
    RequestStatus.PREFILLING,
    RequestStatus.DECODING,
    RequestStatus.PREEMPTED,
)
_ENDINGS: dict[type[RequestEvent], RequestStatus] = {
    Cancelled: RequestStatus.CANCELLED,
    Failed: RequestStatus.FAILED,
}

#: Every legal transition: ``TRANSITIONS[status][type(event)]`` is the next status.
TRANSITIONS: Mapping[RequestStatus, Mapping[type[RequestEvent], RequestStatus]] = {
    _W: {ConstraintCompiled: _W, Admitted: _P, **_ENDINGS},
    _P: {
        PrefixCacheHit: _P,
        BlocksAllocated: _P,
        BlocksReleased: _P,
        ChunkScheduled: _P,
        SampleScheduled: _D,
        Preempted: _X,
        **_ENDINGS,
    },
    _D: {
        BlocksAllocated: _D,
        BlocksReleased: _D,
        SampleScheduled: _D,
        TokenSampled: _D,
        DraftVerified: _D,
        Preempted: _X,
        Finished: RequestStatus.FINISHED,
        **_ENDINGS,
    },
    # A preempted request may still receive the token of a step that was in flight when it
    # was preempted, and that token may finish it; or the token is discarded, when the step
    # read KV that a failed step never wrote.
    _X: {
        Admitted: _P,
        TokenSampled: _X,
        SampleDiscarded: _X,
        DraftVerified: _X,
        Finished: RequestStatus.FINISHED,
        **_ENDINGS,
    },
    RequestStatus.FINISHED: {},
    RequestStatus.CANCELLED: {},
    RequestStatus.FAILED: {},
}


def mermaid_diagram() -> str:
    """The lifecycle as a Mermaid ``stateDiagram-v2``, drawn from :data:`TRANSITIONS`.

    The docs paste its output (``docs/states.md``) and a test fails when the two diverge, so
    the picture can never disagree with the code. Events that lead between the same two
    statuses share one arrow.

    Returns:
        The diagram source, one statement per line, without a trailing newline.
    """
    lines = ["stateDiagram-v2", f"    [*] --> {RequestStatus.WAITING}"]
    for status, row in TRANSITIONS.items():
        arrows: dict[RequestStatus, list[str]] = {}
        for event, target in row.items():
            arrows.setdefault(target, []).append(event.__name__)
        lines.extend(
            f"    {status} --> {target}: {', '.join(events)}" for target, events in arrows.items()
        )
    lines.extend(f"    {status} --> [*]" for status in RequestStatus if status in TERMINAL)
    return "\n".join(lines)


# --- the request ----------------------------------------------------------------------------


def _advance(matcher: Matcher, token_id: int) -> tuple[str | None, bool]:
    """Advance a constrained request's matcher past its new token: why the request fails, if
    it does, and whether the constraint's output is complete (terminated and accepting).

    The sampler picked the token under the mask of allowed tokens, so a refusal means the
    mask was not applied (a runner that ignores constraints) and a dead end means the
    vocabulary cannot spell what the constraint needs: either way the request fails rather
    than deliver output that does not satisfy its constraint. A matcher that raises (its
    backend gave up, a limit), advancing or saying where it is after, fails the request with
    the backend's message. Where it is, is read here once, inside the net, and kept: read
    again outside it (by :meth:`Request.finish_reached`), a matcher that raised would end
    the scheduler's step, and the engine with it.
    """
    try:
        if not matcher.advance(token_id):
            return f"the constraint does not allow token {token_id} here", False
        terminated = matcher.terminated
        complete = terminated and matcher.accepting
    except Exception as exc:  # the backend's own error: this request fails, not the engine
        return f"the constraint failed: {exc}", False
    if terminated and not complete:
        return "the constraint reached a dead end: no token of the vocabulary continues it", False
    return None, complete


def _token_tuple(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


def _token_set(value: Iterable[int]) -> frozenset[int]:
    # A named converter rather than ``frozenset`` itself: mypy's attrs plugin cannot infer
    # the type of a generic class used as a converter, and rejected every caller.
    return frozenset(value)


def _max_tokens_of_params(request: Request) -> int:
    most = request.params.max_tokens
    if most is None:
        raise ValueError(
            "max_tokens must be given when params.max_tokens is None (as many as the context "
            "leaves): the request's own limit is a number"
        )
    return most


# No on_setattr hooks: the converters run once, at construction; without hooks attrs adds no
# __setattr__ of its own, so every count the events change is a plain attribute store.
@attrs.define(eq=False, repr=False, on_setattr=attrs.setters.NO_OP)
class Request:
    """One generation request: its tokens, its KV blocks, its status and its timings.

    Construct it with the prompt already tokenized; the engine validates the prompt and the
    parameters before that. ``eos_token_ids`` are the model's end-of-sequence ids; they stop
    the request unless ``params.ignore_eos``. ``max_tokens`` is the most output tokens as a
    number: ``params.max_tokens`` by default; the engine passes it when the parameters leave
    it to the context (``None``). A request with a constraint (``params.constraint``) takes
    its matcher through :class:`ConstraintCompiled` before it can be admitted.
    """

    request_id: int
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_token_tuple)
    params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_token_set)
    max_tokens: int = attrs.field(
        kw_only=True, default=attrs.Factory(_max_tokens_of_params, takes_self=True)
    )

    _matcher: Matcher | None = attrs.field(default=None, init=False)
    # The matcher's verdict after its last token (terminated and accepting), as read once
    # under _advance's net.
    _constraint_complete: bool = attrs.field(default=False, init=False)
    _status: RequestStatus = attrs.field(default=RequestStatus.WAITING, init=False)
    _output_token_ids: list[int] = attrs.field(factory=list, init=False)
    _block_table: list[int] = attrs.field(factory=list, init=False)
    _num_released_blocks: int = attrs.field(default=0, init=False)
    _num_computed_tokens: int = attrs.field(default=0, init=False)
    _num_cached_tokens: int = attrs.field(default=0, init=False)
    _num_placeholders: int = attrs.field(default=0, init=False)
    _num_drafts: int = attrs.field(default=0, init=False)
    _last_step_id: int | None = attrs.field(default=None, init=False)
    _finish_reason: FinishReason | None = attrs.field(default=None, init=False)
    _failure: str | None = attrs.field(default=None, init=False)
    _num_preemptions: int = attrs.field(default=0, init=False)
    _first_scheduled_time: float | None = attrs.field(default=None, init=False)
    _first_token_time: float | None = attrs.field(default=None, init=False)
    _last_token_time: float | None = attrs.field(default=None, init=False)
    _end_time: float | None = attrs.field(default=None, init=False)

    # --- read-only views ----------------------------------------------------------------

    @property
    def status(self) -> RequestStatus:
        return self._status

    @property
    def is_terminal(self) -> bool:
        return self._status in TERMINAL

    @property
    def matcher(self) -> Matcher | None:
        """The request's position in its constraint's language, or ``None``: no constraint,
        or not compiled yet (:class:`ConstraintCompiled`).

        Read it to fill a mask; only :meth:`apply` advances it (:class:`TokenSampled`).
        """
        return self._matcher

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """The output tokens whose ids the host knows."""
        return tuple(self._output_token_ids)

    @property
    def block_table(self) -> tuple[int, ...]:
        """The KV blocks the request holds, in order: the first holds the positions after
        the :attr:`num_released_blocks` blocks' that a sliding window left behind."""
        return tuple(self._block_table)

    @property
    def num_released_blocks(self) -> int:
        """Blocks' worth of leading positions whose KV the request gave back
        (:class:`BlocksReleased`); 0 without a sliding window."""
        return self._num_released_blocks

    @property
    def num_table_blocks(self) -> int:
        """The positions its table covers, in blocks: those released and those held."""
        return self._num_released_blocks + len(self._block_table)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_placeholders(self) -> int:
        """Tokens that steps in flight will sample for this request."""
        return self._num_placeholders

    @property
    def num_drafts(self) -> int:
        """Drafted tokens that a step in flight verifies (their positions count computed).

        While there are any, the request's next positions are unknown: no step may be
        planned for it until :class:`DraftVerified`.
        """
        return self._num_drafts

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose ids the host knows."""
        return len(self.prompt_token_ids) + len(self._output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, known output, and placeholder tokens."""
        return self.num_known_tokens + self._num_placeholders

    @property
    def last_step_id(self) -> int | None:
        """The last step planned to compute for this request (``None`` before the first).

        Until that step completes, a step in flight reads or writes the request's blocks.
        """
        return self._last_step_id

    @property
    def num_computed_tokens(self) -> int:
        """Positions whose KV is written, or will be by a step already planned."""
        return self._num_computed_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Prompt positions whose KV its first admission found in the prefix cache."""
        return self._num_cached_tokens

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens including placeholders: what counts against ``max_tokens``."""
        return len(self._output_token_ids) + self._num_placeholders

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish_reason

    @property
    def failure(self) -> str | None:
        """Why it failed (the message of :class:`Failed`), once FAILED; else ``None``."""
        return self._failure

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def first_scheduled_time(self) -> float | None:
        return self._first_scheduled_time

    @property
    def first_token_time(self) -> float | None:
        return self._first_token_time

    @property
    def last_token_time(self) -> float | None:
        return self._last_token_time

    @property
    def end_time(self) -> float | None:
        """When it reached a terminal status (its last output's time), or ``None``."""
        return self._end_time

    def token_ids(self, start: int, stop: int) -> tuple[int, ...]:
        """Known token ids at positions ``[start, stop)`` (prompt, then output)."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        head = self.prompt_token_ids[start:num_prompt] if start < num_prompt else ()
        return head + tuple(self._output_token_ids[max(start - num_prompt, 0) : stop - num_prompt])

    def finish_reached(self) -> FinishReason | None:
        """Whether the output known so far finishes the request, and why.

        The one rule on token ids (vLLM's ``check_stop``): ``STOP`` when the last output
        token is a stop token id, or an EOS id unless ``params.ignore_eos``, and at least
        ``min_tokens`` tokens precede it, or when the constraint's output is complete (as
        its matcher said when that token was applied: the matcher is not asked here);
        else ``LENGTH`` once the output holds ``max_tokens`` tokens. Stop strings are text:
        the engine matches them where the text is made, and finishes the request through
        the scheduler.

        Returns:
            The reason to finish, or ``None`` while the request goes on.
        """
        output = self._output_token_ids
        params = self.params
        if self._constraint_complete:  # read when the token was applied, not asked again
            return FinishReason.STOP
        if len(output) > params.min_tokens:
            last = output[-1]
            if last in params.stop_token_ids or (
                not params.ignore_eos and last in self.eos_token_ids
            ):
                return FinishReason.STOP
        if len(output) >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    # --- the one way to change a request ------------------------------------------------

    def accepts(self, event: RequestEvent) -> bool:
        return type(event) in TRANSITIONS[self._status]

    def apply(self, event: RequestEvent) -> RequestStatus:
        """Apply one event and return the new status.

        A :class:`TokenSampled` that the request's constraint does not take (see there) is
        applied as :class:`Failed`, through the table's row for it: the request is then
        ``FAILED``, and :attr:`failure` says why.

        Raises:
            InvalidTransition: the current status does not accept this event, or the event
                does not fit the request's counts; the request is unchanged.
        """
        next_status = TRANSITIONS[self._status].get(type(event))
        if next_status is None:
            raise InvalidTransition(self.request_id, self._status, event)
        self._check(event)
        if isinstance(event, TokenSampled) and self._matcher is not None:
            refusal, complete = _advance(self._matcher, event.token_id)
            if refusal is not None:
                return self.apply(Failed(refusal, event.time))
            self._constraint_complete = complete
        self._update(event)
        self._status = next_status
        return next_status

    def _check(self, event: RequestEvent) -> None:
        """Reject an event that the table allows but the counts do not; change nothing."""
        rule: str | None = None
        match event:
            case ConstraintCompiled(matcher=matcher):
                if self.params.constraint is None:
                    rule = "ConstraintCompiled needs a constraint, and params.constraint is None"
                elif self._matcher is not None:
                    rule = "ConstraintCompiled came before: the request has its matcher"
                elif matcher.num_tokens:
                    rule = (
                        "ConstraintCompiled must bring a matcher at its start, got one "
                        f"{matcher.num_tokens} tokens in"
                    )
            case Admitted() if self.params.constraint is not None and self._matcher is None:
                rule = "Admitted before ConstraintCompiled: a constrained request needs its matcher"
            case ChunkScheduled(num_tokens=n) | SampleScheduled(num_tokens=n):
                name = f"{type(event).__name__}(num_tokens={n})"
                left = self.num_tokens - self._num_computed_tokens
                if self._num_drafts:
                    rule = (
                        f"{name} comes while a step verifies {self._num_drafts} drafts: the "
                        "request's next positions are not known"
                    )
                elif isinstance(event, SampleScheduled) and event.num_drafts < 0:
                    rule = f"{name} may not have {event.num_drafts} drafts"
                elif (
                    isinstance(event, SampleScheduled)
                    and event.num_drafts
                    and self.num_generated_tokens + 1 + event.num_drafts > self.max_tokens
                ):
                    rule = (
                        f"{name} with {event.num_drafts} drafts would pass max_tokens "
                        f"({self.max_tokens}) with {self.num_generated_tokens} generated"
                    )
                elif n < 1:
                    rule = f"{name} must compute at least 1 token"
                elif n > left:
                    rule = f"{name} exceeds the {left} tokens left to compute"
                # A chunk that reaches the end must sample; one that does not, must not.
                elif isinstance(event, ChunkScheduled) and n == left:
                    rule = f"{name} reaches the last of the {left} tokens left, so it must sample"
                elif isinstance(event, SampleScheduled) and n < left:
                    rule = f"{name} stops short of the {left} tokens left, so it may not sample"
            case PrefixCacheHit(block_ids=block_ids, num_tokens=n):
                name = f"PrefixCacheHit(num_tokens={n})"
                if self._block_table or self._num_computed_tokens:
                    rule = f"{name} must come first: the request already holds blocks"
                elif not block_ids or not 0 < n < self.num_tokens:
                    rule = (
                        f"{name} must cover at least one block and leave at least one of "
                        f"the {self.num_tokens} tokens to compute"
                    )
            case BlocksReleased(num_blocks=n) if not 1 <= n <= len(self._block_table):
                rule = (
                    f"BlocksReleased(num_blocks={n}) must release at least one of the "
                    f"{len(self._block_table)} blocks held, and no more"
                )
            case TokenSampled(token_id=token_id) if self._num_placeholders < 1:
                rule = (
                    f"TokenSampled(token_id={token_id}) has no placeholder to fill: "
                    "no step in flight samples for this request"
                )
            case SampleDiscarded(step_id=step_id) if self._num_placeholders < 1:
                rule = (
                    f"SampleDiscarded(step_id={step_id}) has no placeholder to drop: "
                    "no step in flight samples for this request"
                )
            case SampleDiscarded(step_id=step_id) if (
                self._num_drafts
                and step_id == self._last_step_id
                and self._num_placeholders < 1 + self._num_drafts
            ):
                rule = (
                    f"SampleDiscarded(step_id={step_id}) drops the row verifying "
                    f"{self._num_drafts} drafts whole, {1 + self._num_drafts} placeholders, "
                    f"but {self._num_placeholders} are left: its tokens are being delivered"
                )
            case DraftVerified(num_accepted=accepted):
                name = f"DraftVerified(num_accepted={accepted})"
                if not self._num_drafts:
                    rule = f"{name} has no drafts to settle: no step verifies any"
                elif not 0 <= accepted <= self._num_drafts:
                    rule = f"{name} must be in [0, {self._num_drafts}] (the drafts)"
                elif self._num_placeholders != self._num_drafts - accepted:
                    rule = (
                        f"{name} must follow one TokenSampled per token delivered: "
                        f"{self._num_placeholders} placeholders are left, not "
                        f"{self._num_drafts - accepted}"
                    )
            case _:
                pass
        if rule is not None:
            raise InvalidTransition(self.request_id, self._status, event, rule)

    def _update(self, event: RequestEvent) -> None:
        match event:
            case ConstraintCompiled(matcher=matcher):
                self._matcher = matcher
            case Admitted(time=time):
                if self._first_scheduled_time is None:
                    self._first_scheduled_time = time
            case PrefixCacheHit(block_ids=block_ids, num_tokens=n):
                self._block_table.extend(block_ids)
                self._num_computed_tokens = n
                if not self._num_preemptions:
                    self._num_cached_tokens = n
            case BlocksAllocated(block_ids=block_ids):
                self._block_table.extend(block_ids)
            case BlocksReleased(num_blocks=n):
                del self._block_table[:n]
                self._num_released_blocks += n
            case ChunkScheduled(step_id=step_id, num_tokens=n):
                self._num_computed_tokens += n
                self._last_step_id = step_id
            case SampleScheduled(step_id=step_id, num_tokens=n, num_drafts=drafts):
                self._num_computed_tokens += n + drafts
                self._num_placeholders += 1 + drafts
                self._num_drafts = drafts
                self._last_step_id = step_id
            case TokenSampled(token_id=token_id, time=time):
                self._num_placeholders -= 1
                self._output_token_ids.append(token_id)
                if self._first_token_time is None:
                    self._first_token_time = time
                self._last_token_time = time
            case SampleDiscarded(step_id=step_id):
                if self._num_drafts and step_id == self._last_step_id:
                    # The row with drafts is discarded whole: its token and its drafts.
                    self._num_placeholders -= 1 + self._num_drafts
                    self._num_drafts = 0
                else:
                    self._num_placeholders -= 1
            case DraftVerified(num_accepted=accepted):
                rejected = self._num_drafts - accepted
                self._num_placeholders -= rejected
                self._num_drafts = 0
                if self._status is not RequestStatus.PREEMPTED:  # else nothing is computed
                    self._num_computed_tokens -= rejected
            case Preempted():
                self._block_table.clear()
                self._num_released_blocks = 0
                self._num_computed_tokens = 0
                self._num_preemptions += 1
            case Finished(reason=reason, time=time):
                self._finish_reason = reason
                self._end(time)
            case Cancelled(time=time):
                self._end(time)
            case _:
                # The one event left is Failed (mypy narrows the closed union to it), so the
                # match needs no branch for "no case matched".
                self._failure = event.message
                self._end(event.time)

    def _end(self, time: float) -> None:
        self._block_table.clear()
        self._num_released_blocks = 0
        self._end_time = time

    def __repr__(self) -> str:
        return (
            f"<Request {self.request_id} {self._status} "
            f"{self.num_generated_tokens}/{self.max_tokens} tokens, "
            f"{len(self._block_table)} blocks>"
        )
