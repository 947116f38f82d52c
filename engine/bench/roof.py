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
the roof is its output throughput over the roof's. Each system's roof costs the weights that
system reads (:func:`system_weights`: twostroke's plan, a GGUF peer's file as stored, vLLM's
and transformers' dense weights in the bench's dtype); a system whose weights are not known
gets the roof of the smallest weights in the run, a lower floor and still a bound.

Both rates are the best of several repeats, as STREAM reports its best: on a shared machine
the best repeat is the one least disturbed by other processes, and the roof is an upper bound.
A rate is measured in rounds until it settles (:func:`settle`: the best two of the last
:data:`SETTLE_ROUNDS` rounds within :data:`SETTLE_TOLERANCE`), within a time limit; the
summary gives its rounds' spread, and says so when it did not settle: a probe that read low
makes a roof that a run can pass (the report marks such a fraction, never prints it as one).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs

from twostroke.engine.bench.cost import DTYPE_BYTES, ModelCost
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import Workload
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, StepPlan
from twostroke.states.request import Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig, SchedulingPolicy
from twostroke.states.validators import int_at_least, number_in

if TYPE_CHECKING:
    from twostroke.engine.models.plan import RunPlan

__all__ = [
    "MachineRoof",
    "Probe",
    "SystemWeights",
    "WorkloadRoof",
    "last_level_cache_bytes",
    "machine_speed",
    "measure_machine",
    "prepare_roof",
    "recorded_schedule",
    "roof_of_run",
    "settle",
    "simulated_plans",
    "system_weights",
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

#: The longest :func:`measure_machine` takes by default, in seconds: a rate that has not
#: settled by then is reported as it stands, with its spread.
MEASURE_SECONDS = 10.0

#: The share of the time limit the bandwidth may take (the matmul takes the rest), and the
#: length of one round of either probe as a share of it.
BANDWIDTH_SHARE = 0.3
ROUND_SHARE = 0.025

#: A rate has settled when the best two of its last ``SETTLE_ROUNDS`` rounds agree within
#: ``SETTLE_TOLERANCE`` of the better one. On the AMX Xeon of issue 52 one bfloat16 probe read
#: 523.9 GFLOPS and another, an hour earlier, 1,961: one round is not a measurement.
SETTLE_ROUNDS = 3
SETTLE_TOLERANCE = 0.05


def _rates(rates: Iterable[float]) -> tuple[float, ...]:
    return tuple(rates)


@attrs.frozen(kw_only=True)
class Probe:
    """How one rate was measured: each round's best rate, and whether they settled.

    Attributes:
        rounds: Each round's rate (bytes or FLOPs per second), in order.
        settled: Whether the best two of the last :data:`SETTLE_ROUNDS` rounds agreed
            within the tolerance before the time ran out.
        tolerance: That tolerance, as a fraction of the better rate.
    """

    rounds: tuple[float, ...] = attrs.field(converter=_rates)
    settled: bool
    tolerance: float = SETTLE_TOLERANCE

    @rounds.validator
    def _check_rounds(self, attribute: object, value: tuple[float, ...]) -> None:
        if not value or not all(rate > 0 for rate in value):
            raise ValueError(f"a probe's rounds must be rates > 0, at least one, got {value}")

    @property
    def best(self) -> float:
        """The best round's rate: the one least disturbed, for an upper bound."""
        return max(self.rounds)

    @property
    def spread(self) -> float:
        """How far the worst round fell below the best, as a fraction of the best."""
        return 1 - min(self.rounds) / self.best

    def describe(self) -> str:
        """``"3 rounds, spread 2 %, settled"``, or why it did not settle."""
        count = f"{len(self.rounds)} round{'s' * (len(self.rounds) != 1)}"
        if self.settled:
            return f"{count}, spread {100 * self.spread:.0f} %, settled"
        return (
            f"{count}, spread {100 * self.spread:.0f} %, NOT settled (the best two of the last "
            f"{SETTLE_ROUNDS} never within {100 * self.tolerance:.0f} %): the roof may be low"
        )

    def to_json(self) -> dict[str, Any]:
        """The rounds, whether they settled, and the spread."""
        return {
            "rounds": list(self.rounds),
            "settled": self.settled,
            "tolerance": self.tolerance,
            "spread": self.spread,
        }


def settle(
    round_rate: Callable[[], float],
    *,
    clock: Callable[[], float],
    budget: float,
    tolerance: float = SETTLE_TOLERANCE,
) -> Probe:
    """Measure rounds of a rate until it settles or ``budget`` seconds have passed.

    Args:
        round_rate: Runs one round and returns its rate (> 0).
        clock: The timer (monotonic seconds).
        budget: The time after which no new round starts (one round always runs).
        tolerance: How close (a fraction of the better) the best two of the last
            :data:`SETTLE_ROUNDS` rounds must be.

    Returns:
        The rounds, settled or not.
    """
    began = clock()
    rates: list[float] = []
    while True:
        rates.append(round_rate())
        if len(rates) >= SETTLE_ROUNDS:
            second, first = sorted(rates[-SETTLE_ROUNDS:])[-2:]
            if first - second <= tolerance * first:
                return Probe(rounds=rates, settled=True, tolerance=tolerance)
        if clock() - began >= budget:
            return Probe(rounds=rates, settled=False, tolerance=tolerance)


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
        bandwidth_probe: The bandwidth's rounds (``None``: given, not measured).
        flops_probe: The matmul's rounds at its largest size (``None``: given).
    """

    bandwidth: float = attrs.field(validator=_POSITIVE)
    flops: float = attrs.field(validator=_POSITIVE)
    dtype: str = attrs.field(validator=attrs.validators.in_(tuple(DTYPE_BYTES)))
    threads: int = attrs.field(validator=int_at_least(1))
    method: str = "given"
    seconds: float = 0.0
    load_average: float | None = None
    bandwidth_probe: Probe | None = None
    flops_probe: Probe | None = None

    @property
    def settled(self) -> bool:
        """Whether every measured rate settled (a given one counts as settled)."""
        probes = (self.bandwidth_probe, self.flops_probe)
        return all(probe is None or probe.settled for probe in probes)

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
        probes = [
            f"{what} {probe.describe()}"
            for what, probe in (("read", self.bandwidth_probe), ("matmul", self.flops_probe))
            if probe is not None
        ]
        if probes:
            line += f" [{'; '.join(probes)}]"
        return line

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (rates in bytes/s and FLOP/s; each probe's rounds and spread)."""
        document = attrs.asdict(self, recurse=False)
        for name in ("bandwidth_probe", "flops_probe"):
            probe = document[name]
            document[name] = None if probe is None else probe.to_json()
        return document


def _by_name(roofs: Mapping[str, WorkloadRoof]) -> dict[str, WorkloadRoof]:
    return dict(roofs)


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
        weights: Which weights the steps read, for the report (``""``: not said).
        systems: Each system's own roof, by name, where its weights are known
            (:func:`roof_of_run`); this roof is then the smallest weights', the others'.
    """

    machine: MachineRoof
    schedule: str
    steps: int = attrs.field(validator=int_at_least(1))
    floor_seconds: float = attrs.field(validator=_POSITIVE)
    memory_bound_steps: int = attrs.field(validator=int_at_least(0))
    bytes: int = attrs.field(validator=int_at_least(0))
    flops: int = attrs.field(validator=int_at_least(0))
    output_tokens: int = attrs.field(validator=int_at_least(1))
    weights: str = ""
    # (A dict is no hash: a roof hashes by its own figures.)
    systems: Mapping[str, WorkloadRoof] = attrs.field(factory=dict, converter=_by_name, hash=False)

    @property
    def output_throughput(self) -> float:
        """Output tokens per second at the floor: the roof."""
        return self.output_tokens / self.floor_seconds

    def of_system(self, name: str | None) -> WorkloadRoof:
        """The roof of the system ``name``: its own where its weights are known, else this."""
        return self if name is None else self.systems.get(name, self)

    def fraction(self, output_throughput: float, system: str | None = None) -> float:
        """A system's output throughput as a fraction of its roof's (:meth:`of_system`)."""
        return output_throughput / self.of_system(system).output_throughput

    def exceeded(self, output_throughput: float, system: str | None = None) -> bool:
        """Whether a system ran faster than its roof: no fraction, but a roof too low (a
        probe that read low, or work the cost model does not see)."""
        return self.fraction(output_throughput, system) > 1

    def percent(self, output_throughput: float, system: str | None = None) -> str:
        """The report's cell: the percentage of the roof, or ``">100 (roof too low)"``."""
        if self.exceeded(output_throughput, system):
            return ">100 (roof too low)"
        return f"{100 * self.fraction(output_throughput, system):.0f}"

    def summary(self) -> str:
        """The report's lines: rates, floor, roof throughput, the schedule, and each group of
        systems whose weights have a roof of their own."""
        bound = round(100 * self.memory_bound_steps / self.steps)
        line = (
            f"roof: {self.machine.summary()}; floor {self.floor_seconds:.2f} s over "
            f"{self.steps} steps ({bound} % memory-bound) of {self.schedule} → "
            f"{self.output_throughput:.1f} output tok/s"
        )
        if self.weights:
            line += f" reading {self.weights}"
        groups: dict[tuple[str, float], tuple[WorkloadRoof, list[str]]] = {}
        for name, roof in self.systems.items():
            groups.setdefault((roof.weights, roof.floor_seconds), (roof, []))[1].append(name)
        lines = [line]
        for roof, names in groups.values():
            lines.append(
                f"roof of {', '.join(names)}: floor {roof.floor_seconds:.2f} s → "
                f"{roof.output_throughput:.1f} output tok/s reading {roof.weights}"
            )
        if self.systems:
            lines.append("(a system not named above: the roof of the run's smallest weights)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, the roof throughput and each system's own roof included."""
        return {
            **attrs.asdict(self, recurse=False),
            "machine": self.machine.to_json(),
            "output_throughput": self.output_throughput,
            "systems": {name: roof.to_json() for name, roof in self.systems.items()},
        }


def workload_roof(
    machine: MachineRoof,
    cost: ModelCost,
    plans: Iterable[StepPlan],
    *,
    schedule: str,
    output_tokens: int,
    weights: str = "",
) -> WorkloadRoof:
    """Cost every step of ``plans`` and add up their floors on ``machine``.

    Args:
        machine: The rates.
        cost: The model's costs.
        plans: The schedule, one plan per step.
        schedule: What the schedule is, for the report.
        output_tokens: The workload's output tokens (the roof throughput's numerator).
        weights: Which weights ``cost`` reads, for the report.

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
        weights=weights,
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
    seconds: float = MEASURE_SECONDS,
    buffer_bytes: int | None = None,
    matmul_sizes: Sequence[int] = MATMUL_SIZES,
    clock: Callable[[], float] = time.perf_counter,
) -> MachineRoof:
    """Measure the memory bandwidth and the matmul throughput, each until it settles, in at
    most about ``seconds``.

    Runs on a fresh thread with ``threads`` torch threads (a thread's OpenMP team size is
    fixed when it first computes, so the caller's thread might keep another count).

    Each rate is measured in rounds of :data:`ROUND_SHARE` of ``seconds`` (a round's rate is
    its best repeat's) until it settles (:func:`settle`), and is the best round's. Bandwidth:
    ``torch.sum`` over a float32 buffer of ``buffer_bytes`` (default: 256 MiB or 8 times the
    last-level cache, whichever is larger), after one untimed pass, for at most
    :data:`BANDWIDTH_SHARE` of ``seconds``. Matmul: square products ``a @ b`` in ``dtype`` of
    each of ``matmul_sizes`` in turn, one untimed and two timed, growing while the next size's
    three products (predicted at this size's rate, as n³) fit in a round; the largest size run
    takes rounds until it settles or the time is spent; ``2 n³`` FLOPs per second, the best
    over all sizes.

    Args:
        dtype: The products' dtype (a key of :data:`~twostroke.engine.bench.cost.DTYPE_BYTES`).
        threads: torch threads (the bench's, as its systems use).
        seconds: The most time to spend, roughly (:data:`MEASURE_SECONDS` by default; a
            rate that settles sooner ends sooner, one round of each always runs).
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
    round_seconds = ROUND_SHARE * seconds
    counted = [0, 0]  # passes, products

    def rate(work: Callable[[], object], units: float, which: int) -> Callable[[], float]:
        def round_rate() -> float:
            times = _repeat(work, clock, round_seconds, warm_up=False, at_least=1)
            counted[which] += len(times)
            return units / min(times)

        return round_rate

    with torch_threads(threads), torch.inference_mode():
        buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)  # touches every page
        buffer.sum()  # the untimed pass
        read = settle(
            rate(buffer.sum, buffer_bytes // 4 * 4, 0),
            clock=clock,
            budget=BANDWIDTH_SHARE * seconds,
        )
        del buffer
        generator = torch.Generator().manual_seed(0)
        kind = getattr(torch, dtype)
        best, ran = 0.0, []
        for index, size in enumerate(sizes):
            a = torch.rand(size, size, generator=generator).to(kind)
            b = torch.rand(size, size, generator=generator).to(kind)
            product = functools.partial(torch.matmul, a, b)
            times = _repeat(product, clock, 0.0)
            counted[1] += len(times)
            best = max(best, 2 * size**3 / min(times))
            ran.append(size)
            following = sizes[index + 1] if index + 1 < len(sizes) else None
            # The next size's untimed product and two timed ones, at this size's rate (n³).
            if following is None or 3 * min(times) * (following / size) ** 3 > round_seconds:
                # The largest size that fits a round: rounds of it until the rate settles.
                left = seconds - (clock() - began)
                matmul = settle(rate(product, 2 * size**3, 1), clock=clock, budget=left)
                best = max(best, matmul.best)
                break
    if cache is None:
        cached = ""
    elif buffer_bytes >= cache:
        cached = f" ({buffer_bytes / cache:.0f}x the {cache >> 20} MiB cache)"
    else:
        cached = f" (within the {cache >> 20} MiB cache: its bandwidth, not the memory's)"
    method = (
        f"read: best of {counted[0]} torch.sum passes over {buffer_bytes >> 20} MiB of float32"
        f"{cached}; matmul: best of {counted[1]} {dtype} square products of sizes "
        f"{', '.join(map(str, ran))}"
    )
    return MachineRoof(
        bandwidth=read.best,
        flops=best,
        dtype=dtype,
        threads=threads,
        method=method,
        seconds=clock() - began,
        load_average=_load_average(),
        bandwidth_probe=read,
        flops_probe=matmul,
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
    dtype; :func:`plan_cost`).

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
    from twostroke.engine.models.plan import resolve_run
    from twostroke.engine.models.source import read_source
    from twostroke.engine.runners.loading import default_torch_threads

    # The engine's own plan for the run's options (weights, activations, KV cache): the
    # roof costs what the engine reads.
    config = EngineConfig(dtype=cast(DtypeOption, model.dtype) if model.exact else "auto")
    plan = resolve_run(config, read_source(model.source), torch.device("cpu"))
    cost = plan_cost(plan, model.source)
    dtype = str(plan.dtype).removeprefix("torch.")
    # The torch threads twostroke's systems run on, given the bench's cores.
    return measure(dtype=dtype, threads=default_torch_threads(model.threads)), cost


def plan_cost(plan: RunPlan, source: Path) -> ModelCost:
    """The costs of a step of twostroke's run ``plan`` of the model at ``source``.

    A GGUF file whose blocks the plan computes as stored costs its stored bytes
    (:func:`~twostroke.engine.models.loading.stored_bytes`); projections quantized into
    blocks at load cost those blocks; another model its projections in the precision the plan
    holds them in and the rest in its dtype; the KV cache its positions in the plan's cache
    dtype.

    Raises:
        ModelLoadError: a GGUF file's blocks that cannot be read.
    """
    from twostroke.engine.models.loading import stored_bytes
    from twostroke.engine.models.plan import BLOCK_ACTIVATIONS

    as_stored = plan.weights in BLOCK_ACTIVATIONS
    if plan.requantize is not None:
        quantization = plan.weights
    else:
        quantization = None if as_stored else plan.kernels.projection.quantization
    return ModelCost.of(
        plan.config,
        dtype=str(plan.dtype).removeprefix("torch."),
        quantization=quantization,
        stored=stored_bytes(source) if as_stored else None,
        kv_cache_dtype=str(plan.cache_dtype).removeprefix("torch."),
    )


@attrs.frozen
class SystemWeights:
    """The weights one system reads a step, as its roof costs them.

    Attributes:
        description: What they are, for the roof's line (``"bfloat16 weights"``).
        cost: The step's costs with them.
    """

    description: str
    cost: ModelCost


def system_weights(drivers: Iterable[object], model: ModelSpec) -> dict[str, SystemWeights]:
    """The weights each of ``drivers`` reads a step of ``model``, by system name, where known.

    * twostroke's systems (a driver with ``plan(model, device)``): the plan of the run as
      the engine makes it from the system's options (:func:`plan_cost`);
    * llama.cpp, llama-server and OpenVINO GenAI on a GGUF file: the file's stored bytes, on
      float32 activations, the KV cache in llama.cpp's default float16 (OpenVINO's CPU
      default: 8 bits);
    * vLLM and transformers: dense weights, activations and KV cache in the bench's dtype
      (vLLM reads the bench's Hugging Face folder in it; transformers dequantizes a GGUF
      file into it).

    Any other system (an HTTP endpoint), or one whose plan cannot be made here, is left
    out: its roof is the run's smallest weights' (:func:`roof_of_run`).

    Raises:
        ModelLoadError: the model's configuration cannot be read.
    """
    import torch

    from twostroke.engine.bench.llamacpp_peer import GGUFPeer
    from twostroke.engine.bench.llamaserver_peer import LlamaServerDriver
    from twostroke.engine.bench.openvino_peer import OpenVinoDriver
    from twostroke.engine.bench.peers import HFContinuousDriver, HFStaticDriver
    from twostroke.engine.bench.vllm_peer import VLLMDriver
    from twostroke.engine.errors import EngineError
    from twostroke.engine.models.loading import stored_bytes
    from twostroke.engine.models.source import read_config

    config = read_config(model.source)
    stored: dict[str, int] | None = None
    known: dict[str, SystemWeights] = {}
    for driver in drivers:
        name = str(getattr(driver, "name", ""))
        if isinstance(driver, GGUFPeer | LlamaServerDriver):
            if not model.is_gguf:
                continue  # it does not run
            stored = stored if stored is not None else stored_bytes(model.source)
            cache = "uint8" if isinstance(driver, OpenVinoDriver) else "float16"
            cost = ModelCost.of(config, stored=stored, kv_cache_dtype=cache)
            known[name] = SystemWeights(f"the GGUF file as stored, {cache} KV", cost)
        elif isinstance(driver, HFStaticDriver | HFContinuousDriver | VLLMDriver):
            cost = ModelCost.of(config, dtype=model.dtype)
            known[name] = SystemWeights(f"dense {model.dtype} weights", cost)
        elif callable(plan := getattr(driver, "plan", None)):
            try:
                with warnings.catch_warnings():
                    # (A form that does not run here warns when the system loads, not here.)
                    warnings.simplefilter("ignore")
                    run = plan(model, torch.device("cpu"))
                    cost = plan_cost(run, model.source)
            except (EngineError, ValueError):
                # A plan that cannot be made here (blocks of a folder, a kernel that does
                # not build): the system fails its own run the same way; its weights are
                # not known, and it takes the smallest weights' roof.
                continue
            known[name] = SystemWeights(
                f"twostroke's plan: {run.weights or run.dtype} weights, "
                f"{str(run.dtype).removeprefix('torch.')} activations",
                cost,
            )
    return known


def roof_of_run(
    machine: MachineRoof,
    cost: ModelCost,
    workload: Workload,
    *,
    drivers: Iterable[object] = (),
    recorded_by: str = "twostroke-depth2",
    policy: SchedulingPolicy | None = None,
    weights: Mapping[str, SystemWeights] | None = None,
) -> WorkloadRoof:
    """The workload's roof over the steps ``recorded_by`` ran, else its simulated schedule.

    Args:
        machine: The rates.
        cost: The model's costs (the roof's when ``weights`` names none).
        workload: What the systems ran.
        drivers: The run's systems; one named ``recorded_by`` may hold its step plans.
        recorded_by: The system whose schedule is preferred.
        policy: The batching limits of the simulated schedule.
        weights: Each system's weights (:func:`system_weights`): each gets a roof of its
            own, and the roof returned is the one of the smallest weights among them (a
            lower floor, still a bound, for a system whose weights are not known).
    """
    output_tokens = sum(request.max_tokens for request in workload.requests)
    plans = recorded_schedule(drivers, recorded_by)
    if plans is not None:
        schedule = f"the schedule {recorded_by} ran"
    else:
        plans = simulated_plans(workload, policy)
        schedule = f"the scheduler's plan without a model (no {recorded_by} run to replay"
        schedule += ")" if workload.is_offline else "; every request at t = 0)"
    if not weights:
        return workload_roof(machine, cost, plans, schedule=schedule, output_tokens=output_tokens)
    roofs: dict[SystemWeights, WorkloadRoof] = {}
    for system in weights.values():
        if system not in roofs:
            roofs[system] = workload_roof(
                machine,
                system.cost,
                plans,
                schedule=schedule,
                output_tokens=output_tokens,
                weights=system.description,
            )
    # The lowest floor: the smallest weights' (the FLOPs are every system's).
    smallest = min(roofs.values(), key=lambda roof: roof.floor_seconds)
    return attrs.evolve(
        smallest,
        weights=f"the run's smallest weights ({smallest.weights})",
        systems={name: roofs[system] for name, system in weights.items()},
    )
