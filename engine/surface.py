"""The engine surface: what every front end may ask of an engine, defined once.

:class:`~twostroke.engine.engine.Engine` (one model on one device) and the data-parallel
coordinator (N engine replicas behind one front) both satisfy :class:`EngineSurface`, so the
``LLM`` facade, the CLI, the HTTP server and ``twostroke bench`` take either. A front end
that needs anything outside this protocol is reaching past the surface. Which of the two a
front end opens, :func:`open_surface` decides, by one rule for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from twostroke.engine.handle import RequestHandle
from twostroke.engine.outputs import RequestOutput
from twostroke.states.params import SamplingParams
from twostroke.states.prompts import Prompt

if TYPE_CHECKING:
    from twostroke.engine.statistics import EngineStatistics
    from twostroke.engine.text.tokenizer import Tokenizer

__all__ = ["EngineSurface", "open_surface"]


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

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer requests are tokenized with, or ``None`` where it is not here.

        An ``Engine`` holds its own; a coordinator's front holds none (each replica
        tokenizes). The server reads its chat template for the tools' format.
        """
        ...

    async def prepare(self, prompt: Prompt) -> Prompt:
        """``prompt`` as :meth:`submit` takes it without slow work on the caller's thread.

        An ``Engine`` renders and tokenizes text or chat messages in a worker thread and
        returns the ids; a coordinator returns the prompt checked for shape, for its
        replica's engine to tokenize (with ``"local"`` replicas, tokenized in one of their
        engines' worker threads: no round trip either way). See :meth:`Engine.prepare`.
        """
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


def open_surface(
    model: str | None = None,
    *,
    replicas: int | None = None,
    placement: str | None = None,
    **options: Any,
) -> AbstractAsyncContextManager[EngineSurface]:
    """Open an engine, or a coordinator over engine replicas: the one rule of every front end.

    A plain :class:`~twostroke.engine.engine.Engine` unless ``replicas`` or ``placement`` is
    given; then a :class:`~twostroke.engine.coordinator.Coordinator` over ``replicas``
    replicas (1 if only ``placement`` is given) placed by ``placement`` (``"local"`` if only
    ``replicas`` is). One replica behind a coordinator is still a coordinator, as asked: in a
    process of its own it keeps the model out of this one, and the bench measures the relay
    on it. ``LLM``, ``twostroke generate`` and ``serve``, and ``twostroke bench`` all open
    through here.

    Args:
        model: As for :meth:`Engine.open`.
        replicas: How many engine replicas behind a coordinator; ``None``: no coordinator.
        placement: Where the replicas run (see
            :class:`~twostroke.engine.coordinator.config.CoordinatorConfig`).
        **options: :meth:`Engine.open` keywords (for every replica), and the coordinator's
            other options when it is one.

    Returns:
        The engine's or the coordinator's ``async with`` block; nothing has started yet.
    """
    from twostroke.engine.engine import Engine

    if replicas is None and placement is None:
        return Engine.open(model, **options)
    from twostroke.engine.coordinator import Coordinator

    if replicas is not None:
        options["replicas"] = replicas
    if placement is not None:
        options["placement"] = placement
    return Coordinator.open(model, **options)
