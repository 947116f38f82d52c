"""Devices: where work runs, in what order, and that the completion is always resolved."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch
import trio.testing

from twostroke.gpu.completion import Completion, CompletionAlreadySet, Launched, ReadyEvent
from twostroke.gpu.device import CpuDevice, CudaDevice, DeviceUnavailable
from twostroke.gpu.fake import CountdownEvent, FakeDevice, VirtualEvent
from twostroke.gpu.selection import select_device

# A bound for the thread handshakes below, only reached if the code under test is broken.
DEADLOCK = 10.0


def ready(value: Any) -> Callable[[], Launched[Any]]:
    return lambda: Launched(event=ReadyEvent(), readback=lambda: value)


# --- CpuDevice -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_cpu_runs_work_in_a_worker_thread() -> None:
    device = CpuDevice()
    threads: list[int] = []

    def work() -> Launched[int]:
        threads.append(threading.get_ident())
        return Launched(event=ReadyEvent(), readback=lambda: 4)

    completion: Completion[int] = Completion()
    await device.run(work, completion)
    assert completion.done()
    assert await completion == 4
    assert threads
    assert threads[0] != threading.get_ident()
    assert device.kind == "cpu"
    assert device.torch_device == torch.device("cpu")


@pytest.mark.anyio
async def test_cpu_runs_steps_one_at_a_time_in_call_order() -> None:
    device = CpuDevice()
    release = threading.Event()
    entered = anyio.Event()
    order: list[int] = []
    active = 0
    most_active = 0
    lock = threading.Lock()

    def work(i: int) -> Launched[int]:
        nonlocal active, most_active
        with lock:
            active += 1
            most_active = max(most_active, active)
        order.append(i)
        if i == 0:
            anyio.from_thread.run_sync(entered.set)
            assert release.wait(DEADLOCK)
        with lock:
            active -= 1
        return Launched(event=ReadyEvent(), readback=lambda: i)

    completions: list[Completion[int]] = [Completion() for _ in range(4)]

    async def launch(i: int, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        await device.run(lambda: work(i), completions[i])

    async with anyio.create_task_group() as tg:
        await tg.start(launch, 0)
        await entered.wait()  # step 0 holds the worker thread
        for i in range(1, 4):
            await tg.start(launch, i)
        await anyio.wait_all_tasks_blocked()
        assert order == [0]  # the others wait their turn
        assert [c.done() for c in completions] == [False] * 4
        release.set()
    assert order == [0, 1, 2, 3]
    assert most_active == 1
    assert [await c for c in completions] == [0, 1, 2, 3]


@pytest.mark.anyio
async def test_cpu_cancelled_caller_still_resolves_the_completion() -> None:
    device = CpuDevice()
    release = threading.Event()
    entered = anyio.Event()
    finished = []

    def work() -> Launched[str]:
        anyio.from_thread.run_sync(entered.set)
        assert release.wait(DEADLOCK)
        finished.append(True)
        return Launched(event=ReadyEvent(), readback=lambda: "late")

    completion: Completion[str] = Completion()
    scope = anyio.CancelScope()

    async def caller() -> None:
        with scope:
            await device.run(work, completion)
            pytest.fail("run() must raise the cancellation after resolving")

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await entered.wait()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert not completion.done()  # the launch is not abandoned...
        release.set()
    assert scope.cancelled_caught
    assert finished == [True]
    assert await completion == "late"  # ...and its completion is resolved


@pytest.mark.anyio
async def test_cpu_caller_cancelled_before_run_still_launches() -> None:
    device = CpuDevice()
    completion: Completion[int] = Completion()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await device.run(ready(1), completion)
    assert scope.cancelled_caught
    assert await completion == 1


@pytest.mark.anyio
@pytest.mark.parametrize("make_device", [CpuDevice, FakeDevice])
async def test_work_exception_goes_into_the_completion(make_device: Callable[[], Any]) -> None:
    device = make_device()
    error = ValueError("bad plan")

    def work() -> Launched[int]:
        raise error

    completion: Completion[int] = Completion()
    await device.run(work, completion)  # does not raise
    with pytest.raises(ValueError, match=r"^bad plan$") as info:
        await completion
    assert info.value is error
    # The device is still usable.
    completion = Completion()
    await device.run(ready(2), completion)
    assert await completion == 2


@pytest.mark.anyio
@pytest.mark.parametrize("make_device", [CpuDevice, FakeDevice])
async def test_work_returning_a_non_launched_fails_the_completion(
    make_device: Callable[[], Any],
) -> None:
    completion: Completion[int] = Completion()
    await make_device().run(lambda: 42, completion)
    with pytest.raises(TypeError, match=r"^device work must return a Launched, got int 42$"):
        await completion


@pytest.mark.anyio
@pytest.mark.parametrize("make_device", [CpuDevice, FakeDevice])
async def test_run_on_a_set_completion_raises(make_device: Callable[[], Any]) -> None:
    completion: Completion[int] = Completion()
    completion.set_exception(ValueError())
    with pytest.raises(CompletionAlreadySet):
        await make_device().run(ready(1), completion)


@pytest.mark.anyio
async def test_inside_the_block_a_set_completion_is_refused_before_anything_is_queued() -> None:
    ran: list[int] = []

    def work() -> Launched[int]:
        ran.append(1)
        return Launched(event=ReadyEvent(), readback=lambda: 1)

    completion: Completion[int] = Completion()
    completion.set_exception(ValueError())
    async with CpuDevice() as device:
        with pytest.raises(CompletionAlreadySet, match=r"already failed$"):
            await device.run(work, completion)
        after: Completion[int] = Completion()
        await device.run(ready(2), after)
        assert await after == 2
    assert ran == []


def test_cpu_device_serves_successive_event_loops() -> None:
    device = CpuDevice()

    async def once() -> int:
        completion: Completion[int] = Completion()
        await device.run(ready(3), completion)
        return await completion

    assert anyio.run(once) == 3
    assert anyio.run(once, backend="trio") == 3
    assert anyio.run(once) == 3


# --- CpuDevice inside async with: its own forward thread -------------------------------------


def forward_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "twostroke cpu forward"]


@pytest.mark.anyio
async def test_cpu_inside_the_block_runs_every_step_on_one_thread_joined_at_exit() -> None:
    device = CpuDevice()
    assert device.forward_thread is None
    threads: list[int] = []

    def work() -> Launched[int]:
        threads.append(threading.get_ident())
        return Launched(event=ReadyEvent(), readback=lambda: len(threads))

    async with device as entered:
        assert entered is device
        forward = device.forward_thread
        assert forward is not None
        (thread,) = forward_threads()
        for step in range(1, 4):
            completion: Completion[int] = Completion()
            await device.run(work, completion)
            assert await completion == step
    assert threads == [thread.ident] * 3
    assert thread.ident != threading.get_ident()
    assert not thread.is_alive()
    assert device.forward_thread is None
    assert forward_threads() == []


@pytest.mark.anyio
async def test_cpu_blocks_nest_and_the_last_exit_joins() -> None:
    device = CpuDevice()
    async with device:
        forward = device.forward_thread
        async with device:
            assert device.forward_thread is forward
        assert device.forward_thread is forward
        assert len(forward_threads()) == 1
        completion: Completion[int] = Completion()
        await device.run(ready(5), completion)
        assert await completion == 5
    assert device.forward_thread is None
    assert forward_threads() == []
    async with device:  # and it can be held again
        assert len(forward_threads()) == 1
    assert forward_threads() == []


@pytest.mark.anyio
async def test_cpu_inside_the_block_queues_steps_in_order_and_resolves_for_cancelled_callers() -> (
    None
):
    device = CpuDevice()
    release = threading.Event()
    order: list[int] = []

    def work(i: int) -> Launched[int]:
        order.append(i)
        if i == 0:
            assert release.wait(DEADLOCK)
        return Launched(event=ReadyEvent(), readback=lambda: i)

    completions: list[Completion[int]] = [Completion() for _ in range(3)]
    async with device:
        with anyio.CancelScope() as scope:
            scope.cancel()  # a cancelled caller still queues its step
            await device.run(lambda: work(0), completions[0])
        assert scope.cancelled_caught
        for i in range(1, 3):
            await device.run(functools.partial(work, i), completions[i])
        # run() returned for all three while step 0 still runs: they are queued, not run.
        assert [c.done() for c in completions] == [False] * 3
        assert order in ([], [0])
        release.set()
        assert [await c for c in completions] == [0, 1, 2]
    assert order == [0, 1, 2]


@pytest.mark.anyio
async def test_cpu_inside_the_block_starts_the_next_step_without_the_event_loop() -> None:
    # The loop thread blocks (synchronously) from the end of step 0 until step 1 has run: if
    # the thread needed the loop to hand step 1 over, this would deadlock.
    device = CpuDevice()
    release = threading.Event()
    step1_ran = threading.Event()

    def first() -> Launched[str]:
        assert release.wait(DEADLOCK)
        return Launched(event=ReadyEvent(), readback=lambda: "first")

    def second() -> Launched[str]:
        step1_ran.set()
        return Launched(event=ReadyEvent(), readback=lambda: "second")

    async with device:
        completions: list[Completion[str]] = [Completion(), Completion()]
        await device.run(first, completions[0])
        await device.run(second, completions[1])
        release.set()
        assert step1_ran.wait(DEADLOCK)  # the loop is held here: no task runs meanwhile
        assert [await c for c in completions] == ["first", "second"]


@pytest.mark.anyio
async def test_cpu_inside_the_block_a_failed_step_fails_its_completion_only() -> None:
    device = CpuDevice()

    def boom() -> Launched[int]:
        raise ValueError("step 0 broke")

    def not_launched() -> Launched[int]:
        return 5  # type: ignore[return-value]

    async with device:
        completions: list[Completion[int]] = [Completion() for _ in range(3)]
        await device.run(boom, completions[0])
        await device.run(not_launched, completions[1])
        await device.run(ready(7), completions[2])
        with pytest.raises(ValueError, match="step 0 broke"):
            await completions[0]
        with pytest.raises(TypeError, match="device work must return a Launched, got int 5"):
            await completions[1]
        assert await completions[2] == 7


@pytest.mark.anyio
async def test_fake_device_blocks_hold_nothing() -> None:
    device = FakeDevice()
    async with device as entered:
        assert entered is device
    assert forward_threads() == []


# --- CudaDevice without CUDA -----------------------------------------------------------------


@pytest.fixture
def cuda_guard(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, torch.device, str]]:
    """Replace ``torch.cuda.device`` (which needs CUDA) by a recorder of where it is entered."""
    calls: list[tuple[int, torch.device, str]] = []

    @contextlib.contextmanager
    def fake_guard(device: torch.device) -> Iterator[None]:
        calls.append((threading.get_ident(), device, "enter"))
        try:
            yield
        finally:
            calls.append((threading.get_ident(), device, "exit"))

    monkeypatch.setattr(torch.cuda, "device", fake_guard)
    return calls


def test_cuda_device_construction_never_touches_cuda() -> None:
    device = CudaDevice(1)
    assert device.kind == "cuda"
    assert device.index == 1
    assert device.torch_device == torch.device("cuda", 1)
    assert repr(device) == "<CudaDevice cuda:1>"
    with pytest.raises(ValueError, match=r"^index must be >= 0, got -1$"):
        CudaDevice(-1)
    with pytest.raises(TypeError, match=r"^index must be an int, got str '0'$"):
        CudaDevice("0")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_cuda_run_returns_at_launch_and_the_completion_polls(
    cuda_guard: list[tuple[int, torch.device, str]],
) -> None:
    device = CudaDevice(1)
    events = [CountdownEvent(3), CountdownEvent(2)]
    launch_threads: list[int] = []

    def work(i: int) -> Launched[int]:
        launch_threads.append(threading.get_ident())
        return Launched(event=events[i], readback=lambda: 10 + i)

    first: Completion[int] = Completion()
    second: Completion[int] = Completion()
    await device.run(lambda: work(0), first)
    await device.run(lambda: work(1), second)
    # Both launched, neither finished: run() did not wait for the events.
    assert events[0].queries == events[1].queries == 0
    assert not first.done()
    assert not second.done()
    assert await first == 10
    assert await second == 11
    assert events[0].queries == 3
    assert events[1].queries == 2
    loop_thread = threading.get_ident()
    assert all(t != loop_thread for t in launch_threads)
    cuda1 = torch.device("cuda", 1)
    launches = [(t, d, what) for t, d, what in cuda_guard if t != loop_thread]
    assert launches == [
        (launch_threads[0], cuda1, "enter"),
        (launch_threads[0], cuda1, "exit"),
        (launch_threads[1], cuda1, "enter"),
        (launch_threads[1], cuda1, "exit"),
    ]
    # The loop thread queries each event with its GPU current (see the test below).
    queries = [(d, what) for t, d, what in cuda_guard if t == loop_thread]
    assert queries == [(cuda1, "enter"), (cuda1, "exit")] * (3 + 2)


class _GuardCheckingEvent:
    """Fires on its second query; records whether each query ran inside a CUDA guard."""

    def __init__(self, guard: list[tuple[int, torch.device, str]]) -> None:
        self.guard = guard
        self.current: list[torch.device | None] = []

    def query(self) -> bool:
        me = threading.get_ident()
        depth: dict[torch.device, int] = {}
        for thread, device, what in self.guard:
            if thread == me:
                depth[device] = depth.get(device, 0) + (1 if what == "enter" else -1)
        inside = [device for device, count in depth.items() if count > 0]
        self.current.append(inside[0] if inside else None)
        return len(self.current) >= 2


@pytest.mark.anyio
@pytest.mark.parametrize("in_block", [True, False], ids=["forward-thread", "worker-threads"])
async def test_cuda_events_are_queried_with_their_gpu_current(
    cuda_guard: list[tuple[int, torch.device, str]], in_block: bool
) -> None:
    """The loop thread polls a GPU 1 event with GPU 1 current (else the runtime may make a
    context on GPU 0, the loop thread's current device)."""
    device = CudaDevice(1)
    event = _GuardCheckingEvent(cuda_guard)
    completion: Completion[int] = Completion()
    async with contextlib.AsyncExitStack() as stack:
        if in_block:
            await stack.enter_async_context(device)
        await device.run(lambda: Launched(event=event, readback=lambda: 7), completion)
        assert await completion == 7
    assert event.current == [torch.device("cuda", 1)] * 2


@pytest.mark.anyio
async def test_cuda_work_exception_goes_into_the_completion(
    cuda_guard: list[tuple[int, torch.device, str]],
) -> None:
    error = RuntimeError("CUDA error: out of memory")

    def work() -> Launched[int]:
        raise error

    completion: Completion[int] = Completion()
    await CudaDevice(0).run(work, completion)
    with pytest.raises(RuntimeError) as info:
        await completion
    assert info.value is error
    assert [what for _, _, what in cuda_guard] == ["enter", "exit"]


# --- FakeDevice ------------------------------------------------------------------------------


class TestFakeDevice:
    """Virtual time: trio's MockClock jumps to the next deadline as soon as all tasks wait."""

    @pytest.fixture
    def anyio_backend(self) -> Any:
        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})

    @pytest.mark.anyio
    async def test_steps_queue_behind_each_other(self) -> None:
        device = FakeDevice(step_time=1.0)
        completions: list[Completion[int]] = [Completion(), Completion()]
        await device.run(ready(1), completions[0])
        await device.run(ready(2), completions[1])
        assert anyio.current_time() == 0.0  # run() returned at once, like a GPU queue
        assert device.launches == 2
        max_latency = 500e-6  # the PollSchedule cap
        assert await completions[0] == 1
        assert 1.0 <= anyio.current_time() <= 1.0 + max_latency
        assert await completions[1] == 2
        assert 2.0 <= anyio.current_time() <= 2.0 + max_latency
        # An idle device starts the next step now, not at its old busy_until.
        await anyio.sleep(10 - anyio.current_time())
        third: Completion[int] = Completion()
        await device.run(ready(3), third)
        await third
        assert 11.0 <= anyio.current_time() <= 11.0 + max_latency

    @pytest.mark.anyio
    async def test_event_is_virtual_and_polled(self) -> None:
        device = FakeDevice(step_time=0.25)
        completion: Completion[int] = Completion()
        original = CountdownEvent(1_000_000)  # would never fire: it is replaced
        await device.run(lambda: Launched(event=original, readback=lambda: 8), completion)
        assert await completion == 8
        assert original.queries == 0
        stats = completion.statistics()
        assert stats.polls > 3  # the real polling path: spin, then backoff
        assert stats.done_at is not None
        assert stats.done_at >= 0.25

    @pytest.mark.anyio
    async def test_callable_step_time(self) -> None:
        times = iter([0.5, 2.0])
        device = FakeDevice(step_time=lambda: next(times))
        first: Completion[int] = Completion()
        second: Completion[int] = Completion()
        await device.run(ready(1), first)
        await device.run(ready(2), second)
        await second
        assert 2.5 <= anyio.current_time() <= 2.5 + 500e-6
        assert first.done()

    @pytest.mark.anyio
    async def test_bad_callable_step_time_fails_the_completion(self) -> None:
        device = FakeDevice(step_time=lambda: -1.0)
        completion: Completion[int] = Completion()
        await device.run(ready(1), completion)
        with pytest.raises(ValueError, match=r"^step_time must be finite and >= 0, got -1.0$"):
            await completion
        assert device.launches == 0

    @pytest.mark.anyio
    async def test_run_is_a_checkpoint(self) -> None:
        with trio.testing.assert_checkpoints():
            await FakeDevice().run(ready(1), Completion())

    @pytest.mark.anyio
    async def test_virtual_event(self) -> None:
        event = VirtualEvent(deadline=2.0)
        assert not event.query()
        await anyio.sleep(2.0)
        assert event.query()
        assert event.queries == 2


def test_fake_device_validates_step_time() -> None:
    with pytest.raises(ValueError, match=r"^step_time must be finite and >= 0, got -0.5$"):
        FakeDevice(step_time=-0.5)
    with pytest.raises(ValueError, match=r"^step_time must be finite and >= 0, got nan$"):
        FakeDevice(step_time=float("nan"))
    with pytest.raises(TypeError, match=r"^step_time must be a number, got str '1'$"):
        FakeDevice(step_time="1")  # type: ignore[arg-type]


def test_countdown_event() -> None:
    event = CountdownEvent(3)
    assert [event.query() for _ in range(5)] == [False, False, True, True, True]
    assert event.queries == 5
    with pytest.raises(ValueError, match=r"^fires_on_query must be >= 1, got 0$"):
        CountdownEvent(0)


# --- select_device ---------------------------------------------------------------------


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_select_device_without_cuda(no_cuda: None) -> None:
    assert isinstance(select_device(), CpuDevice)
    assert isinstance(select_device("auto", index=3), CpuDevice)
    assert isinstance(select_device("cpu"), CpuDevice)
    fake = select_device("fake")
    assert isinstance(fake, FakeDevice)
    with pytest.raises(
        DeviceUnavailable,
        match=r"^device kind 'cuda' needs a CUDA GPU, but torch.cuda.is_available\(\) is False "
        r"\(torch .+, built for CUDA .+\)$",
    ):
        select_device("cuda")


def test_select_device_with_cuda(two_gpus: None) -> None:
    auto = select_device()
    assert isinstance(auto, CudaDevice)
    assert auto.index == 0
    cuda = select_device("cuda", index=1)
    assert isinstance(cuda, CudaDevice)
    assert cuda.torch_device == torch.device("cuda", 1)
    assert isinstance(select_device("cpu"), CpuDevice)
    with pytest.raises(
        DeviceUnavailable, match=r"^cuda index must be < 2 \(the visible GPUs\), got 2$"
    ):
        select_device("cuda", index=2)


def test_select_device_rejects_bad_arguments() -> None:
    with pytest.raises(
        ValueError,
        match=r"^device kind must be one of 'auto', 'cuda', 'cpu', 'fake', got 'tpu'$",
    ):
        select_device("tpu")
    with pytest.raises(TypeError, match=r"^device kind must be a string, got int 0$"):
        select_device(0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^index must be >= 0, got -1$"):
        select_device("cpu", index=-1)


def test_the_host_devices_report_the_memory_the_host_has_free() -> None:
    import os

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for device in (CpuDevice(), FakeDevice()):
        free = device.free_memory()
        assert 0 < free <= total


def test_resolve_device_passes_devices_through_and_selects_kinds() -> None:
    from twostroke.gpu.selection import resolve_device

    device = FakeDevice()
    assert resolve_device(device) is device
    assert isinstance(resolve_device("cpu"), CpuDevice)
    with pytest.raises(ValueError, match="device kind must be one of"):
        resolve_device("tpu")
    with pytest.raises(TypeError, match="device must be a Device or one of 'auto'"):
        resolve_device(3)


# --- probes: does the device still run work? ------------------------------------------------


class _ProbeRecorder(CpuDevice):
    def __init__(self) -> None:
        super().__init__()
        self.probe_threads: list[int] = []

    def _probe(self) -> None:
        self.probe_threads.append(threading.get_ident())


@pytest.mark.anyio
async def test_a_cpu_probe_runs_where_the_steps_run() -> None:
    device = _ProbeRecorder()
    await device.probe()  # outside a block: a worker thread
    assert device.probe_threads[0] != threading.get_ident()
    async with device:
        assert device.forward_thread is not None
        forward = device.forward_thread.ident
        completion: Completion[int] = Completion()
        await device.run(ready(1), completion)  # the probe queues behind it
        await device.probe()
        assert completion.statistics().state.value in ("launched", "fired", "done")
        assert await completion == 1
    assert device.probe_threads[1] == forward


@pytest.mark.anyio
async def test_a_cpu_probe_raises_when_its_thread_cannot_run_work() -> None:
    class Broken(CpuDevice):
        def _probe(self) -> None:
            raise RuntimeError("no")

    async with Broken() as device:
        with pytest.raises(RuntimeError, match=r"^no$"):
            await device.probe()


def test_a_cuda_probe_runs_a_kernel_and_waits_for_it(
    cuda_guard: list[tuple[int, torch.device, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []
    monkeypatch.setattr(torch, "ones", lambda *a, **k: calls.append(("ones", k)) or torch.zeros(1))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append(("sync", device)))
    CudaDevice(1)._probe()
    cuda1 = torch.device("cuda", 1)
    assert calls == [("ones", {"device": cuda1}), ("sync", cuda1)]
    assert [(d, what) for _, d, what in cuda_guard] == [(cuda1, "enter"), (cuda1, "exit")]


@pytest.mark.anyio
async def test_a_fake_device_that_lost_its_context_fails_every_call() -> None:
    device = FakeDevice()
    await device.probe()
    before: Completion[int] = Completion()
    await device.run(ready(1), before)
    device.lose_context()
    assert repr(device) == "<FakeDevice 1 launches, context lost>"
    with pytest.raises(RuntimeError, match=r"^CUDA error: an illegal memory access"):
        await device.probe()
    calls: list[int] = []
    after: Completion[int] = Completion()
    await device.run(lambda: calls.append(1) or ready(2)(), after)
    with pytest.raises(RuntimeError, match=r"^CUDA error: an illegal memory access"):
        await after
    assert calls == []  # a dead context runs nothing
    assert await before == 1  # launched before the loss


# --- Device.call: set-up work where the steps run -------------------------------------------


@pytest.mark.anyio
async def test_a_cpu_call_runs_behind_the_queued_steps_on_the_forward_thread() -> None:
    device = CpuDevice()
    outside = await device.call(threading.get_ident)  # outside a block: a worker thread
    assert outside != threading.get_ident()
    order: list[str] = []

    def step() -> Launched[int]:
        order.append("step")
        return Launched(event=ReadyEvent(), readback=lambda: 1)

    def set_up() -> int:
        order.append("call")
        return threading.get_ident()

    async with device:
        assert device.forward_thread is not None
        completion: Completion[int] = Completion()
        await device.run(step, completion)
        assert await device.call(set_up) == device.forward_thread.ident
        assert order == ["step", "call"]
        assert await completion == 1
        with pytest.raises(ValueError, match=r"^bad set-up$"):
            await device.call(functools.partial(_raise, ValueError("bad set-up")))
        assert await device.call(lambda: "still serving") == "still serving"


def _raise(error: BaseException) -> None:
    raise error


@pytest.mark.anyio
async def test_outside_a_block_a_cpu_call_waits_for_the_step_in_progress() -> None:
    device = CpuDevice()
    running = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def step() -> Launched[int]:
        running.set()
        assert release.wait(DEADLOCK), "the test never released the step"
        order.append("step")
        return Launched(event=ReadyEvent(), readback=lambda: 1)

    def set_up() -> None:
        order.append("call")

    completion: Completion[int] = Completion()
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(device.run, step, completion)
        await anyio.to_thread.run_sync(running.wait, DEADLOCK)
        task_group.start_soon(device.call, set_up)
        await anyio.lowlevel.checkpoint()
        release.set()
    assert order == ["step", "call"]
    assert await completion == 1


@pytest.mark.anyio
async def test_while_a_cpu_call_runs_the_event_loop_serves_its_other_tasks() -> None:
    """A model loads for seconds: the loop must not stop for it."""
    released = threading.Event()

    def set_up() -> str:
        assert released.wait(DEADLOCK), "the event loop waited for the call"
        return "loaded"

    async def release() -> None:
        released.set()

    async with CpuDevice() as device, anyio.create_task_group() as task_group:
        task_group.start_soon(release)
        assert await device.call(set_up) == "loaded"


@pytest.mark.anyio
async def test_a_cpu_call_cancelled_meanwhile_runs_to_its_end() -> None:
    finished = threading.Event()
    entered = threading.Event()

    def set_up() -> None:
        entered.set()
        finished.wait(DEADLOCK)

    async with CpuDevice() as device:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as task_group:

                async def cancel_once_running() -> None:
                    await anyio.to_thread.run_sync(entered.wait, DEADLOCK)
                    scope.cancel()
                    finished.set()

                task_group.start_soon(cancel_once_running)
                await device.call(set_up)
                pytest.fail("the cancellation was not delivered after the call")
        assert scope.cancelled_caught
        assert finished.is_set()  # the call was waited for, not abandoned


@pytest.mark.anyio
async def test_a_cuda_call_runs_with_its_gpu_current_on_the_forward_thread(
    cuda_guard: list[tuple[int, torch.device, str]],
) -> None:
    async with CudaDevice(1) as device:  # its thread starts without touching CUDA
        assert device.forward_thread is not None
        assert await device.call(lambda: "made") == "made"
        forward = device.forward_thread.ident
    cuda1 = torch.device("cuda", 1)
    assert cuda_guard == [(forward, cuda1, "enter"), (forward, cuda1, "exit")]


@pytest.mark.anyio
async def test_a_fake_device_calls_in_the_calling_thread() -> None:
    assert await FakeDevice().call(threading.get_ident) == threading.get_ident()
