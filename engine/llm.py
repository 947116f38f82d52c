"""A blocking facade for scripts: ``LLM(...).generate(prompts)``.

It runs one :class:`~twostroke.engine.engine.Engine` on an event loop in a background thread
through an anyio blocking portal; every call is forwarded to that one engine (there is never
a second engine per call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Literal, cast

import anyio
import anyio.from_thread

from twostroke.engine.errors import EngineClosed
from twostroke.engine.handle import RequestHandle
from twostroke.engine.outputs import RequestOutput
from twostroke.engine.statistics import EngineStatistics
from twostroke.engine.surface import EngineSurface, open_surface
from twostroke.states.errors import EngineError
from twostroke.states.params import SamplingParams
from twostroke.states.prompts import Prompt

__all__ = ["LLM"]

_BACKENDS = ("asyncio", "trio")


class LLM:
    """Generate from a thread that has no event loop.

    Args:
        model: As for :meth:`Engine.open`.
        backend: The event loop the engine runs on (``"asyncio"`` or ``"trio"``).
        replicas: Serve through a :class:`~twostroke.engine.coordinator.Coordinator` over
            this many engine replicas (``None``: one plain engine, unless ``placement`` is
            given; :func:`~twostroke.engine.surface.open_surface` decides).
        placement: Where the replicas run (``"local"``, ``"process"`` or ``"ray"``; see
            :meth:`Coordinator.open`); alone, one replica there.
        **engine_options: Passed to :meth:`Engine.open` (or to every replica).

    Use it as a context manager, or call :meth:`close` when done.

    Raises:
        TypeError, ValueError: ``backend`` is not ``"asyncio"`` or ``"trio"``; errors of
            :meth:`Engine.open` otherwise.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        backend: Literal["asyncio", "trio"] = "asyncio",
        replicas: int | None = None,
        placement: Literal["local", "process", "ray"] | None = None,
        **engine_options: Any,
    ) -> None:
        accepted = ", ".join(map(repr, _BACKENDS))
        if not isinstance(backend, str):
            raise TypeError(
                f"backend must be one of {accepted}, got {type(backend).__name__} {backend!r}"
            )
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {accepted}, got {backend!r}")
        self._stack = contextlib.ExitStack()
        self._closed = False
        try:
            self._portal = self._stack.enter_context(
                anyio.from_thread.start_blocking_portal(backend)
            )
            opened = open_surface(model, replicas=replicas, placement=placement, **engine_options)
            portal: anyio.from_thread.BlockingPortal = self._portal
            wrapped: AbstractContextManager[EngineSurface] = portal.wrap_async_context_manager(
                opened
            )
            self._engine: EngineSurface = self._stack.enter_context(wrapped)
        except BaseException:
            self._stack.close()
            raise

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt, all batched together, and return outputs in order.

        Args:
            prompts: One prompt or a list of prompts (text, token ids or chat messages).
            params: One ``SamplingParams`` for all, or one per prompt.
            progress: Show a progress bar on the terminal.

        Raises:
            EngineClosed: :meth:`close` was called.
            TypeError: an entry of ``params`` is not ``SamplingParams`` (or ``None``).
            ValueError: ``params`` and ``prompts`` differ in length. Errors of
                :meth:`Engine.generate` otherwise (a note names the prompt's index).

        Every prompt is checked before any is queued, and a batch that fails queues
        nothing: a bad prompt anywhere in the list fails before anything runs.
        """
        if self._closed:
            raise EngineClosed("this LLM is closed: create a new one")
        batch: list[Prompt]
        if _is_single(prompts):
            batch = [cast(Prompt, prompts)]
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params] * len(batch)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(batch):
                raise ValueError(
                    f"params must be one SamplingParams or one per prompt: got {len(per_prompt)} "
                    f"for {len(batch)} prompts"
                )
            for index, entry in enumerate(per_prompt):
                if entry is not None and not isinstance(entry, SamplingParams):
                    raise TypeError(
                        f"params[{index}] must be SamplingParams or None, "
                        f"got {type(entry).__name__} {entry!r}"
                    )
        return self._portal.call(self._generate_all, batch, per_prompt, progress)

    async def _generate_all(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams | None],
        show_progress: bool,
    ) -> list[RequestOutput]:
        # Tokenize every prompt first: a bad one raises before any request exists.
        token_ids: list[list[int]] = []
        for index, prompt in enumerate(prompts):
            try:
                token_ids.append(await self._engine.tokenize(prompt))
            except Exception as exc:
                exc.add_note(f"(prompts[{index}] of the batch; nothing was queued)")
                raise
        # Then queue them all in one synchronous run: no step can start in between, so if
        # the engine rejects one (too long for the context or the KV pool), cancelling
        # those already queued leaves no trace of the batch.
        handles: list[RequestHandle] = []
        for index, (ids, request_params) in enumerate(zip(token_ids, params, strict=True)):
            try:
                handles.append(self._engine.submit(ids, request_params))
            except Exception as exc:
                for handle in handles:
                    handle.cancel()
                # Wait for the engine to apply the cancellations (at its next step boundary,
                # before it plans again), so the batch has left no trace when this raises.
                with anyio.CancelScope(shield=True):
                    for handle in handles:
                        with contextlib.suppress(EngineError):  # cancelled, or the engine ended
                            await handle.result()
                exc.add_note(f"(prompts[{index}] of the batch; nothing was run)")
                raise
        results: list[RequestOutput | None] = [None] * len(handles)
        from rich.progress import Progress

        with Progress(disable=not show_progress, transient=True) as bar:
            task = bar.add_task("generating", total=len(handles))

            async def collect(index: int) -> None:
                try:
                    results[index] = await handles[index].result()
                finally:
                    handles[index].cancel()
                bar.advance(task)

            async with anyio.create_task_group() as task_group:
                for index in range(len(handles)):
                    task_group.start_soon(collect, index)
        return [result for result in results if result is not None]

    def statistics(self) -> EngineStatistics:
        return self._portal.call(self._engine.statistics)  # on the engine's loop thread

    def close(self) -> None:
        """Drain open requests and stop the engine and its thread. Idempotent."""
        self._closed = True
        self._stack.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _is_single(prompts: object) -> bool:
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, Sequence) and prompts:
        first = prompts[0]
        return isinstance(first, int | dict)
    return False
