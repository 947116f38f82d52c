"""The launch timer: launches add up, and only the waits of a busy run count as idle."""

from __future__ import annotations

import pytest

from twostroke.engine.strokes.launcher import LaunchTimer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_launches_add_up_and_only_gaps_that_continue_a_run_are_idle() -> None:
    clock = Clock()
    timer = LaunchTimer(clock)
    with timer.launch(continues=True):  # the first launch: no gap before it to count
        clock.now += 2.0
    clock.now += 1.0
    with timer.launch(continues=True):  # the device waited 1 s on Python
        clock.now += 3.0
    clock.now += 10.0
    with timer.launch(continues=False):  # after idling: nothing to run is not a wait
        clock.now += 0.5
    assert (timer.forward_seconds, timer.forward_idle_seconds) == (5.5, 1.0)


def test_a_launch_that_raises_is_timed_too() -> None:
    clock = Clock()
    timer = LaunchTimer(clock)
    with pytest.raises(RuntimeError), timer.launch(continues=False):
        clock.now += 2.0
        raise RuntimeError("launch failed")
    clock.now += 1.0
    with timer.launch(continues=True):
        pass
    assert (timer.forward_seconds, timer.forward_idle_seconds) == (2.0, 1.0)
