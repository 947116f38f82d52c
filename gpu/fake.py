"""Devices for tests: a GPU in virtual time, and an event that fires on a chosen query.

:class:`FakeDevice` behaves like a GPU queue without a GPU: a launch returns at once and its
completion fires ``step_time`` seconds of loop time later, behind the steps before it, so
"a step is in flight" is a real, controllable state under trio's ``MockClock``; it can also
lose its context (:meth:`FakeDevice.lose_context`) like a GPU after an illegal address.
:class:`VirtualEvent` and :class:`CountdownEvent` test polling without a clock of their own.
``select_device("fake")`` (:mod:`twostroke.gpu.selection`) gives a :class:`FakeDevice`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.lowlevel
import attrs
import torch

from twostroke.gpu.completion import Completion, Launched
from twostroke.gpu.device import Device, _resolve
from twostroke.gpu.validators import check_int_at_least, check_seconds

__all__ = ["LOST_CONTEXT", "CountdownEvent", "FakeDevice", "VirtualEvent"]

T = TypeVar("T")

#: What CUDA says once a kernel touched an illegal address (the context is lost after it).
LOST_CONTEXT = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call"
)


@attrs.define(eq=False)
class VirtualEvent:
    """An event that fires when the event loop's clock reaches ``deadline``.

    Under trio's ``MockClock(autojump_threshold=0)`` a step of ``step_time`` takes no wall
    time, yet a waiter goes through every poll and sleep it would on a GPU.

    Attributes:
        deadline: Loop time (``anyio.current_time()``) at which the event fires.
        queries: How many times :meth:`query` was called.
    """

    deadline: float
    queries: int = 0

    def query(self) -> bool:
        """Return whether the loop's clock has reached the deadline (needs a running loop)."""
        self.queries += 1
        return anyio.current_time() >= self.deadline


@attrs.define(eq=False)
class CountdownEvent:
    """An event that fires on its ``fires_on_query``-th query: to test polling, clock-free.

    Attributes:
        fires_on_query: The first query that returns true (1 = fired from the start).
        queries: How many times :meth:`query` was called.
    """

    fires_on_query: int = attrs.field()
    queries: int = 0

    @fires_on_query.validator
    def _check(self, _: object, value: object) -> None:
        check_int_at_least("fires_on_query", value, 1)

    def query(self) -> bool:
        """Count this query and return whether it is the ``fires_on_query``-th or a later one."""
        self.queries += 1
        return self.queries >= self.fires_on_query


def _check_step_time(value: object) -> float:
    return check_seconds("step_time", value, positive=False)


class FakeDevice(Device):
    """A GPU in virtual time, for tests: no model, no thread, no wall-clock wait.

    ``run`` calls the work inline, then replaces its event with a :class:`VirtualEvent` whose
    deadline is ``max(now, busy_until) + step_time`` (steps queue behind each other like
    kernels on a GPU stream) and resolves the completion at once: the caller is never blocked.
    The completion fires when the loop's clock passes the deadline, through the same polling
    path as a CUDA event. :meth:`lose_context` makes it fail from then on like a GPU whose
    CUDA context died.

    Args:
        step_time: Seconds of loop time each step takes, or a callable called once per step
            that returns them (for steps of varying length).

    Raises:
        TypeError: ``step_time`` is neither a number nor callable.
        ValueError: ``step_time`` is negative or not finite.
    """

    kind: ClassVar[str] = "fake"

    def __init__(self, step_time: float | Callable[[], float] = 0.0) -> None:
        self._step_time: Callable[[], float]
        if callable(step_time):
            self._step_time = step_time
        else:
            fixed = _check_step_time(step_time)
            self._step_time = lambda: fixed
        self.torch_device = torch.device("cpu")
        self.launches = 0
        self._lost: str | None = None
        # Per event loop: loop clocks are not comparable across loops.
        self._busy_until: anyio.lowlevel.RunVar[float] = anyio.lowlevel.RunVar(
            f"twostroke FakeDevice {id(self):#x} busy_until"
        )

    def __repr__(self) -> str:
        lost = ", context lost" if self._lost is not None else ""
        return f"<FakeDevice {self.launches} launches{lost}>"

    def lose_context(self, message: str = LOST_CONTEXT) -> None:
        """Fail from now on like a GPU whose CUDA context died: every call raises.

        Each later :meth:`run` fails its completion and each :meth:`probe` raises, with a
        fresh ``RuntimeError(message)``; steps launched before keep their events.

        Args:
            message: The error's message (by default, CUDA's for an illegal address).
        """
        self._lost = message

    async def probe(self) -> None:
        """Raise the lost context's error after :meth:`lose_context`; else return."""
        await anyio.lowlevel.checkpoint()
        if self._lost is not None:
            raise RuntimeError(self._lost)

    async def run(self, work: Callable[[], Launched[T]], completion: Completion[T]) -> None:
        if self._lost is not None:
            completion.set_exception(RuntimeError(self._lost))
            await anyio.lowlevel.checkpoint()
            return
        try:
            launched: Any = work()
            step_time = _check_step_time(self._step_time())
        except Exception as exc:
            completion.set_exception(exc)
        else:
            if isinstance(launched, Launched):
                start = max(anyio.current_time(), self._busy_until.get(-math.inf))
                deadline = start + step_time
                self._busy_until.set(deadline)
                self.launches += 1
                launched = attrs.evolve(launched, event=VirtualEvent(deadline))
            _resolve(completion, launched)
        await anyio.lowlevel.checkpoint()
