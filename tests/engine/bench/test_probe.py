"""The machine's probe: rounds that settle, the measurement on a fake clock, the rates' checks."""

from __future__ import annotations

import itertools
import json

import pytest

from twostroke.engine.bench.probe import (
    SETTLE_ROUNDS,
    MachineRoof,
    Probe,
    measure_machine,
    settle,
)


def test_the_measurement_on_a_fake_clock() -> None:
    ticks = itertools.count()

    def clock() -> float:
        return next(ticks) / 1000  # every timed call takes exactly 1 ms

    machine = measure_machine(
        threads=1, seconds=1.0, buffer_bytes=2**20, matmul_sizes=(8, 16), clock=clock
    )
    assert machine.bandwidth == pytest.approx(2**20 / 0.001)
    assert machine.flops == pytest.approx(2 * 16**3 / 0.001)  # the larger size, same time
    assert (machine.dtype, machine.threads) == ("float32", 1)
    assert machine.method.startswith("read: best of ")
    assert "torch.sum passes over 1 MiB of float32" in machine.method
    assert machine.method.endswith("float32 square products of sizes 8, 16")
    # Every round reads the same rate: both settle after SETTLE_ROUNDS rounds, well within
    # the limit of 1 s, with no spread.
    assert machine.bandwidth_probe is not None
    assert machine.flops_probe is not None
    for probe in (machine.bandwidth_probe, machine.flops_probe):
        assert (len(probe.rounds), probe.settled) == (SETTLE_ROUNDS, True)
        assert probe.spread == pytest.approx(0.0, abs=1e-9)  # (the clock's rounding)
    assert machine.flops_probe.best == machine.flops
    assert machine.bandwidth_probe.best == machine.bandwidth
    assert machine.settled
    assert machine.seconds < 0.5
    assert machine.summary().endswith(
        "[read 3 rounds, spread 0 %, settled; matmul 3 rounds, spread 0 %, settled]"
    )
    document = json.loads(json.dumps(machine.to_json()))
    assert document["flops_probe"]["settled"] is True
    assert document["flops_probe"]["rounds"] == [pytest.approx(2 * 16**3 / 0.001)] * 3


def test_a_measurement_that_never_settles_says_so_within_its_limit() -> None:
    """A machine that slows down all the time (each call 10 % longer than the one before):
    no two rounds agree, so both probes run to their limit and the summary says the rates
    did not settle, with their spread; the measurement still ends, near its limit."""
    now, step = [0.0], [0.001]

    def clock() -> float:
        now[0] += step[0]
        step[0] *= 1.1
        return now[0]

    machine = measure_machine(
        threads=1, seconds=1.0, buffer_bytes=2**20, matmul_sizes=(8,), clock=clock
    )
    assert machine.bandwidth_probe is not None
    assert machine.flops_probe is not None
    assert not machine.bandwidth_probe.settled
    assert not machine.flops_probe.settled
    assert not machine.settled
    assert len(machine.bandwidth_probe.rounds) >= 2
    assert machine.bandwidth_probe.spread > 0.05
    assert 0.3 <= machine.seconds < 2.0  # the limit, and at most the round that passed it
    assert "read " in machine.summary()
    assert "NOT settled" in machine.summary()
    assert "the roof may be low" in machine.summary()


def test_rounds_settle_once_the_best_two_of_the_last_three_agree() -> None:
    """Rounds of 1 s on a fake clock: a probe that reads low at first (the issue's AMX
    Xeon read 524 GFLOPS and 1,961 an hour apart) keeps going until the best two of the last
    three rounds are within 5 %, and reports the best round and the spread of all."""
    rates = iter([500.0, 1500.0, 1900.0, 1800.0, 1960.0, 1955.0])
    now = [0.0]

    def clock() -> float:
        return now[0]

    def round_rate() -> float:
        now[0] += 1.0
        return next(rates)

    probe = settle(round_rate, clock=clock, budget=100.0)
    # Rounds 1-3: 1,500 and 1,900 are 21 % apart; 2-4: 1,900 and 1,800, 5.3 %; 3-5: 1,960
    # and 1,900, 3.1 %: settled after five rounds.
    assert probe.rounds == (500.0, 1500.0, 1900.0, 1800.0, 1960.0)
    assert probe.settled
    assert probe.best == 1960.0
    assert probe.spread == pytest.approx(1 - 500 / 1960)
    assert probe.describe() == "5 rounds, spread 74 %, settled"
    # The same rounds with a limit of 3 s: the third round starts at 2 s, the fourth would
    # start at 3 s, so it stops unsettled after three.
    rates = iter([500.0, 1500.0, 1900.0, 1800.0])
    now[0] = 0.0
    short = settle(round_rate, clock=clock, budget=3.0)
    assert (short.rounds, short.settled) == ((500.0, 1500.0, 1900.0), False)
    assert short.describe().startswith("3 rounds, spread 74 %, NOT settled (the best two of")
    with pytest.raises(ValueError, match=r"a probe's rounds must be rates > 0, at least one"):
        Probe(rounds=(), settled=False)


def test_a_size_is_skipped_once_the_budget_is_short() -> None:
    ticks = itertools.count()
    machine = measure_machine(
        seconds=0.005,
        buffer_bytes=2**20,
        matmul_sizes=(4, 8),
        clock=lambda: next(ticks) / 1000,
    )
    assert machine.method.endswith("square products of sizes 4")
    assert machine.flops == pytest.approx(2 * 4**3 / 0.001)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "int8"}, "dtype must be one of float32, bfloat16, float16, got 'int8'"),
        ({"threads": 0}, "threads must be an int >= 1, got 0"),
        ({"seconds": 0.0}, "seconds must be a finite number > 0, got 0.0"),
        ({"buffer_bytes": 4096}, r"buffer_bytes must be >= 1 MiB \(1048576\), got 4096"),
        ({"matmul_sizes": ()}, r"matmul_sizes must be sizes >= 1, got \(\)"),
    ],
)
def test_bad_measurement_arguments(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        measure_machine(**options)  # type: ignore[arg-type]


def test_machine_rates_are_checked() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        MachineRoof(bandwidth=0.0, flops=1.0, dtype="float32", threads=1)
    with pytest.raises(ValueError, match="dtype"):
        MachineRoof(bandwidth=1.0, flops=1.0, dtype="int8", threads=1)
