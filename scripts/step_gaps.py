"""Where the device waits: each step timed on the forward thread, at depth 1 and 2, alternated.

Not a test: run it by hand, ``python scripts/step_gaps.py [--requests 32] [--tokens 64]
[--depths 1,2,1,2] [--warmup]``. It runs one offline workload (the bench's prompts) through
the engine on SmolLM2 several times in one process, and prints for each run the output
tokens per second, the gaps between two steps on the forward thread (the device idle,
waiting on Python), the forward thread's CPU seconds, the event loop thread's CPU seconds and
the engine's own ``forward_seconds`` / ``forward_idle_seconds`` / ``bookkeeping_seconds``.
Runs alternate so that a drift of the machine shows as such. docs/performance-log.md, "The
forward thread queues the next step", quotes it.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import anyio
import torch

from twostroke.engine import Engine
from twostroke.engine.bench.streaming import stream_workload
from twostroke.engine.bench.workload import offline_workload
from twostroke.engine.models.loading import open_model
from twostroke.engine.models.plan import DTYPES, resolve_dtype
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.engine.text.tokenizer import HFTokenizer
from twostroke.gpu.device import CpuDevice
from twostroke.gpu.threads import torch_threads
from twostroke.states.plan import StepPlan


class TimedRunner:
    """The torch runner, timing every step where it runs (the device's forward thread)."""

    def __init__(self, runner: TorchModelRunner) -> None:
        self.runner = runner
        #: (start, end, thread CPU seconds, rows) of every step.
        self.steps: list[tuple[float, float, float, int]] = []

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_cache_bytes_per_block(block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, block_size)

    def execute(self, plan: StepPlan) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        launched = self.runner.execute(plan)
        self.steps.append(
            (start, time.perf_counter(), time.thread_time() - cpu, len(plan.requests))
        )
        return launched


async def one_run(
    loaded: Any, tokenizer: HFTokenizer, workload: Any, depth: int, label: str
) -> None:
    runner = TimedRunner(TorchModelRunner.from_loaded(loaded, max_num_seqs=64))
    device = CpuDevice()
    options: dict[str, Any] = {"pipeline_depth": depth, "torch_threads": torch.get_num_threads()}
    async with (
        device,
        Engine.open(runner=runner, tokenizer=tokenizer, device=device, **options) as engine,
    ):
        loop_cpu = time.thread_time()
        streamed = await stream_workload(engine, workload)
        loop_cpu = time.thread_time() - loop_cpu
        stats = engine.statistics()
    steps = runner.steps
    gaps = [after[0] - before[1] for before, after in itertools.pairwise(steps)]
    print(
        f"{label} depth {depth}: "
        f"{stats.num_tokens_generated / streamed.wall_seconds:6.1f} out tok/s, "
        f"{len(steps)} steps, median gap {statistics.median(gaps) * 1e6:7.0f} us, "
        f"sum of gaps {sum(gaps):.3f} s, forward thread CPU {sum(s[2] for s in steps):.2f} s, "
        f"loop CPU {loop_cpu:.2f} s | engine: forward {stats.forward_seconds:.2f} s, "
        f"idle {stats.forward_idle_seconds:.3f} s, bookkeeping {stats.bookkeeping_seconds:.3f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depths", default="1,2,1,2")
    parser.add_argument("--warmup", action="store_true", help="one untimed run first")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, CpuDevice())
    loaded = open_model(args.model, dtype=dtype, device=torch.device("cpu"))
    tokenizer = HFTokenizer.from_pretrained(loaded.source)
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {dtype}, {args.threads} threads"
    )

    def workload(tokens: int) -> Any:
        return offline_workload(
            tokenizer.encode, n=args.requests, prompt_len=(26, 248), output_len=(tokens, tokens)
        )

    with torch_threads(args.threads):
        if args.warmup:
            anyio.run(one_run, loaded, tokenizer, workload(8), 1, "warm-up")
        for depth in map(int, args.depths.split(",")):
            anyio.run(one_run, loaded, tokenizer, workload(args.tokens), depth, "run")


if __name__ == "__main__":
    main()
