"""The probe: how fast this machine reads memory and multiplies matrices, measured in seconds.

:func:`measure_machine` measures the two rates a roofline needs, on a fresh thread at the
bench's torch threads: the memory bandwidth (bytes per second that ``torch.sum`` reads from a
float32 buffer many times the last-level cache, :func:`last_level_cache_bytes`, the way a
decode step streams its weights) and the matmul throughput (FLOP/s of square products in the
bench's dtype, the size growing while the next one fits a round). It returns a
:class:`MachineRoof`, whose :meth:`~MachineRoof.step_seconds` is a step's floor;
:mod:`~twostroke.engine.bench.roof` adds those floors up over a workload's schedule.
:func:`machine_speed` is the quick probe the bench takes around each system: a quarter second
of one small float32 product, the cores' speed at that moment.

Each rate is the best of several repeats, as STREAM reports its best: on a shared machine the
best repeat is the one least disturbed by other processes, and a roof is an upper bound. One
round is not a measurement (a probe on a busy machine reads low, and a low rate makes a roof
that a run can pass), so a rate is measured in rounds until it settles (:func:`settle`: the
best two of the last :data:`SETTLE_ROUNDS` rounds within :data:`SETTLE_TOLERANCE`), within a
time limit; its :class:`Probe` keeps every round, and the summary gives their spread and says
so when they did not settle.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from twostroke.engine.bench.cost import DTYPE_BYTES
from twostroke.states.validators import int_at_least, number_in

__all__ = [
    "MachineRoof",
    "Probe",
    "last_level_cache_bytes",
    "machine_speed",
    "measure_machine",
    "settle",
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
