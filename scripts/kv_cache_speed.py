"""Throughput of SmolLM2 with the KV cache in float32 and in 16 bits, side by side in one
process (not a test): the figures of docs/models.md's "The KV cache's element type".

32 requests (prompts of 200-300 random tokens, 128 greedy tokens each, EOS ignored) through
``LLM`` with float32 activations, once per ``kv_cache_dtype``, alternating ``--rounds`` times.
Each engine runs the batch twice: with one output token (the prefill, and the first token)
and with all of them; the decode rate is the tokens after the first over the difference.
Prints it per run and each round's ratio to the first dtype's, with the CPU capability.

    .venv/bin/python scripts/kv_cache_speed.py [--rounds 2] [--dtypes float32 float16]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from twostroke.engine import LLM, SamplingParams


def run(cache: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Decode tokens per second: the whole batch less its prefill, timed apart."""
    seconds = []
    with LLM("smollm2", dtype="float32", kv_cache_dtype=cache) as llm:
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), progress=False)  # warm
        for tokens in (1, max_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            started = time.perf_counter()
            llm.generate(prompts, params, progress=False)
            seconds.append(time.perf_counter() - started)
    return len(prompts) * (max_tokens - 1) / (seconds[1] - seconds[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    args = parser.parse_args()
    generator = random.Random(0)
    prompts = [
        [generator.randrange(100, 40000) for _ in range(generator.randrange(200, 301))]
        for _ in range(args.requests)
    ]
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.2f} at the start"
    )
    for round_ in range(args.rounds):
        rates = {cache: run(cache, prompts, args.max_tokens) for cache in args.dtypes}
        base = rates[args.dtypes[0]]
        print(
            f"round {round_ + 1}: "
            + ", ".join(
                f"{cache} {rate:.1f} tok/s ({rate / base:.2f}x)" for cache, rate in rates.items()
            )
            + f"; load average {os.getloadavg()[0]:.2f}"
        )


if __name__ == "__main__":
    main()
