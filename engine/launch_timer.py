"""What the device's time went to: launching steps, or waiting between them for Python."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["LaunchTimer"]


class LaunchTimer:
    """Times each launch of a step where it runs, and the device's wait before it.

    ``forward_seconds`` adds up the launches; ``forward_idle_seconds`` the gaps between the
    end of one launch and the start of the next that *continues* a busy run (its plan was
    made while a step was in flight, or right after one was applied): time the device
    waited on Python. A gap before a launch that does not continue one (the engine was idle,
    with nothing to run) is not counted.

    Launches run one at a time, on the device's thread; the engine's statistics read the two
    sums from the event loop's thread (a float read is atomic under the GIL).

    Args:
        clock: Seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.forward_seconds = 0.0
        self.forward_idle_seconds = 0.0
        self._last_end: float | None = None

    @contextmanager
    def launch(self, *, continues: bool) -> Iterator[None]:
        """Time the launch in the body; count the wait before it if it ``continues``."""
        began = self._clock()
        if continues and self._last_end is not None:
            self.forward_idle_seconds += began - self._last_end
        try:
            yield
        finally:
            self._last_end = self._clock()
            self.forward_seconds += self._last_end - began
