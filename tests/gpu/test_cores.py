"""ThreadGovernor: one thread fewer while the forward thread waits for a core, one more while
a core sits idle, never outside 1..most; and the Linux counters it reads."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import anyio.lowlevel
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from twostroke.gpu.cores import (
    CONTENDED,
    SPARE,
    WINDOW,
    CoreSample,
    ThreadGovernor,
    read_core_sample,
    usable_cores,
)
from twostroke.gpu.forward_thread import ForwardThread


class Machine:
    """Counters advanced by hand: each window's run-queue wait and idle cores are chosen."""

    def __init__(self) -> None:
        self.now = 100.0
        self.idle = 0.0
        self.waited = 0.0
        self.reads = 0
        self.applied: list[int] = []

    def sample(self) -> CoreSample:
        self.reads += 1
        return CoreSample(wall=self.now, idle=self.idle, waited=self.waited)

    def clock(self) -> float:
        return self.now

    def window(self, seconds: float, *, waited: float = 0.0, idle: float = 0.0) -> None:
        """``seconds`` pass, the thread waits for ``waited`` of them and ``idle`` cores idle."""
        self.now += seconds
        self.waited += waited * seconds
        self.idle += idle * seconds

    def governor(self, most: int, window: float = WINDOW) -> ThreadGovernor:
        return ThreadGovernor(
            most, window=window, sample=self.sample, apply=self.applied.append, clock=self.clock
        )


def test_it_starts_with_every_thread_and_sets_the_count_on_its_first_call() -> None:
    machine = Machine()
    governor = machine.governor(4)
    assert (governor.threads, machine.applied, machine.reads) == (4, [], 0)
    assert governor.adjust() == 4
    # The first call runs on the forward thread: the count is that thread's to set.
    assert machine.applied == [4]
    assert repr(governor) == "<ThreadGovernor 4 of 4 threads, 0 changes>"


def test_a_thread_kept_from_its_core_costs_the_team_one_thread_per_window() -> None:
    machine = Machine()
    governor = machine.governor(3)
    governor.adjust()
    machine.window(0.5, waited=CONTENDED)
    assert governor.adjust() == 2
    machine.window(0.5, waited=0.4)
    assert governor.adjust() == 1
    machine.window(0.5, waited=0.9)
    assert governor.adjust() == 1  # never below one
    assert machine.applied == [3, 2, 1]
    assert governor.changes == 2


def test_an_idle_core_gives_a_thread_back() -> None:
    machine = Machine()
    governor = machine.governor(2)
    governor.adjust()
    machine.window(0.3, waited=0.35)
    assert governor.adjust() == 1
    # A core busy with other work: nothing idle, so one thread stays, though it never waits.
    machine.window(0.3, idle=0.02)
    assert governor.adjust() == 1
    machine.window(0.3, idle=SPARE)
    assert governor.adjust() == 2
    machine.window(0.3, idle=1.5)
    assert governor.adjust() == 2  # never above most
    assert machine.applied == [2, 1, 2]
    assert repr(governor) == "<ThreadGovernor 2 of 2 threads, 2 changes>"


def test_a_little_waiting_and_a_little_idling_change_nothing() -> None:
    machine = Machine()
    governor = machine.governor(2)
    governor.adjust()
    for _ in range(5):
        machine.window(0.4, waited=CONTENDED / 2, idle=SPARE / 2)
        assert governor.adjust() == 2
    assert governor.changes == 0


def test_the_counters_are_read_only_once_a_window_has_passed() -> None:
    machine = Machine()
    governor = machine.governor(2, window=1.0)
    governor.adjust()
    assert machine.reads == 1
    for _ in range(3):
        machine.window(0.25, waited=1.0)
        assert governor.adjust() == 2  # 0.75 s is not a window yet
    assert machine.reads == 1
    machine.window(0.25, waited=1.0)
    assert governor.adjust() == 1  # the whole second, judged at once
    assert machine.reads == 2


def test_one_thread_is_never_governed() -> None:
    machine = Machine()
    governor = machine.governor(1)
    for _ in range(3):
        machine.window(1.0, idle=2.0)
        assert governor.adjust() == 1
    assert (machine.reads, machine.applied) == (0, [])


def test_without_the_counters_it_keeps_every_thread_and_stops_asking() -> None:
    asked = []

    def unreadable() -> CoreSample | None:
        asked.append(1)
        return None

    applied: list[int] = []
    governor = ThreadGovernor(2, sample=unreadable, apply=applied.append)
    assert [governor.adjust() for _ in range(3)] == [2, 2, 2]
    assert (len(asked), applied) == (1, [])


@given(
    most=st.integers(1, 8),
    windows=st.lists(
        st.tuples(
            st.floats(0.0, 2.0),  # seconds
            st.floats(0.0, 1.0),  # fraction of them waited
            st.floats(0.0, 8.0),  # idle cores
        ),
        max_size=30,
    ),
)
def test_the_count_stays_in_range_and_moves_by_one_for_what_the_window_showed(
    most: int, windows: list[tuple[float, float, float]]
) -> None:
    machine = Machine()
    governor = machine.governor(most)
    previous = governor.adjust()
    judged = machine.sample()  # the counters at the governor's last read
    machine.reads = 1 if most > 1 else 0
    for seconds, waited, idle in windows:
        machine.window(seconds, waited=waited, idle=idle)
        reads = machine.reads
        threads = governor.adjust()
        assert 1 <= threads <= most
        assert abs(threads - previous) <= 1
        if machine.reads > reads:  # a window ended here: what did it show?
            span = machine.now - judged.wall
            assert span >= WINDOW
            shown_wait = (machine.waited - judged.waited) / span
            shown_idle = (machine.idle - judged.idle) / span
            judged = CoreSample(wall=machine.now, idle=machine.idle, waited=machine.waited)
            if threads < previous:
                assert shown_wait >= CONTENDED
            if threads > previous:
                assert shown_wait < CONTENDED
                assert shown_idle >= SPARE
            if threads == previous:
                assert threads == 1 or shown_wait < CONTENDED
                assert threads == most or shown_wait >= CONTENDED or shown_idle < SPARE
        else:
            assert threads == previous
        previous = threads
    assert governor.changes == len(machine.applied) - (1 if most > 1 else 0)


@pytest.mark.parametrize(
    ("most", "window", "error", "message"),
    [
        (0, 0.25, ValueError, "most must be >= 1, got 0"),
        (2.0, 0.25, TypeError, "most must be an int, got float 2.0"),
        (2, 0, ValueError, "window must be finite and > 0, got 0"),
        (2, "1", TypeError, "window must be a number, got str '1'"),
    ],
)
def test_bad_arguments_are_refused(
    most: object, window: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        ThreadGovernor(most, window=window)  # type: ignore[arg-type]


def write_counters(tmp_path: Path, idle_ticks: dict[int, tuple[int, int]], waited_ns: int) -> None:
    lines = ["cpu  900 0 100 5000 40 0 0 0 0 0"]
    lines += [
        f"cpu{cpu} 450 0 50 {idle} {iowait} 0 0 0 0 0" for cpu, (idle, iowait) in idle_ticks.items()
    ]
    lines += ["intr 12 0 0", "ctxt 345", "procs_running 3"]
    (tmp_path / "stat").write_text("\n".join(lines) + "\n")
    (tmp_path / "schedstat").write_text(f"600837 {waited_ns} 2\n")


def read(tmp_path: Path) -> CoreSample | None:
    return read_core_sample(str(tmp_path / "stat"), str(tmp_path / "schedstat"))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux's CPU affinity")
def test_the_counters_are_the_idle_ticks_of_this_process_cpus_and_the_threads_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})
    write_counters(tmp_path, {0: (300, 20), 1: (7000, 0), 2: (100, 5)}, waited_ns=1_500_000_000)
    sample = read(tmp_path)
    assert sample is not None
    # idle and iowait of cpu0 and cpu2 only (cpu1 is not this process's), in seconds.
    assert sample.idle == pytest.approx(425 / os.sysconf("SC_CLK_TCK"))
    assert sample.waited == pytest.approx(1.5)


def test_unreadable_counters_are_none(tmp_path: Path) -> None:
    assert read(tmp_path) is None  # no files
    write_counters(tmp_path, {0: (1, 1)}, waited_ns=5)
    (tmp_path / "schedstat").write_text("garbage\n")
    assert read(tmp_path) is None
    write_counters(tmp_path, {0: (1, 1)}, waited_ns=5)
    (tmp_path / "stat").write_text("cpu0 1 2\n")
    assert read(tmp_path) is None


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's /proc")
def test_this_machine_has_the_counters() -> None:
    first = read_core_sample()
    assert first is not None
    sum(range(100_000))
    second = read_core_sample()
    assert second is not None
    assert second.wall >= first.wall
    assert second.idle >= first.idle >= 0
    assert second.waited >= first.waited >= 0


@pytest.mark.anyio
async def test_on_the_forward_thread_the_count_is_that_threads() -> None:
    """The governor runs where the steps run: the count it sets is the forward thread's own
    team size, and the thread that entered the block keeps its count."""
    machine = Machine()
    governor = ThreadGovernor(2, sample=machine.sample, clock=machine.clock)
    before = torch.get_num_threads()
    async with ForwardThread("test governed") as forward:
        assert await forward.run(lambda: (governor.adjust(), torch.get_num_threads())) == (2, 2)
        machine.window(1.0, waited=0.5)
        assert await forward.run(lambda: (governor.adjust(), torch.get_num_threads())) == (1, 1)
        await anyio.lowlevel.checkpoint()
        assert torch.get_num_threads() == before


def test_the_usable_cores_are_the_affinity_or_else_every_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if hasattr(os, "sched_getaffinity"):
        assert usable_cores() == len(os.sched_getaffinity(0))
        monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert usable_cores() == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # undeterminable
    assert usable_cores() == 1
