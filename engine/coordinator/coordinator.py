"""The data-parallel coordinator: one engine-shaped front over N engine replicas.

:meth:`Coordinator.open` starts N replicas — :class:`~twostroke.engine.engine.Engine` s in this
task group (``"local"``), child processes on this machine (``"process"``) or Ray actors
(``"ray"``) — and yields an object with the engine's public surface
(:class:`~twostroke.engine.surface.EngineSurface`). It routes whole requests, as given (text,
token ids or chat messages), to a replica chosen by :class:`~twostroke.states.routing.Router`
and relays the replica's deltas into its own :class:`~twostroke.engine.handle.RequestHandle`
(the books of open requests and the replicas' reports live in
:mod:`~twostroke.engine.coordinator.relay`).
It holds no tokenizer: each replica tokenizes, checks lengths, detokenizes and matches stop
strings (Megatron-LM's deduplicated engine and coordinator; vLLM V1 and SGLang split the same
way).

Structured concurrency all the way down: one task group, one supervisor task per replica.
Leaving the block drains open requests (or cancels them, with ``shutdown="cancel"`` or when
the body raised), then each replica is told to stop, and no child process outlives the block.
A replica that dies fails only its own open requests, with :class:`ReplicaFailed`; those that
had no token yet are resubmitted once to a live replica. :class:`EngineDead` comes only when
no replica is left (new work is refused, the body is cancelled and the block raises it).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from twostroke.engine.config import EngineConfig
from twostroke.engine.coordinator.auth import new_secret
from twostroke.engine.coordinator.config import CoordinatorConfig
from twostroke.engine.coordinator.frames import Start, wire_prompt
from twostroke.engine.coordinator.local import LocalReplica
from twostroke.engine.coordinator.relay import ReplicaState, RequestRelay
from twostroke.engine.coordinator.replica_client import Replica
from twostroke.engine.coordinator.statistics import CoordinatorStatistics, ReplicaStatistics
from twostroke.engine.errors import EngineClosed, EngineDead, ReplicaFailed
from twostroke.engine.handle import RequestHandle
from twostroke.engine.outputs import RequestOutput
from twostroke.engine.statistics import EngineStatistics
from twostroke.gpu.cores import usable_cores
from twostroke.states.params import SamplingParams, check_params
from twostroke.states.prompts import Prompt
from twostroke.states.routing import Router
from twostroke.states.statistics import total

__all__ = ["Coordinator", "CoordinatorStatistics", "ReplicaStatistics"]

#: ``Engine.open`` keywords that are not ``EngineConfig`` fields.
_OPEN_KEYWORDS = frozenset({"device", "model_name", "runner", "tokenizer"})


class Coordinator:
    """N engine replicas behind one engine surface. Use :meth:`open`."""

    def __init__(
        self,
        *,
        model_name: str,
        placement: str,
        router: Router,
        unhealthy_after: float,
    ) -> None:
        self._model_name = model_name
        self._placement = placement
        self._router = router
        self._unhealthy_after = unhealthy_after
        self._replicas: list[ReplicaState] = []
        self._relay = RequestRelay(router, self._replicas, on_death=self._died)
        self._task_group: anyio.abc.TaskGroup | None = None
        #: What a network replica's peer must prove it holds (:mod:`.auth`).
        self._secret = new_secret()

    # --- lifecycle ----------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model: str | None = None,
        *,
        replica_options: Sequence[Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> AsyncIterator[Coordinator]:
        """Start engine replicas for the body of an ``async with`` block.

        Args:
            model: As for :meth:`Engine.open`; every replica loads it.
            replica_options: One mapping per replica of extra :meth:`Engine.open` keywords
                (a ``device`` each, say); ``runner``/``tokenizer`` objects only for
                ``"local"``.
            **options: The fields of
                :class:`~twostroke.engine.coordinator.config.CoordinatorConfig`
                (``replicas``, ``placement``, ``routing``, ``unhealthy_after``,
                ``grace_period``), and :meth:`Engine.open` keywords for every replica
                (``device`` and the fields of :class:`EngineConfig`).

        Leaving the block drains open requests (or cancels them, with
        ``shutdown="cancel"``, or when the body raised) and stops every replica. If every
        replica died, the body is cancelled and the block raises :class:`EngineDead`.

        Raises:
            TypeError, ValueError: a bad argument or engine option (before any replica
                starts).
            ReplicaFailed: a replica process or actor could not start (the message says why).
            ModelLoadError, and the other errors of :meth:`Engine.open`: a local replica
                could not start.
            Exception: (``"ray"``) what ``ray.init()`` raised: this process is connected to
                no Ray cluster and could not start a local one.
        """
        own = attrs.fields_dict(CoordinatorConfig).keys()
        settings = CoordinatorConfig(**{k: v for k, v in options.items() if k in own})
        engine_options = {k: v for k, v in options.items() if k not in own}
        replicas, placement = settings.replicas, settings.placement
        per_replica = [dict(each) for each in (replica_options or [{}] * replicas)]
        if len(per_replica) != replicas:
            raise ValueError(
                f"replica_options must have one mapping per replica ({replicas}), "
                f"got {len(per_replica)}"
            )
        config = EngineConfig(
            **{k: v for k, v in engine_options.items() if k not in _OPEN_KEYWORDS}
        )
        coordinator = cls(
            model_name="",
            placement=placement,
            router=Router(replicas, settings.routing),
            unhealthy_after=settings.unhealthy_after,
        )
        if placement == "process" and config.torch_threads is None:
            engine_options = {**engine_options, "torch_threads": _split_threads(replicas)}
        for index in range(replicas):
            replica = coordinator._make_replica(
                index,
                placement,
                model,
                {**engine_options, **per_replica[index]},
                settings.grace_period,
            )
            coordinator._replicas.append(ReplicaState(replica))
        body_error: BaseException | None = None
        async with contextlib.AsyncExitStack() as stack:
            if placement == "ray":  # join or start the cluster once, before any replica
                from twostroke.engine.coordinator.ray import ray_cluster

                await stack.enter_async_context(ray_cluster())
            task_group = await stack.enter_async_context(anyio.create_task_group())
            coordinator._task_group = task_group
            for state in coordinator._replicas:
                task_group.start_soon(state.replica.run)
            start_error = await coordinator._wait_started()
            if start_error is not None:
                coordinator._close(cancel=True)
            else:
                try:
                    yield coordinator
                except BaseException as exc:
                    # Kept out of the task group so the caller sees its own exception.
                    body_error = exc
                    coordinator._close(cancel=True)
                else:
                    if config.shutdown == "drain":
                        await coordinator._relay.idle.wait()
                    coordinator._close(cancel=config.shutdown == "cancel")
        if start_error is not None:
            raise start_error
        death = coordinator._relay.death
        if death is not None:
            raise EngineDead(f"every replica died; the last: {death}") from death
        if body_error is not None:
            raise body_error

    def _make_replica(
        self,
        index: int,
        placement: str,
        model: str | None,
        options: dict[str, Any],
        grace_period: float,
    ) -> Replica:
        if placement == "local":
            return LocalReplica(index, self._relay, model, options)
        start = Start(model, options)
        if placement == "process":
            from twostroke.engine.coordinator.process import ProcessReplica

            return ProcessReplica(index, self._relay, start, grace_period=grace_period)
        from twostroke.engine.coordinator.ray import RayReplica

        return RayReplica(index, self._relay, start, grace_period=grace_period, secret=self._secret)

    async def _wait_started(self) -> BaseException | None:
        """Wait until every replica serves; the first start error, if any."""
        for state in self._replicas:
            await state.replica.ready.wait()
        for state in self._replicas:
            if state.replica.start_error is not None:
                return state.replica.start_error
        self._model_name = self._replicas[0].replica.model_name
        return None

    def _close(self, *, cancel: bool) -> None:
        """No new work; end open requests with ``EngineClosed`` if ``cancel``; stop replicas."""
        self._relay.close(cancel=cancel)
        for state in self._replicas:
            if state.failure is None:
                state.replica.close(cancel=cancel)

    def _died(self) -> None:
        """Every replica died: cancel the body (the block raises ``EngineDead``)."""
        if self._task_group is not None:
            self._task_group.cancel_scope.cancel()

    # --- the engine surface ---------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The name the replicas serve their model under."""
        return self._model_name

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output a request may have (the smallest replica's)."""
        lengths = [s.replica.max_model_len for s in self._replicas if s.failure is None]
        return min(lengths) if lengths else 0

    @property
    def tokenizer(self) -> None:
        """``None``: the replicas tokenize, each with its own; the front holds no tokenizer."""
        return None

    @property
    def placement(self) -> str:
        return self._placement

    def check_health(self) -> None:
        """Return if the coordinator takes work.

        Raises:
            EngineDead: every replica died (``__cause__`` is the last failure).
            EngineClosed: the ``async with`` block was left.
        """
        death = self._relay.death
        if death is not None:
            raise EngineDead(f"every replica died; the last: {death}") from death
        if self._relay.closing:
            raise EngineClosed("the coordinator is closed: its async with block was left")

    async def prepare(self, prompt: Prompt) -> Prompt:
        """``prompt`` as :meth:`submit` takes it without tokenizing on the caller's thread.

        The coordinator holds no tokenizer, so nothing is tokenized here and nothing goes
        to a replica and back: a ``"process"`` or ``"ray"`` replica tokenizes the prompt as
        given, in its own process, and ``prompt`` comes back checked for shape. A
        ``"local"`` replica's engine would tokenize it on this event loop, the
        coordinator's: it is tokenized in a worker thread of a live local replica's engine
        (every replica loads the same model) and the ids come back. Always a checkpoint.

        Raises:
            TypeError, ValueError: a malformed prompt (``"local"``: a chat template's
                refusal too).
            RequestRejected: (``"local"``) text or messages that cannot fit the context.
            EngineClosed, EngineDead: the coordinator no longer takes work.
        """
        await anyio.lowlevel.checkpoint()
        self.check_health()
        wire = cast(Prompt, wire_prompt(prompt))  # a Prompt, as it travels
        for state in self._replicas:
            replica = state.replica
            if not isinstance(replica, LocalReplica):
                return wire
            engine = replica.engine
            if state.failure is None and engine is not None:
                return await engine.tokenize(wire)
        return wire

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Route a request to a replica and return its handle at once.

        What is checked here depends on the placement. The coordinator has no tokenizer,
        so it checks only the prompt's shape and the parameters' type; a ``"local"``
        replica then tokenizes at once, so a too-long request raises
        :class:`RequestRejected` right here, as with a bare engine. A ``"process"`` or
        ``"ray"`` replica answers later: its verdict (``RequestRejected``, or
        ``ValueError`` for a token id outside the vocabulary) is raised by the handle's
        :meth:`~RequestHandle.result` and :meth:`~RequestHandle.next_delta`, and by
        :meth:`generate` and :meth:`stream`, which wait for it — so those two raise exactly
        as a bare engine's do, with every placement. ``handle.prompt_token_ids`` is ``()``
        until the replica has tokenized the prompt.

        Raises:
            TypeError, ValueError: a malformed prompt or parameters (nothing is queued).
            RequestRejected: (``"local"``) the request can never fit.
            EngineClosed, EngineDead: the coordinator no longer takes work.
        """
        self.check_health()
        params = check_params(params)
        return self._relay.submit(wire_prompt(prompt), params)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """Generate a complete output; cancelling the caller cancels the request.

        Raises:
            RequestFailed: a step of this request failed in its replica.
            ReplicaFailed: its replica died after it had produced tokens (or twice).
            EngineDead, EngineClosed: the coordinator stopped before the request finished.
            TypeError, ValueError, RequestRejected: bad input (nothing was generated).
        """
        await anyio.lowlevel.checkpoint()
        handle = self.submit(prompt, params)
        try:
            return await handle.result()
        finally:
            handle.cancel()

    @asynccontextmanager
    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestHandle]:
        """Stream a request's deltas; leaving the block early cancels the request.

        Entering waits for the replica's verdict, so a rejected request raises here.

        Raises:
            TypeError, ValueError, RequestRejected: bad input (nothing was queued).
            EngineClosed, EngineDead: the coordinator no longer takes work.
        """
        await anyio.lowlevel.checkpoint()
        handle = self.submit(prompt, params)
        try:
            verdict = self._relay.verdict(handle.request_id)
            if verdict is not None:
                await verdict.settled.wait()
                refusal = verdict.refusal
                if isinstance(refusal, TypeError | ValueError):  # RequestRejected is a ValueError
                    raise refusal
            yield handle
        finally:
            handle.cancel()

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids a replica computes for ``prompt`` (it holds the tokenizer).

        Raises:
            TypeError, ValueError: a malformed prompt.
            EngineDead, EngineClosed: no replica to ask.
        """
        await anyio.lowlevel.checkpoint()
        wire = wire_prompt(prompt)
        result: list[int] = await self._any_replica().call("tokenize", wire)
        return list(result)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text a replica decodes from ``token_ids``.

        Raises:
            TypeError, ValueError: not a sequence of ids in the vocabulary.
            EngineDead, EngineClosed: no replica to ask.
        """
        await anyio.lowlevel.checkpoint()
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
            raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
        text: str = await self._any_replica().call("detokenize", list(token_ids))
        return text

    def _any_replica(self) -> Replica:
        self.check_health()
        for state in self._replicas:
            if state.failure is None:
                return state.replica
        raise AssertionError("a healthy coordinator has a live replica")  # pragma: no cover

    async def wait_idle(self) -> None:
        """Wait until no request is open here and no step is in flight in any replica.

        Also refreshes every live replica's statistics. Always a checkpoint.
        """
        await anyio.lowlevel.checkpoint()
        while True:
            await self._relay.idle.wait()
            for state in self._replicas:
                if state.failure is None:
                    # A replica that died or stopped meanwhile has nothing in flight.
                    with contextlib.suppress(ReplicaFailed, EngineClosed):
                        await state.replica.call("wait_idle", None)
            if self._relay.idle.is_set():
                return

    def statistics(self) -> CoordinatorStatistics:
        """Totals over the live replicas, the coordinator's open count, and each replica."""
        now = anyio.current_time()
        entries = []
        live: list[EngineStatistics] = []
        for index, state in enumerate(self._replicas):
            engine = state.replica.statistics()
            alive = state.failure is None
            if engine is not None and engine.num_steps != state.steps_seen:
                state.steps_seen = engine.num_steps
                state.progress_time = now
            stalled = state.num_open > 0 and now - state.progress_time > self._unhealthy_after
            if alive and engine is not None:
                live.append(engine)
            entries.append(
                ReplicaStatistics(
                    index=index,
                    placement=self._placement,
                    alive=alive,
                    healthy=alive and not stalled,
                    pid=state.replica.pid,
                    num_open_requests=state.num_open,
                    load_tokens=self._router.load(index),
                    engine=engine,
                    failure=None if state.failure is None else str(state.failure),
                )
            )
        totals = attrs.asdict(total(EngineStatistics, live), recurse=False)
        totals["num_open_requests"] = len(self._relay.open)  # the coordinator's own count
        return CoordinatorStatistics(
            **totals,
            num_replicas_alive=sum(1 for s in self._replicas if s.failure is None),
            num_resubmitted=self._relay.num_resubmitted,
            relay_seconds=sum(state.replica.relay_seconds for state in self._replicas),
            replicas=tuple(entries),
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the coordinator's and the router's books disagree."""
        self._relay.check_invariants()

    def __repr__(self) -> str:
        alive = sum(1 for s in self._replicas if s.failure is None)
        return (
            f"<Coordinator {self._model_name!r} {self._placement} "
            f"{alive}/{len(self._replicas)} replicas alive, {len(self._relay.open)} open>"
        )


def _split_threads(replicas: int) -> int:
    """torch threads per replica process: the cores this process may run on
    (:func:`~twostroke.gpu.cores.usable_cores`) shared out, at least one each.

    The same rule as one engine's (every core, each replica's steps on its own forward
    thread), but fixed: the children wait passively at OpenMP's barriers
    (:func:`~twostroke.gpu.openmp.replica_wait_policy`), as no thread governor watches
    them. With cores - 1, one process replica ran at 0.90 of a bare engine on 2 cores,
    because it computed on one core against the engine's two.
    """
    return max(1, usable_cores() // replicas)
