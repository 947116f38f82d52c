"""The ``local`` placement: engine replicas in the coordinator's own task group.

A :class:`LocalReplica` opens an :class:`~twostroke.engine.engine.Engine` in this process and
relays its handles' output to the coordinator's relay with direct calls (no frames): each
handle reads by callbacks (:meth:`~twostroke.engine.handle.RequestHandle.relay_to`), so a
request costs no task. It is the one module of the coordinator's side that holds an engine
(the other placements reach theirs through
:mod:`~twostroke.engine.coordinator.replica_server`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, cast

import anyio

from twostroke.engine.coordinator.frames import WirePrompt
from twostroke.engine.coordinator.replica_client import BaseReplica, Relay
from twostroke.engine.coordinator.wire_outputs import Ending
from twostroke.engine.engine import Engine
from twostroke.engine.errors import EngineClosed, EngineDead, RequestCancelled, RequestFailed
from twostroke.engine.handle import RequestHandle
from twostroke.engine.outputs import Delta, RequestOutput
from twostroke.engine.statistics import EngineStatistics
from twostroke.states.params import SamplingParams

__all__ = ["LocalReplica"]


class LocalReplica(BaseReplica):
    """An :class:`Engine` in the coordinator's own task group.

    Args:
        index: The replica's index.
        relay: Where it reports (the coordinator's relay).
        model: As for :meth:`Engine.open`.
        options: Keyword arguments of :meth:`Engine.open` (``runner``, ``device``, config).
    """

    pid: int | None = None
    #: The relay runs inside the engine's bookkeeping stroke: counted there, not here.
    relay_seconds = 0.0

    def __init__(self, index: int, relay: Relay, model: str | None, options: Mapping[str, Any]):
        super().__init__(index, relay)
        self._model = model
        self._options = dict(options)
        self._engine: Engine | None = None
        self._handles: dict[int, RequestHandle] = {}
        self._closed = anyio.Event()

    @property
    def engine(self) -> Engine | None:
        """The replica's engine while it runs."""
        return self._engine

    async def run(self) -> None:
        try:
            async with Engine.open(self._model, **self._options) as engine:
                self._engine = engine
                self._max_model_len = engine.max_model_len
                self._model_name = engine.model_name
                self._ready.set()
                await self._closed.wait()
        except Exception as exc:
            if not self._ready.is_set():
                self._start_error = exc
                self._ready.set()
                return
            self._relay.replica_failed(self.index, exc)
        finally:
            self._engine = None

    def add(
        self, request_id: int, prompt: WirePrompt, params: SamplingParams
    ) -> tuple[int, ...] | None:
        assert self._engine is not None
        handle = self._engine.submit(cast(Any, prompt), params)  # the engine checks it
        self._handles[request_id] = handle
        handle.relay_to(partial(self._on_delta, request_id), partial(self._on_end, request_id))
        return handle.prompt_token_ids

    def cancel(self, request_id: int) -> bool:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.cancel()
        return False

    async def call(self, method: str, argument: Any) -> Any:
        engine = self._engine
        if engine is None:
            raise EngineClosed(f"replica {self.index} is not running")
        if method == "tokenize":
            return await engine.tokenize(argument)
        if method == "detokenize":
            return await engine.detokenize(argument)
        assert method == "wait_idle", method
        await engine.wait_idle()
        return engine.statistics()

    def close(self, *, cancel: bool) -> None:
        if cancel:
            for handle in list(self._handles.values()):
                handle.cancel()
        self._closed.set()

    def statistics(self) -> EngineStatistics | None:
        return None if self._engine is None else self._engine.statistics()

    def _on_delta(self, request_id: int, delta: Delta) -> None:
        self._relay.delta(self.index, request_id, delta)

    def _on_end(
        self, request_id: int, output: RequestOutput | None, error: BaseException | None
    ) -> None:
        del self._handles[request_id]
        if output is None:
            assert error is not None
            if isinstance(error, EngineDead):
                self._relay.replica_failed(self.index, error)
            else:
                self._relay.failed(self.index, request_id, _renumbered(error, request_id))
            return
        self._relay.finished(
            self.index,
            request_id,
            Ending(
                token_ids=output.token_ids,
                text=output.text,
                finish_reason=output.finish_reason,
                prompt_tokens=output.usage.prompt_tokens,
                queue_time=output.metrics.queue_time,
                num_preemptions=output.metrics.num_preemptions,
                logprobs=output.logprobs,
                cached_prompt_tokens=output.usage.cached_prompt_tokens,
            ),
        )


def _renumbered(error: BaseException, request_id: int) -> BaseException:
    """A replica engine's request error, under the coordinator's request id."""
    if isinstance(error, RequestCancelled):
        return RequestCancelled(request_id)
    if isinstance(error, RequestFailed):
        message = str(error).removeprefix(f"request {error.request_id} failed: ")
        renumbered = RequestFailed(request_id, message)
        renumbered.__cause__ = error.__cause__
        return renumbered
    return error
