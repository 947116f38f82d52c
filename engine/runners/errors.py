"""The runners' error: a step that cannot run."""

from __future__ import annotations

from twostroke.states.errors import EngineError

__all__ = ["RunnerError"]


class RunnerError(EngineError, RuntimeError):
    """A step cannot run: the runner was used out of protocol or a plan is inconsistent."""
