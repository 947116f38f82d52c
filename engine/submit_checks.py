"""What every surface's ``submit`` checks of a request's parameters before it queues anything.

Kept apart from :mod:`twostroke.engine.surface` (which opens engines and coordinators) so the
coordinator can ask it without importing the engine's text and sampling modules.
"""

from __future__ import annotations

from twostroke.states.params import SamplingParams

__all__ = ["check_params"]

#: What a submit without parameters gets: one frozen value, shared (not made per submit).
_DEFAULT_PARAMS = SamplingParams()


def check_params(params: SamplingParams | None) -> SamplingParams:
    """The parameters a submit gets: ``SamplingParams()`` for ``None``, checked otherwise.

    Every surface's ``submit`` asks this first, before anything is queued.

    Raises:
        TypeError: ``params`` is not a :class:`SamplingParams`.
    """
    if params is None:
        return _DEFAULT_PARAMS
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    return params
