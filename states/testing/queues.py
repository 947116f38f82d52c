"""The scheduler's two queues as a test reads them: from its records, not its private lists.

The scheduler keeps both queues in arrival order (:meth:`Scheduler.check_invariants` says
so), and iterating a scheduler yields its records in arrival order too, so a queue is the
records in the statuses it holds. Nothing in the engine needs the ids of a queue; only tests
do, so they live here rather than on the scheduler.
"""

from __future__ import annotations

from twostroke.states.request import RequestStatus
from twostroke.states.scheduler import Scheduler

__all__ = ["running_ids", "waiting_ids"]

_WAITING = frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED})
_RUNNING = frozenset({RequestStatus.PREFILLING, RequestStatus.DECODING})


def waiting_ids(scheduler: Scheduler) -> tuple[int, ...]:
    """The requests waiting for admission (new or preempted), oldest first: admission's order."""
    return tuple(r.request_id for r in scheduler if r.status in _WAITING)


def running_ids(scheduler: Scheduler) -> tuple[int, ...]:
    """The admitted requests (prefilling or decoding), oldest first: the order steps serve them."""
    return tuple(r.request_id for r in scheduler if r.status in _RUNNING)
