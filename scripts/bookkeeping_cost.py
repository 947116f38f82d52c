"""Per-token bookkeeping cost of the engine, on the toy runner with zero latency.

Not a test: run it by hand, ``python scripts/bookkeeping_cost.py [--requests 256]``.
It submits N concurrent requests that each generate ``--tokens`` tokens (EOS ignored) and
reports the bookkeeping stroke's own time (planning, applying outcomes, detokenizing and
delivering) per generated token, next to the wall time per token of the whole run.
"""

from __future__ import annotations

import argparse
import time

import anyio

from twostroke.engine import Engine, SamplingParams
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner


async def measure(requests: int, tokens: int, depth: int, backend_label: str) -> None:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    async with Engine.open(
        runner=ToyRunner(),
        tokenizer=ByteTokenizer(),
        device="cpu",
        num_blocks=requests * 8,
        block_size=16,
        max_num_seqs=requests,
        max_num_batched_tokens=max(2048, requests * 2),
        pipeline_depth=depth,
    ) as engine:
        start = time.perf_counter()
        async with anyio.create_task_group() as task_group:
            for index in range(requests):
                task_group.start_soon(engine.generate, f"request {index:04d}", params)
        wall = time.perf_counter() - start
        stats = engine.statistics()
    generated = stats.num_tokens_generated
    print(
        f"{backend_label:8} depth={depth} requests={requests} tokens={generated} "
        f"steps={stats.num_steps} wall={wall:.2f}s "
        f"bookkeeping={stats.bookkeeping_seconds * 1e6 / generated:.1f} us/token "
        f"forward={stats.forward_seconds * 1e6 / generated:.1f} us/token "
        f"wall={wall * 1e6 / generated:.1f} us/token"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    for backend in ("asyncio", "trio"):
        for depth in (1, 2):
            anyio.run(measure, args.requests, args.tokens, depth, backend, backend=backend)


if __name__ == "__main__":
    main()
