"""The data-parallel coordinator's own cost per relayed token, on the toy runner.

Not a test: run it by hand, ``python scripts/coordinator_cost.py [--requests 256]``. It opens
a coordinator over ``--replicas`` process replicas of the toy model (zero latency, so the
replicas produce tokens as fast as their bookkeeping allows), submits N concurrent requests
that each generate ``--tokens`` tokens (EOS ignored), and reports per relayed token:

* ``relay``: the coordinator's own work — decoding the replicas' frames, routing updates and
  feeding the handles (``CoordinatorStatistics.relay_seconds``); the issue's target is
  <= 20 us at 256 concurrent requests;
* ``cpu``: all CPU time of the coordinator's process (the relay, the callers' 256 tasks
  consuming the outputs, the event loop);
* ``wall``: the run's wall time.
"""

from __future__ import annotations

import argparse
import time

import anyio

from twostroke.engine import Coordinator, SamplingParams


async def measure(requests: int, tokens: int, replicas: int, placement: str, label: str) -> None:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    async with Coordinator.open(
        model="toy",
        replicas=replicas,
        placement=placement,  # type: ignore[arg-type]
        device="cpu",
        num_blocks=requests * 8,
        block_size=16,
        max_num_seqs=requests,
        max_num_batched_tokens=max(2048, requests * 2),
    ) as coordinator:
        cpu = time.process_time()
        start = time.perf_counter()
        async with anyio.create_task_group() as task_group:
            for index in range(requests):
                task_group.start_soon(coordinator.generate, f"request {index:04d}", params)
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
        await coordinator.wait_idle()
        stats = coordinator.statistics()
    relayed = requests * tokens
    print(
        f"{label:8} {placement}x{replicas} requests={requests} tokens={relayed} "
        f"relay={stats.relay_seconds * 1e6 / relayed:.1f} us/token "
        f"cpu={cpu * 1e6 / relayed:.1f} us/token "
        f"wall={wall * 1e6 / relayed:.1f} us/token "
        f"(replicas' bookkeeping {stats.bookkeeping_seconds * 1e6 / relayed:.1f} us/token)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--placement", default="process", choices=["process", "ray"])
    args = parser.parse_args()
    for backend in ("asyncio", "trio"):
        anyio.run(
            measure,
            args.requests,
            args.tokens,
            args.replicas,
            args.placement,
            backend,
            backend=backend,
        )


if __name__ == "__main__":
    main()
