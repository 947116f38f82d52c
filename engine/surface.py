"""The engine surface: what every front end may ask of an engine, defined once.

:class:`~twostroke.engine.engine.Engine` (one model on one device) and the data-parallel
coordinator (N engine replicas behind one front) both satisfy :class:`EngineSurface`, so the
``LLM`` facade, the CLI, the HTTP server and ``twostroke bench`` take either. A front end
that needs anything outside this protocol is reaching past the surface.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from twostroke.engine.handle import RequestHandle
from twostroke.engine.outputs import RequestOutput
from twostroke.engine.text.prompts import Prompt
from twostroke.states.params import SamplingParams

if TYPE_CHECKING:
    from twostroke.engine.statistics import EngineStatistics

__all__ = ["EngineSurface"]


@runtime_checkable
class EngineSurface(Protocol):
    """The public surface of an engine or of a coordinator over engine replicas."""

    @property
    def model_name(self) -> str:
        """The name the engine serves its model under (the CLI's ``--model`` as given)."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output a request may have."""
        ...

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request and return its handle at once (see :meth:`Engine.submit`)."""
        ...

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """Generate a complete output; cancelling the caller cancels the request."""
        ...

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> AbstractAsyncContextManager[RequestHandle]:
        """Stream a request's deltas; leaving the block early cancels the request."""
        ...

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids the engine would compute for ``prompt`` (chat template applied)."""
        ...

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``."""
        ...

    async def wait_idle(self) -> None:
        """Wait until no request is open and no step is in flight."""
        ...

    def check_health(self) -> None:
        """Return if the engine takes work; raise ``EngineDead`` or ``EngineClosed`` if not."""
        ...

    def statistics(self) -> EngineStatistics:
        """A snapshot of counters and gauges, cheap to take at any time."""
        ...
