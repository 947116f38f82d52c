"""The coordinator's relay on its own: fake replicas report, the books and handles follow."""

from __future__ import annotations

from typing import cast

import pytest

from twostroke.engine.coordinator.frames import WirePrompt
from twostroke.engine.coordinator.relay import ReplicaState, RequestRelay
from twostroke.engine.coordinator.replica_client import Replica
from twostroke.engine.coordinator.wire_outputs import Ending
from twostroke.engine.errors import (
    EngineClosed,
    EngineDead,
    ReplicaFailed,
    RequestCancelled,
    RequestRejected,
)
from twostroke.engine.handle import RequestHandle
from twostroke.engine.outputs import Delta
from twostroke.states.constraints import Choice
from twostroke.states.params import SamplingParams
from twostroke.states.routing import Router

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=8)


class FakeReplica:
    """Takes requests and cancellations; reports only what a test makes it report."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.added: list[int] = []
        self.cancelled: list[int] = []
        #: Prompt ids ``add`` returns at once (as a local replica does), or ``None``.
        self.prompt_token_ids: tuple[int, ...] | None = None
        #: Whether ``cancel`` ends a request at once (it never left the coordinator).
        self.cancel_at_once = False
        self.refusal: BaseException | None = None

    def add(
        self, request_id: int, prompt: WirePrompt, params: SamplingParams
    ) -> tuple[int, ...] | None:
        if self.refusal is not None:
            raise self.refusal
        self.added.append(request_id)
        return self.prompt_token_ids

    def cancel(self, request_id: int) -> bool:
        self.cancelled.append(request_id)
        return self.cancel_at_once


class Books:
    """A relay over ``n`` fake replicas, and how often it reported the death."""

    def __init__(self, n: int) -> None:
        self.fakes = [FakeReplica(i) for i in range(n)]
        states = [ReplicaState(cast(Replica, fake)) for fake in self.fakes]
        self.deaths = 0
        self.relay = RequestRelay(Router(n), states, on_death=self._died)

    def _died(self) -> None:
        self.deaths += 1

    def replica_of(self, handle: RequestHandle) -> int:
        return self.relay.open[handle.request_id].replica


def ending(token_ids: tuple[int, ...]) -> Ending:
    return Ending(
        token_ids=token_ids,
        text="x" * len(token_ids),
        finish_reason="length",
        prompt_tokens=3,
        queue_time=0.0,
        num_preemptions=0,
        logprobs=None,
    )


async def test_reports_become_deltas_and_an_output_on_the_coordinators_handle() -> None:
    books = Books(1)
    relay = books.relay
    handle = relay.submit("abc", PARAMS)
    assert not relay.idle.is_set()
    assert relay.open.keys() == {handle.request_id}
    verdict = relay.verdict(handle.request_id)
    assert verdict is not None
    assert not verdict.settled.is_set()
    relay.accepted(0, handle.request_id, (97, 98, 99))
    assert verdict.settled.is_set()
    assert verdict.refusal is None
    assert handle.prompt_token_ids == (97, 98, 99)
    # The replica's own request id (77) is replaced by the coordinator's.
    relay.delta(0, handle.request_id, Delta(77, "xy", (1, 2), None, None))
    relay.check_invariants()
    relay.finished(0, handle.request_id, ending((1, 2)))
    relay.check_invariants()
    assert relay.idle.is_set()
    assert not relay.open
    assert relay.verdict(handle.request_id) is None
    delta = await handle.next_delta()
    assert (delta.request_id, delta.text, delta.token_ids) == (handle.request_id, "xy", (1, 2))
    output = await handle.result()
    assert output.request_id == handle.request_id
    assert output.prompt_token_ids == (97, 98, 99)
    assert (output.token_ids, output.usage.completion_tokens) == ((1, 2), 2)
    assert output.metrics.ttft is not None  # timed from the first delta with tokens


async def test_a_replica_that_checks_at_once_settles_the_verdict_in_submit() -> None:
    books = Books(1)
    books.fakes[0].prompt_token_ids = (5, 6)
    handle = books.relay.submit([5, 6], PARAMS)
    verdict = books.relay.verdict(handle.request_id)
    assert verdict is not None
    assert verdict.settled.is_set()
    assert handle.prompt_token_ids == (5, 6)


async def test_a_request_that_ends_before_it_is_accepted_was_refused() -> None:
    books = Books(1)
    refused = books.relay.submit("abc", PARAMS)
    verdict = books.relay.verdict(refused.request_id)
    assert verdict is not None
    error = RequestRejected("prompt too long")
    books.relay.failed(0, refused.request_id, error)
    assert verdict.settled.is_set()
    assert verdict.refusal is error
    with pytest.raises(RequestRejected, match="prompt too long"):
        await refused.result()
    # Once accepted, a later failure is no refusal.
    accepted = books.relay.submit("abc", PARAMS)
    verdict = books.relay.verdict(accepted.request_id)
    assert verdict is not None
    books.relay.accepted(0, accepted.request_id, (1,))
    books.relay.failed(0, accepted.request_id, RequestCancelled(accepted.request_id))
    assert verdict.refusal is None
    books.relay.check_invariants()


async def test_a_refused_request_leaves_nothing_open() -> None:
    books = Books(1)
    books.fakes[0].refusal = RequestRejected("prompt too long")
    with pytest.raises(RequestRejected, match="prompt too long"):
        books.relay.submit("abc", PARAMS)
    books.relay.check_invariants()
    assert books.relay.idle.is_set()
    assert not books.relay.open
    assert books.relay.replicas[0].num_open == 0


async def test_stale_reports_are_dropped() -> None:
    books = Books(2)
    relay = books.relay
    handle = relay.submit("abc", PARAMS)
    other = 1 - books.replica_of(handle)
    relay.delta(other, handle.request_id, Delta(0, "no", (9,), None, None))
    relay.finished(other, handle.request_id, ending((9,)))
    relay.failed(other, handle.request_id, RuntimeError("not mine"))
    assert not handle.done()
    assert relay.open[handle.request_id].num_tokens == 0
    # A report about a request that has ended changes nothing either.
    relay.finished(books.replica_of(handle), handle.request_id, ending(()))
    relay.delta(0, handle.request_id, Delta(0, "late", (9,), None, None))
    relay.check_invariants()
    output = await handle.result()
    assert output.token_ids == ()
    assert output.metrics.ttft is None


async def test_a_dead_replicas_requests_without_tokens_move_once_the_others_fail() -> None:
    books = Books(3)
    relay = books.relay
    handles = [relay.submit(prompt, PARAMS) for prompt in ("aaaa", "bbbb", "cccc", "dddd")]
    doomed = books.replica_of(handles[0])
    on_doomed = [h for h in handles if books.replica_of(h) == doomed]
    assert len(on_doomed) == 2
    started, waiting = on_doomed
    relay.delta(doomed, started.request_id, Delta(0, "t", (1,), None, None))
    cause = RuntimeError("segfault")
    relay.replica_failed(doomed, cause)
    relay.replica_failed(doomed, RuntimeError("again"))  # once per replica
    relay.check_invariants()
    assert relay.replicas[doomed].failure is cause
    assert relay.num_resubmitted == 1
    moved_to = books.replica_of(waiting)
    assert moved_to != doomed
    assert books.fakes[moved_to].added.count(waiting.request_id) == 1
    with pytest.raises(ReplicaFailed) as failed:
        await started.result()
    assert failed.value.__cause__ is cause
    assert "segfault" in str(failed.value)
    # A resubmitted request is not moved twice, though a replica is left to take it.
    relay.replica_failed(moved_to, RuntimeError("out of memory"))
    relay.check_invariants()
    with pytest.raises(ReplicaFailed, match="out of memory"):
        await waiting.result()
    assert books.deaths == 0
    assert relay.death is None
    # The last death fails what is left, and is reported once.
    last = RuntimeError("power cut")
    survivor = ({0, 1, 2} - {doomed, moved_to}).pop()
    relay.replica_failed(survivor, last)
    relay.check_invariants()
    assert books.deaths == 1
    assert relay.death is last
    for handle in handles:
        with pytest.raises(ReplicaFailed):
            await handle.result()
    assert relay.idle.is_set()
    assert not relay.open


async def test_a_replica_reporting_the_engine_gone_counts_as_its_death() -> None:
    books = Books(2)
    relay = books.relay
    handle = relay.submit("abc", PARAMS)
    replica = books.replica_of(handle)
    relay.failed(replica, handle.request_id, EngineDead("the engine died"))
    assert relay.replicas[replica].failure is not None
    assert books.replica_of(handle) == 1 - replica  # resubmitted: it had no token yet
    relay.check_invariants()


async def test_closing_ends_open_requests_and_resubmits_nothing() -> None:
    books = Books(2)
    relay = books.relay
    first, second = relay.submit("aaaa", PARAMS), relay.submit("bbbb", PARAMS)
    relay.close(cancel=False)
    assert relay.closing
    assert len(relay.open) == 2
    relay.failed(books.replica_of(first), first.request_id, EngineClosed("stopping"))
    with pytest.raises(EngineClosed, match="stopping"):
        await first.result()
    relay.close(cancel=True)
    with pytest.raises(EngineClosed, match=f"closed before request {second.request_id}"):
        await second.result()
    relay.replica_failed(0, RuntimeError("gone"))
    relay.replica_failed(1, RuntimeError("gone"))
    assert books.deaths == 0
    assert relay.death is None
    assert relay.num_resubmitted == 0
    relay.check_invariants()


async def test_cancel_ends_at_once_only_if_the_request_never_left() -> None:
    books = Books(1)
    relay = books.relay
    kept, dropped = relay.submit("aaaa", PARAMS), relay.submit("bbbb", PARAMS)
    kept.cancel()
    assert books.fakes[0].cancelled == [kept.request_id]
    assert not kept.done()
    relay.failed(0, kept.request_id, RequestCancelled(kept.request_id))
    books.fakes[0].cancel_at_once = True
    dropped.cancel()
    dropped.cancel()  # idempotent: the handle has ended
    assert books.fakes[0].cancelled == [kept.request_id, dropped.request_id]
    for handle in (kept, dropped):
        with pytest.raises(RequestCancelled):
            await handle.result()
    relay.cancel(dropped.request_id)  # no longer open: nothing happens
    relay.check_invariants()
    assert relay.idle.is_set()


async def test_a_constrained_request_is_never_moved_to_another_replica() -> None:
    """Compiling runs the backend on the client's input: if that killed one replica, it
    would kill the next (every replica in turn), so the request fails with its replica."""
    books = Books(2)
    relay = books.relay
    params = SamplingParams(max_tokens=8, constraint=Choice(["yes", "no"]))
    handle = relay.submit("abc", params)
    plain = relay.submit("abc", PARAMS)
    replica = books.replica_of(handle)
    assert books.replica_of(plain) == replica  # prefix affinity
    relay.replica_failed(replica, RuntimeError("segfault"))
    relay.check_invariants()
    assert handle.request_id not in relay.open  # ended, not moved
    with pytest.raises(ReplicaFailed, match="segfault"):
        await handle.result()
    assert books.replica_of(plain) == 1 - replica  # the plain one moved
    assert relay.num_resubmitted == 1
    assert books.fakes[1 - replica].added == [plain.request_id]
