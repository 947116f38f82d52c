"""Load time, peak RSS and decode throughput of TorchModelRunner on SmolLM2 (not a test).

Runs the runner under the real scheduler with a plain synchronous loop (no engine, no event
loop), so the figures are the model's and the runner's alone. Each dtype runs in a fresh
process so that its peak RSS is its own. The workloads:

* the side-by-side workload of docs/performance.md: random prompts of 26-248 tokens, 128
  greedy tokens each, EOS ignored; one request alone, then 32 at once;
* ``--offline``: also issue 5's offline workload, 64 requests with prompts of 16-512 and
  outputs of 16-256 tokens (seeded), all submitted at once.

Throughput is output tokens over wall time (prefill included, vLLM's offline definition);
the decode figure times only steps that are all decodes. The machine is shared, so each
figure comes with the 1-minute load average at its end: compare figures taken at similar
loads only.

    .venv/bin/python scripts/runner_throughput.py [--dtypes float32 bfloat16] [--threads 2]
        [--budget 512] [--offline]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from typing import Any

import torch

from twostroke.engine.models.loading import open_model
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.gpu.threads import torch_threads
from twostroke.states.params import SamplingParams
from twostroke.states.request import Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig

BLOCK_SIZE = 16


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def serve(
    runner: TorchModelRunner,
    prompts: list[list[int]],
    max_tokens: list[int],
    num_blocks: int,
    budget: int,
) -> dict[str, float]:
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=budget,
            max_num_seqs=64,
            max_model_len=runner.max_model_len,
            pipeline_depth=1,
        )
    )
    for index, (prompt, count) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True)
        scheduler.add_request(Request(index, prompt, params, 0.0))
    generated = 0
    decode_time = 0.0
    decode_tokens = 0
    started = time.perf_counter()
    while not scheduler.is_idle():  # serial (pipeline_depth=1): nothing in flight here
        plan = scheduler.schedule()
        assert plan is not None
        step_started = time.perf_counter()
        output = runner.execute(plan).readback()
        if all(entry.num_tokens == 1 for entry in plan.requests):
            decode_time += time.perf_counter() - step_started
            decode_tokens += plan.num_samples
        generated += len(scheduler.apply(output).new_tokens)
    elapsed = time.perf_counter() - started
    return {
        "output_tokens_per_s": generated / elapsed,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
        "seconds": elapsed,
        "load_average": os.getloadavg()[0],
    }


def measure(
    dtype_name: str, threads: int, max_tokens: int, concurrency: int, budget: int, offline: bool
) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    rss_before = peak_rss_mib()
    loaded = open_model("smollm2", dtype=dtype, device=torch.device("cpu"))
    rss_loaded = peak_rss_mib()
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(26, 248))] for _ in range(concurrency)
    ]
    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = concurrency * -(-longest // BLOCK_SIZE)
    results: dict[str, Any] = {
        "dtype": dtype_name,
        "threads": threads,
        "load_seconds": round(loaded.load_seconds, 2),
        "rss_before_load_mib": round(rss_before),
        "peak_rss_after_load_mib": round(rss_loaded),
    }
    workloads = [
        ("single", prompts[:1], [max_tokens]),
        (f"concurrent_{concurrency}", prompts, [max_tokens] * concurrency),
    ]
    if offline:
        rng = random.Random(0)
        lengths = [(rng.randint(16, 512), rng.randint(16, 256)) for _ in range(64)]
        offline_prompts = [[rng.randrange(vocab) for _ in range(n)] for n, _ in lengths]
        workloads.append(("offline_64", offline_prompts, [out for _, out in lengths]))
        num_blocks = max(num_blocks, 64 * -(-(512 + 256) // BLOCK_SIZE))
    for label, batch, outputs in workloads:
        runner = TorchModelRunner.from_loaded(loaded)
        runner.allocate_kv_cache(num_blocks, BLOCK_SIZE)
        serve(runner, [p[:32] for p in batch[:2]], [4] * min(2, len(batch)), num_blocks, budget)
        runner = TorchModelRunner.from_loaded(loaded)
        runner.allocate_kv_cache(num_blocks, BLOCK_SIZE)
        figures = serve(runner, batch, outputs, num_blocks, budget)
        results[label] = {key: round(value, 2) for key, value in figures.items()}
    results["peak_rss_mib"] = round(peak_rss_mib())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--offline", action="store_true", help="also the 64-request workload")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with torch_threads(args.threads):
            result = measure(
                args.one, args.threads, args.max_tokens, args.concurrency, args.budget, args.offline
            )
        print(json.dumps(result))
        return
    for dtype in args.dtypes:
        command = [
            sys.executable, __file__, "--one", dtype, "--threads", str(args.threads),
            "--max-tokens", str(args.max_tokens), "--concurrency", str(args.concurrency),
            "--budget", str(args.budget), *(["--offline"] if args.offline else []),
        ]  # fmt: skip
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        print(json.dumps(json.loads(output.strip().splitlines()[-1]), indent=2), flush=True)


if __name__ == "__main__":
    main()
