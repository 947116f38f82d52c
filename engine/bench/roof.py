"""The roof: how fast this machine could run the workload, and each system's fraction of it.

Three parts. :func:`measure_machine` measures the machine's two rates in a few seconds: the
memory bandwidth (bytes read per second from a buffer many times the last-level cache, the
way a decode step streams its weights) and the matmul throughput (FLOP/s of square products
in the bench's dtype on its threads). :mod:`~twostroke.engine.bench.cost` counts what each
step of the model must move and compute. :func:`workload_roof` adds up, over the steps of a
schedule, each step's floor, ``max(bytes / bandwidth, FLOPs / FLOPS)`` (the roofline): the
time no implementation of that schedule can beat on this machine. The schedule is the one the
depth-2 engine ran when the run recorded it (:func:`recorded_schedule`), else the one the
engine's own scheduler plans for the workload, run without a model (:func:`simulated_plans`).

The roof throughput is the workload's output tokens over that floor; a system's fraction of
the roof is its output throughput over the roof's. A system whose weights are smaller than
the roof assumes (quantized) can pass 100 %.

Both rates are the best of several repeats, as STREAM reports its best: on a shared machine
the best repeat is the one least disturbed by other processes, and the roof is an upper bound.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import attrs

from twostroke.engine.bench.cost import DTYPE_BYTES, ModelCost
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import Workload
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, StepPlan
from twostroke.states.request import Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig, SchedulingPolicy
from twostroke.states.validators import int_at_least, number_in

__all__ = [
    "MachineRoof",
    "WorkloadRoof",
    "last_level_cache_bytes",
    "machine_speed",
    "measure_machine",
    "prepare_roof",
    "recorded_schedule",
    "roof_of_run",
    "simulated_plans",
    "workload_roof",
]

_POSITIVE = number_in(0, low_open=True)

#: The smallest buffer the bandwidth is read from, and how many times the last-level cache
#: it must be at least: a buffer that fits in the cache measures the cache, not the DRAM.
MIN_BUFFER_BYTES = 256 * 2**20
CACHE_MULTIPLE = 8

#: Matmul sizes tried, smallest first, up to the largest that fits the budget (bfloat16 is
#: emulated on AVX2 CPUs, where a 1024-cube product takes seconds).
MATMUL_SIZES = (256, 512, 1024, 2048)


@attrs.frozen(kw_only=True)
class MachineRoof:
    """The machine's two rates, measured (or given, in tests).

    Attributes:
        bandwidth: Bytes per second read from memory.
        flops: Matmul floating-point operations per second, in ``dtype`` on ``threads``.
        dtype: The dtype the products ran in.
        threads: torch threads the measurement ran on.
        method: How the rates were measured, for the report.
        seconds: How long the measurement took.
        load_average: The one-minute load average when it ended (``None`` if unknown).
    """

    bandwidth: float = attrs.field(validator=_POSITIVE)
    flops: float = attrs.field(validator=_POSITIVE)
    dtype: str = attrs.field(validator=attrs.validators.in_(tuple(DTYPE_BYTES)))
    threads: int = attrs.field(validator=int_at_least(1))
    method: str = "given"
    seconds: float = 0.0
    load_average: float | None = None

    def step_seconds(self, bytes_: int, flops: int) -> float:
        """The floor of a step that moves ``bytes_`` and computes ``flops``: the slower side."""
        return max(bytes_ / self.bandwidth, flops / self.flops)

    def summary(self) -> str:
        """One line: the rates, the dtype and threads, and what the measurement cost."""
        line = (
            f"{self.bandwidth / 1e9:.1f} GB/s read, {self.flops / 1e9:.1f} GFLOPS "
            f"{self.dtype} on {self.threads} thread{'s' * (self.threads != 1)}"
        )
        if self.seconds:
            line += f", measured in {self.seconds:.1f} s"
        if self.load_average is not None:
            line += f" (load average {self.load_average:.2f})"
        return line

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (rates in bytes/s and FLOP/s)."""
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class WorkloadRoof:
    """The floor of a workload's schedule on a machine, and the throughput it allows.

    Attributes:
        machine: The rates.
        schedule: Which steps were costed (the recorded run's, or the simulated schedule).
        steps: How many.
        floor_seconds: The sum of the steps' floors.
        memory_bound_steps: Steps whose floor is their bytes (the rest: their FLOPs).
        bytes: Bytes over all steps.
        flops: FLOPs over all steps.
        output_tokens: The workload's output tokens.
    """

    machine: MachineRoof
    schedule: str
    steps: int = attrs.field(validator=int_at_least(1))
    floor_seconds: float = attrs.field(validator=_POSITIVE)
    memory_bound_steps: int = attrs.field(validator=int_at_least(0))
    bytes: int = attrs.field(validator=int_at_least(0))
    flops: int = attrs.field(validator=int_at_least(0))
    output_tokens: int = attrs.field(validator=int_at_least(1))

    @property
    def output_throughput(self) -> float:
        """Output tokens per second at the floor: the roof."""
        return self.output_tokens / self.floor_seconds

    def fraction(self, output_throughput: float) -> float:
        """A system's output throughput as a fraction of the roof's."""
        return output_throughput / self.output_throughput

    def summary(self) -> str:
        """One line for the report: rates, floor, roof throughput, and the schedule."""
        bound = round(100 * self.memory_bound_steps / self.steps)
        return (
            f"roof: {self.machine.summary()}; floor {self.floor_seconds:.2f} s over "
            f"{self.steps} steps ({bound} % memory-bound) of {self.schedule} → "
            f"{self.output_throughput:.1f} output tok/s"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, the roof throughput included."""
        return {
            **attrs.asdict(self, recurse=False),
            "machine": self.machine.to_json(),
            "output_throughput": self.output_throughput,
        }


def workload_roof(
    machine: MachineRoof,
    cost: ModelCost,
    plans: Iterable[StepPlan],
    *,
    schedule: str,
    output_tokens: int,
) -> WorkloadRoof:
    """Cost every step of ``plans`` and add up their floors on ``machine``.

    Args:
        machine: The rates.
        cost: The model's costs.
        plans: The schedule, one plan per step.
        schedule: What the schedule is, for the report.
        output_tokens: The workload's output tokens (the roof throughput's numerator).

    Raises:
        ValueError: ``plans`` is empty, or a plan has no rows.
    """
    floor, steps, memory_bound, total_bytes, total_flops = 0.0, 0, 0, 0, 0
    for plan in plans:
        step = cost.plan(plan)
        seconds = machine.step_seconds(step.bytes, step.flops)
        floor += seconds
        steps += 1
        memory_bound += step.bytes / machine.bandwidth >= step.flops / machine.flops
        total_bytes += step.bytes
        total_flops += step.flops
    if not steps:
        raise ValueError("a workload's roof needs at least one step, got none")
    return WorkloadRoof(
        machine=machine,
        schedule=schedule,
        steps=steps,
        floor_seconds=floor,
        memory_bound_steps=memory_bound,
        bytes=total_bytes,
        flops=total_flops,
        output_tokens=output_tokens,
    )


def simulated_plans(workload: Workload, policy: SchedulingPolicy | None = None) -> list[StepPlan]:
    """The steps twostroke's scheduler plans for ``workload``, run without a model.

    Every request arrives at once (a serving workload's arrival times are not simulated),
    the pipeline is serial (no lookahead token is wasted) and the KV pool holds every request
    at once (nothing is preempted): the schedule a floor should be taken over. Each sampled
    token is id 0 and EOS is ignored, as the bench's requests run to ``max_tokens``.

    Args:
        workload: The requests.
        policy: The batching limits (``max_num_seqs``, ``max_num_batched_tokens``, block size,
            prefix caching); the engine's defaults when ``None``.

    Returns:
        One plan per step, in order.
    """
    policy = policy or SchedulingPolicy()
    block = policy.block_size
    lengths = [len(r.prompt_token_ids) + r.max_tokens for r in workload.requests]
    config = SchedulerConfig.sized(
        attrs.evolve(policy, pipeline_depth=1),
        num_blocks=sum(-(-length // block) for length in lengths) + 1,
        max_model_len=max(2, *lengths),
    )
    scheduler = Scheduler(config, clock=lambda: 0.0)
    for index, request in enumerate(workload.requests):
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        scheduler.add_request(Request(index, request.prompt_token_ids, params, 0.0))
    plans: list[StepPlan] = []
    while not scheduler.is_idle():
        plan = scheduler.schedule()
        # A serial scheduler with every request fitting the pool always has work to plan.
        assert plan is not None, "the scheduler planned nothing with requests left"
        plans.append(plan)
        sampled = {entry.request_id: 0 for entry in plan.requests if entry.sample}
        scheduler.apply(RunnerOutput(step_id=plan.step_id, sampled=sampled))
    return plans


def recorded_schedule(drivers: Iterable[object], name: str) -> list[StepPlan] | None:
    """The step plans the system ``name`` ran, if it is among ``drivers`` and recorded them.

    twostroke's depth-2 driver keeps a ``recording`` with its ``plans`` after a run (the
    bare forward loop replays them); any other driver, or one that did not run, gives
    ``None``.
    """
    for driver in drivers:
        if getattr(driver, "name", None) != name:
            continue
        plans = getattr(getattr(driver, "recording", None), "plans", None)
        if plans:
            return list(plans)
    return None


# ---------------------------------------------------------------------------------------------
# Measuring the machine.


def last_level_cache_bytes() -> int | None:
    """The size of the CPU's largest cache (Linux sysfs), or ``None`` where it is not told."""
    largest = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        try:
            size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except (ValueError, IndexError):
            continue
        largest = size if largest is None else max(largest, size)
    return largest


def measure_machine(
    *,
    dtype: str = "float32",
    threads: int = 2,
    seconds: float = 2.5,
    buffer_bytes: int | None = None,
    matmul_sizes: Sequence[int] = MATMUL_SIZES,
    clock: Callable[[], float] = time.perf_counter,
) -> MachineRoof:
    """Measure the memory bandwidth and the matmul throughput, in about ``seconds``.

    Runs on a fresh thread with ``threads`` torch threads (a thread's OpenMP team size is
    fixed when it first computes, so the caller's thread might keep another count).

    Bandwidth: ``torch.sum`` over a float32 buffer of ``buffer_bytes`` (default: 256 MiB or
    8 times the last-level cache, whichever is larger), repeated for 40 % of ``seconds``
    after one untimed pass; the best repeat's bytes per second. Matmul: square products
    ``a @ b`` in ``dtype`` of each of ``matmul_sizes`` in turn, one untimed and two timed,
    growing while the next size's three products (predicted at this size's rate, as n³) fit
    in the time left; the largest size run takes the rest of the time. The best repeat's
    ``2 n³`` FLOPs per second, over all sizes.

    Args:
        dtype: The products' dtype (a key of :data:`~twostroke.engine.bench.cost.DTYPE_BYTES`).
        threads: torch threads (the bench's, as its systems use).
        seconds: The time to spend, roughly (each part runs at least twice).
        buffer_bytes: The buffer's size; ``None``: as above.
        matmul_sizes: The square sizes to try, smallest first.
        clock: The timer (monotonic seconds).

    Returns:
        The rates, with how they were measured.

    Raises:
        ValueError: an unknown dtype, ``threads`` < 1, ``seconds`` not > 0, a buffer under
            1 MiB, or no matmul sizes.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    _check_budget(threads, seconds)
    if buffer_bytes is not None and buffer_bytes < 2**20:
        raise ValueError(f"buffer_bytes must be >= 1 MiB ({2**20}), got {buffer_bytes}")
    if not matmul_sizes or any(size < 1 for size in matmul_sizes):
        raise ValueError(f"matmul_sizes must be sizes >= 1, got {tuple(matmul_sizes)}")
    cache = last_level_cache_bytes()
    if buffer_bytes is None:
        buffer_bytes = max(MIN_BUFFER_BYTES, CACHE_MULTIPLE * (cache or 0))
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="twostroke-roof") as pool:
        return pool.submit(
            _measure, dtype, threads, seconds, buffer_bytes, tuple(matmul_sizes), cache, clock
        ).result()


def _check_budget(threads: int, seconds: float) -> None:
    """A measurement's thread count (an int >= 1) and time (finite, > 0), or why not."""
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be a finite number > 0, got {seconds!r}")


#: The product :func:`machine_speed` times: float32, square, small enough to stay in the
#: cores' caches (its rate is the cores', not the memory's) and large enough that two
#: threads split it.
SPEED_PROBE_SIZE = 256


def machine_speed(
    *, threads: int = 2, seconds: float = 0.25, clock: Callable[[], float] = time.perf_counter
) -> float:
    """How fast the cores compute right now: the best rate (GFLOPS) of a float32 product of
    :data:`SPEED_PROBE_SIZE` squares on ``threads`` torch threads, over about ``seconds``.

    The bench takes it before and after each system, because a shared machine's speed moves
    while it runs: on a 2-core guest measured 2026-12-05 the same product ran at 110-120 or at
    170-180 µs for minutes at a time (its two cores, by the look of it, sometimes one
    physical core's two hyperthreads), and one system's throughput halved between two runs
    ten minutes apart. A ratio between two systems is only as good as their probes agree.

    It runs on a thread of its own that ends with it, so it leaves no OpenMP team behind
    (:mod:`twostroke.gpu.openmp`: a second team beside an engine's makes its barriers sleep).

    Raises:
        ValueError: ``threads`` < 1 or ``seconds`` not > 0.
    """
    _check_budget(threads, seconds)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="twostroke-probe") as pool:
        return pool.submit(_speed, threads, seconds, clock).result()


def _speed(threads: int, seconds: float, clock: Callable[[], float]) -> float:
    import torch

    from twostroke.gpu.threads import torch_threads

    size = SPEED_PROBE_SIZE
    with torch_threads(threads), torch.inference_mode():
        generator = torch.Generator().manual_seed(0)
        a = torch.rand(size, size, generator=generator)
        b = torch.rand(size, size, generator=generator)
        times = _repeat(functools.partial(torch.mm, a, b), clock, seconds)
    return 2 * size**3 / min(times) / 1e9


def _measure(
    dtype: str,
    threads: int,
    seconds: float,
    buffer_bytes: int,
    sizes: tuple[int, ...],
    cache: int | None,
    clock: Callable[[], float],
) -> MachineRoof:
    import torch

    from twostroke.gpu.threads import torch_threads

    began = clock()
    with torch_threads(threads), torch.inference_mode():
        buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)  # touches every page
        reads = _repeat(buffer.sum, clock, 0.4 * seconds)
        del buffer
        bandwidth = buffer_bytes // 4 * 4 / min(reads)
        generator = torch.Generator().manual_seed(0)
        kind = getattr(torch, dtype)
        best, products, ran = 0.0, 0, []
        for index, size in enumerate(sizes):
            a = torch.rand(size, size, generator=generator).to(kind)
            b = torch.rand(size, size, generator=generator).to(kind)
            product = functools.partial(torch.matmul, a, b)
            times = _repeat(product, clock, 0.0)
            left = seconds - (clock() - began)
            following = sizes[index + 1] if index + 1 < len(sizes) else None
            # The next size's untimed product and two timed ones, at this size's rate (n³).
            if following is None or 3 * min(times) * (following / size) ** 3 > left:
                # The largest size that fits: the rest of the budget goes to it.
                times += _repeat(product, clock, left, warm_up=False, at_least=0)
                following = None
            best = max(best, 2 * size**3 / min(times))
            products += len(times)
            ran.append(size)
            if following is None:
                break
    if cache is None:
        cached = ""
    elif buffer_bytes >= cache:
        cached = f" ({buffer_bytes / cache:.0f}x the {cache >> 20} MiB cache)"
    else:
        cached = f" (within the {cache >> 20} MiB cache: its bandwidth, not the memory's)"
    method = (
        f"read: best of {len(reads)} torch.sum passes over {buffer_bytes >> 20} MiB of float32"
        f"{cached}; matmul: best of {products} {dtype} square products of sizes "
        f"{', '.join(map(str, ran))}"
    )
    return MachineRoof(
        bandwidth=bandwidth,
        flops=best,
        dtype=dtype,
        threads=threads,
        method=method,
        seconds=clock() - began,
        load_average=_load_average(),
    )


def _repeat(
    work: Callable[[], object],
    clock: Callable[[], float],
    budget: float,
    *,
    warm_up: bool = True,
    at_least: int = 2,
) -> list[float]:
    """Times of ``work``, after one untimed run if ``warm_up``: ``at_least`` of them, then
    more until ``budget`` seconds are spent."""
    if warm_up:
        work()
    times: list[float] = []
    began = end = clock()
    while len(times) < at_least or end - began < budget:
        start = clock()
        work()
        end = clock()
        # A clock too coarse for the work would give 0; count it as one tick, not infinity.
        times.append(max(end - start, 1e-9))
    return times


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# The bench's use: measure before the systems run, cost the schedule after.


def prepare_roof(
    model: ModelSpec, *, measure: Callable[..., MachineRoof] = measure_machine
) -> tuple[MachineRoof, ModelCost]:
    """Read the model's shape and measure the machine, at the bench's dtype and threads.

    The weights cost what the engine's plan of the run reads
    (:func:`~twostroke.engine.models.plan.resolve_run`, the engine's defaults at the bench's
    dtype): a GGUF file whose blocks it computes as stored costs its stored bytes, another
    model its projections in the precision the plan holds them in and the rest in its dtype;
    the KV cache costs its positions in the plan's cache dtype.

    Args:
        model: The bench's model: its source gives the shape, its dtype and threads the
            measurement's.
        measure: Called with ``dtype`` and ``threads``; :func:`measure_machine` unless a
            test gives its own figures.

    Raises:
        ModelLoadError: the model's configuration cannot be read (before anything is
            measured).
    """
    import torch

    from twostroke.engine.config import DtypeOption, EngineConfig
    from twostroke.engine.models.loading import stored_bytes
    from twostroke.engine.models.plan import BLOCK_ACTIVATIONS, resolve_run
    from twostroke.engine.models.source import read_source
    from twostroke.engine.runners.loading import default_torch_threads

    # The engine's own plan for the run's options (weights, activations, KV cache): the
    # roof costs what the engine reads.
    config = EngineConfig(dtype=cast(DtypeOption, model.dtype) if model.exact else "auto")
    plan = resolve_run(config, read_source(model.source), torch.device("cpu"))
    stored = stored_bytes(model.source) if plan.weights in BLOCK_ACTIVATIONS else None
    dtype = str(plan.dtype).removeprefix("torch.")
    cost = ModelCost.of(
        plan.config,
        dtype=dtype,
        quantization=plan.kernels.projection.quantization,
        stored=stored,
        kv_cache_dtype=str(plan.cache_dtype).removeprefix("torch."),
    )
    # The torch threads twostroke's systems run on, given the bench's cores.
    return measure(dtype=dtype, threads=default_torch_threads(model.threads)), cost


def roof_of_run(
    machine: MachineRoof,
    cost: ModelCost,
    workload: Workload,
    *,
    drivers: Iterable[object] = (),
    recorded_by: str = "twostroke-depth2",
    policy: SchedulingPolicy | None = None,
) -> WorkloadRoof:
    """The workload's roof over the steps ``recorded_by`` ran, else its simulated schedule.

    Args:
        machine: The rates.
        cost: The model's costs.
        workload: What the systems ran.
        drivers: The run's systems; one named ``recorded_by`` may hold its step plans.
        recorded_by: The system whose schedule is preferred.
        policy: The batching limits of the simulated schedule.
    """
    output_tokens = sum(request.max_tokens for request in workload.requests)
    plans = recorded_schedule(drivers, recorded_by)
    if plans is not None:
        schedule = f"the schedule {recorded_by} ran"
    else:
        plans = simulated_plans(workload, policy)
        schedule = f"the scheduler's plan without a model (no {recorded_by} run to replay"
        schedule += ")" if workload.is_offline else "; every request at t = 0)"
    return workload_roof(machine, cost, plans, schedule=schedule, output_tokens=output_tokens)
