"""The engine's constrained requests: their compiler, and the token masks of their steps.

A constrained request reaches the scheduler only once its constraint is compiled (on a
compile thread, bounded in time: :class:`~twostroke.engine.structured.GrammarCompiler`), so
that the bookkeeping stroke never waits for a compiler. Each step that samples constrained
rows carries a :class:`~twostroke.engine.structured.masks.StepMasks`; the bookkeeping stroke
fills it once every step before it is applied (then each row's matcher has seen every token
before the step), which at depth 2 is while the step's layers run, and the runner waits for
it only where it samples those rows (docs/structured-output.md, "The overlap").

The bookkeeping stroke fills a step's rows in a worker thread, all at once on llguidance's
thread pool (:func:`~twostroke.engine.structured.fill_bitmasks`, the GIL released), and
awaits it: the event loop serves the other tasks meanwhile (the server's requests, the
deliveries), where filling row after row on it had stalled them (a 60-row constrained request
made a plain 8-token completion beside it take 2.2 s instead of 0.01 s). Nothing else
touches the matchers while it waits: only the bookkeeping stroke advances them, and it is
the one waiting (shielded: a cancelled wait still lets the thread finish first).

Kept apart from :mod:`twostroke.engine.engine`: the engine decides *when* (a plan is made, a
step is applied, the engine dies); this module knows *how*, and imports the structured-output
backend only when the first constrained request arrives.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from twostroke.engine.errors import ConstraintFailed, RequestFailed
from twostroke.engine.structured.masks import StepMasks
from twostroke.engine.text.tokenizer import Tokenizer
from twostroke.states.constraints import Constraint, Matcher
from twostroke.states.errors import ConstraintRejected
from twostroke.states.plan import StepPlan
from twostroke.states.request import Request
from twostroke.states.scheduler import Scheduler

if TYPE_CHECKING:
    import llguidance

    from twostroke.engine.structured import GrammarCompiler

__all__ = ["Constraining"]


class Constraining:
    """The compiler of one engine's constraints and the masks of its steps in flight.

    Args:
        tokenizer: The engine's tokenizer, whose vocabulary the masks cover.
        pin_memory: Page-locked masks, for an asynchronous copy to a CUDA device.
    """

    def __init__(self, tokenizer: Tokenizer, *, pin_memory: bool) -> None:
        self._tokenizer = tokenizer
        self._pin_memory = pin_memory
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = anyio.Lock()
        # llguidance's thread pool for the masks, made with the compiler; one fill at a time.
        self._executor: llguidance.LLExecutor | None = None
        self._fill_limiter = anyio.CapacityLimiter(1)
        #: Constrained requests whose constraint is compiling (not in the scheduler yet):
        #: from :meth:`begin` to the end of :meth:`matcher`. They wait for admission as
        #: much as the scheduler's waiting requests, and count with them.
        self.compiling: set[int] = set()
        # What each compiling request awaits, so that cancelling it drops its compile.
        self._compiles: dict[int, anyio.CancelScope] = {}
        # Masks of steps in flight that wait for the steps before them to be applied, and
        # the drafts of their constrained rows that verify any.
        self._pending: dict[int, StepMasks] = {}
        self._drafts: dict[int, dict[int, tuple[int, ...]]] = {}
        # Filled masks whose step may still be sampling (the runner's wait is not final).
        self._filled: deque[StepMasks] = deque()
        #: Masks filled, one per constrained row sampled (a finished request's row is not).
        self.num_masked_rows = 0
        #: Seconds the bookkeeping stroke spent filling masks.
        self.mask_fill_seconds = 0.0
        self._mask_wait_seconds = 0.0

    def begin(self, request_id: int) -> None:
        """Count ``request_id`` as :attr:`compiling` from now (its submit) until its
        :meth:`matcher` returns or raises, or it is :meth:`cancel` led."""
        self.compiling.add(request_id)

    def cancel(self, request_id: int) -> None:
        """The request was cancelled: it waits no more, and its compile is given up (dropped
        from the compiler's queue if it has not started)."""
        self.compiling.discard(request_id)
        scope = self._compiles.get(request_id)
        if scope is not None:
            scope.cancel()

    async def matcher(self, request_id: int, constraint: Constraint) -> Matcher | None:
        """Compile ``constraint`` on a compile thread (within the compiler's time limit) and
        return a matcher at its start; ``request_id`` no longer counts as :attr:`compiling`
        once it returns or raises.

        Returns:
            The matcher, or ``None`` if the request was :meth:`cancel` led meanwhile.

        Raises:
            ConstraintRejected: the backend is missing, cannot read this tokenizer, refuses
                the constraint (or raised anything while compiling it or copying its
                matcher: one request's input never ends the engine) or did not compile it
                in time.
        """
        with anyio.CancelScope() as scope:
            self._compiles[request_id] = scope
            if request_id not in self.compiling:  # cancelled before this task ran
                scope.cancel()
            try:
                compiled = await (await self._get_compiler()).compile(constraint)
                return compiled.matcher()
            except ConstraintRejected:
                raise
            except Exception as exc:  # the compiler refuses what the backend raises: a net
                raise ConstraintRejected(
                    f"constraint.{constraint.argument}", f"{type(exc).__name__}: {exc}"
                ) from exc
            finally:
                self.compiling.discard(request_id)
                del self._compiles[request_id]
        return None

    async def _get_compiler(self) -> GrammarCompiler:
        """The compiler, made on first use (reading the vocabulary off the loop)."""
        async with self._compiler_lock:
            if self._compiler is None:
                try:
                    from llguidance import LLExecutor

                    from twostroke.engine.structured import GrammarCompiler, Vocabulary

                    vocabulary = await anyio.to_thread.run_sync(
                        Vocabulary.from_tokenizer, self._tokenizer
                    )
                except (ImportError, TypeError) as exc:  # StructuredOutputUnavailable is one
                    raise ConstraintRejected("constraint", str(exc)) from exc
                self._executor = LLExecutor()
                self._compiler = GrammarCompiler(vocabulary)
            return self._compiler

    def masks_for(self, plan: StepPlan) -> StepMasks | None:
        """The masks of a new plan's constrained rows (``None``: it has none), pending until
        :meth:`fill_oldest` fills them."""
        constrained = [
            entry for entry in plan.requests if entry.sample and entry.params.constraint is not None
        ]
        if not constrained:
            return None
        assert self._compiler is not None  # a constrained request was compiled
        masks = StepMasks(
            plan.step_id,
            tuple(entry.request_id for entry in constrained),
            self._compiler.vocabulary.vocab_size,
            pin_memory=self._pin_memory,
            num_samples=tuple(entry.num_samples for entry in constrained),
        )
        # A drafted row's masks after each draft: the matcher followed through them.
        self._drafts[plan.step_id] = {
            entry.request_id: entry.draft_token_ids
            for entry in constrained
            if entry.draft_token_ids
        }
        self._pending[plan.step_id] = masks
        return masks

    @staticmethod
    def failure_of(request: Request) -> ConstraintFailed | None:
        """Why a constrained request's backend gave up on its output, as the request's error
        (``None`` if it did not: the request failed for another reason).

        The matcher (a :class:`~twostroke.engine.structured.GuidanceMatcher`) knows: the
        limit it hit, named with its value, or a dead end. One that raises asked is ``None``:
        the request still fails, with the error its caller has.
        """
        matcher, constraint = request.matcher, request.params.constraint
        try:
            reason = getattr(matcher, "failure", None)
        except Exception:  # a backend that raised cannot say why either: the caller's error
            return None
        if matcher is None or constraint is None or not isinstance(reason, str):
            return None
        return ConstraintFailed(
            request.request_id,
            f"constraint.{constraint.argument}",
            f"the backend gave up at output token {matcher.num_tokens + 1}: {reason}",
        )

    async def fill_oldest(
        self, scheduler: Scheduler, fail: Callable[[int, RequestFailed], None]
    ) -> None:
        """Fill and publish the masks of the oldest step in flight, if it waits for them.

        Call it once every step before that one is applied: each matcher has then advanced
        by every token its request sampled before the step. The rows are filled in a worker
        thread, all at once; the loop serves other tasks meanwhile. A matcher that fails to
        compute its mask fails its request (``fail(request_id, error)``, a
        :class:`ConstraintFailed` where the backend gave up); whatever else raises while
        filling fails the step's constrained requests. Nothing raised here ends the engine.

        Not cancelled while the thread fills (shielded): the matchers are the thread's until
        it returns.
        """
        inflight = scheduler.inflight_plans
        if not inflight:
            return
        masks = self._pending.pop(inflight[0].step_id, None)
        drafts = self._drafts.pop(inflight[0].step_id, {})
        if masks is None:
            return
        began = time.perf_counter()
        rows: list[tuple[Request, int, tuple[int, ...]]] = []
        for request_id, row in masks.rows.items():
            request = scheduler.get(request_id)
            if request is None or request.is_terminal or request.matcher is None:
                continue  # its sample is dropped: the row may stay empty
            rows.append((request, row, drafts.get(request_id, ())))
        failures: list[tuple[Request, Exception]] = []
        if rows:
            with anyio.CancelScope(shield=True):
                try:
                    failures = await anyio.to_thread.run_sync(
                        self._fill, rows, masks, limiter=self._fill_limiter
                    )
                except Exception as fault:
                    # The fill's own fault, no one matcher's (their faults it names): the
                    # step's constrained requests fail, not the engine.
                    failures = [(request, fault) for request, _, _ in rows]
        for request, exc in failures:
            request_id = request.request_id
            error = self.failure_of(request)
            fail(request_id, error or RequestFailed(request_id, f"the constraint failed: {exc}"))
        self.num_masked_rows += len(rows) - len(failures)
        masks.fill_seconds = time.perf_counter() - began
        masks.publish()
        self.mask_fill_seconds += masks.fill_seconds
        self._filled.append(masks)

    def _fill(
        self, rows: list[tuple[Request, int, tuple[int, ...]]], masks: StepMasks
    ) -> list[tuple[Request, Exception]]:
        """Fill ``rows`` of ``masks`` (in a worker thread); the requests whose matcher failed.

        A request with drafts has a row after each draft too, filled from a fork of its
        matcher followed through the drafts (see :func:`_followed`). Each matcher fills one
        row: a position that repeats the one before (past a refused draft) gets a copy of
        its row, since llguidance refuses a matcher twice in one call ("Already borrowed",
        which killed the engine) and a copy is cheaper than a fork's mask. llguidance's
        matchers all at once on its thread pool; any other :class:`Matcher` (a test's) row
        by row. Whatever one raises fails its request only: where the call for all of them
        raises, each is filled alone to find whose it is.
        """
        from twostroke.engine.structured import GuidanceMatcher, bitmask_row, bitmask_rows
        from twostroke.engine.structured import matcher as guidance

        failures: list[tuple[Request, Exception]] = []
        by_row: dict[int, Request] = {}
        together: list[tuple[GuidanceMatcher, int]] = []
        copies: list[tuple[int, int]] = []  # (a filled row, a row that repeats it), in order
        for request, first, drafts in rows:
            assert request.matcher is not None
            try:
                matchers = [request.matcher, *_followed(request.matcher, drafts)]
            except Exception as exc:  # the backend gave up: this request fails
                failures.append((request, exc))
                continue
            filled: dict[int, int] = {}  # id of a matcher (alive until the loop ends): its row
            for offset, matcher in enumerate(matchers):
                row = first + offset
                by_row[row] = request
                if id(matcher) in filled:
                    copies.append((filled[id(matcher)], row))
                    continue
                filled[id(matcher)] = row
                if isinstance(matcher, GuidanceMatcher):
                    together.append((matcher, row))
                    continue
                try:
                    matcher.fill_bitmask(bitmask_row(masks.bitmask, row))
                except Exception as exc:  # the backend gave up: this request fails
                    failures.append((request, exc))
                    break
        if together:
            assert self._executor is not None  # made with the compiler
            failed: list[tuple[int, Exception]] = []
            try:
                guidance.fill_bitmasks(
                    together, bitmask_rows(masks.bitmask), self._executor, failures=failed
                )
            except Exception:  # not one matcher's limit: which is at fault, each alone says
                failed = []
                for matcher, row in together:
                    try:
                        matcher.fill_bitmask(bitmask_row(masks.bitmask, row))
                    except Exception as exc:
                        failed.append((row, exc))
            failures += [(by_row[row], exc) for row, exc in failed]
        bitmask = masks.bitmask.numpy()  # numpy: no ATen (and no OpenMP team) in this thread
        for source, row in copies:
            bitmask[row] = bitmask[source]
        once = {request.request_id: (request, exc) for request, exc in reversed(failures)}
        return list(once.values())

    def mask_wait_seconds(self, scheduler: Scheduler) -> float:
        """Seconds the runner waited for masks, over the steps the scheduler has applied.

        A step's wait is final once it is applied (the runner sampled it before it returned);
        the waits of steps still in flight count once they are.
        """
        inflight = scheduler.inflight_plans
        oldest = inflight[0].step_id if inflight else None
        while self._filled and (oldest is None or self._filled[0].step_id < oldest):
            self._mask_wait_seconds += self._filled.popleft().wait_seconds
        return self._mask_wait_seconds

    def abandon(self) -> None:
        """The engine stopped: no pending masks will be filled; a runner waiting wakes."""
        for masks in self._pending.values():
            masks.abandon()
        self._pending.clear()
        self._drafts.clear()
        self._filled.clear()


def _followed(matcher: Matcher, drafts: tuple[int, ...]) -> list[Matcher]:
    """The matchers of the positions after each of ``drafts``: forks of ``matcher`` followed
    through them (none without drafts).

    Past a draft the constraint refuses (or one after the output ended), the mask before it
    forbids it, so the draft ends there and what the positions after it sample is dropped:
    they take that last mask again, a valid one, and are followed no further. Their entries
    are then the same matcher as the position before (``matcher`` itself where the first
    draft is refused): a caller fills its row once and copies it.
    """
    followed: list[Matcher] = []
    follower = matcher
    ended = False
    for token_id in drafts:
        if not ended and not follower.terminated:
            fork = follower.fork()
            if fork.advance(token_id):
                follower = fork
            else:
                ended = True
        followed.append(follower)
    return followed
