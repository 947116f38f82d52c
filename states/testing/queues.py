"""The scheduler's two queues as a test reads them: from its records, not its private lists.

The scheduler keeps both queues in rank order (:meth:`Scheduler.check_invariants` says so:
priority with aging, then arrival; with one priority, arrival order), so a queue is the
records in the statuses it holds, sorted by :meth:`Scheduler.rank`. Nothing in the engine
needs the ids of a queue; only tests do, so they live here rather than on the scheduler.
"""

from __future__ import annotations

from twostroke.states.request import RequestStatus
from twostroke.states.scheduler import Scheduler

__all__ = ["running_ids", "waiting_ids"]

_WAITING = frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED})
_RUNNING = frozenset({RequestStatus.PREFILLING, RequestStatus.DECODING})


def _queue(scheduler: Scheduler, statuses: frozenset[RequestStatus]) -> tuple[int, ...]:
    ids = [r.request_id for r in scheduler if r.status in statuses]
    return tuple(sorted(ids, key=scheduler.rank))


def waiting_ids(scheduler: Scheduler) -> tuple[int, ...]:
    """The requests waiting for admission (new or preempted) in admission's order: by rank."""
    return _queue(scheduler, _WAITING)


def running_ids(scheduler: Scheduler) -> tuple[int, ...]:
    """The admitted requests (prefilling or decoding) in the order steps serve them: by rank
    (preemption takes the last)."""
    return _queue(scheduler, _RUNNING)
