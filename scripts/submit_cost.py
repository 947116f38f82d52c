"""The event loop's CPU time for a burst of submits, on the toy engine.

Not a test: run it by hand, ``python scripts/submit_cost.py [--submits 16000]``. It opens the
toy engine (:class:`~twostroke.engine.runners.toy.ToyRunner`,
:class:`~twostroke.engine.runners.toy.ByteTokenizer`), submits ``--submits`` requests in one
burst from the event loop's thread, without a checkpoint between them (as a burst of HTTP
requests reaches the engine), and reports the CPU time of that thread over the burst:
``time.thread_time``, so work of other processes on a shared machine and of the engine's
forward thread is not counted, while the collector's passes that the burst triggers are.
The engine is then closed with every request cancelled (not measured).

Each prompt kind is measured (``--kind``): token ids (a list of ints, checked against the
vocabulary), text (tokenized by the byte tokenizer) and chat messages. The figure to quote is
the median of ``--rounds`` bursts, each in an engine of its own, after one burst that is not
counted (a fresh process's first burst also grows the allocator's arenas, which a serving
process did long ago), with the load average (``os.getloadavg``) printed beside it: compare
figures only from one run, or from runs that alternate.

``--profile`` prints the burst's cProfile instead (one round, sorted by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import time
from collections.abc import Sequence
from typing import Any

import anyio

from twostroke.engine import Engine, SamplingParams
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner

#: Prompts of each kind: a few dozen tokens, about what a short chat turn is.
PROMPTS: dict[str, Any] = {
    "token_ids": list(b"Summarise the following paragraph in one line, please."),
    "text": "Summarise the following paragraph in one line, please.",
    "messages": [{"role": "user", "content": "Summarise the following paragraph, please."}],
}


async def burst(kind: str, submits: int, profile: bool) -> float:
    """One burst of ``submits`` submits in a fresh toy engine: its thread CPU seconds."""
    params = SamplingParams(max_tokens=16)
    prompt = PROMPTS[kind]
    async with Engine.open(
        runner=ToyRunner(),
        tokenizer=ByteTokenizer(),
        device="cpu",
        num_blocks=1024,
        block_size=16,
        shutdown="cancel",
    ) as engine:
        # What is alive now lives as long as the engine, as ``twostroke serve`` freezes it.
        gc.freeze()
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        began = time.thread_time()
        for _ in range(submits):
            engine.submit(prompt, params)
        spent = time.thread_time() - began
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    gc.unfreeze()
    return spent


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submits", type=int, default=16_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kind", choices=[*PROMPTS, "all"], default="all")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--profile", action="store_true", help="print one burst's cProfile")
    args = parser.parse_args(argv)
    kinds = list(PROMPTS) if args.kind == "all" else [args.kind]
    for kind in kinds:
        rounds = 1 if args.profile else args.rounds
        anyio.run(burst, kind, args.submits, False, backend=args.backend)  # not counted
        spent = [
            anyio.run(burst, kind, args.submits, args.profile, backend=args.backend)
            for _ in range(rounds)
        ]
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
        print(
            f"{kind:9} {args.submits} submits ({args.backend}): event-loop CPU median "
            f"{statistics.median(spent):.3f} s (min {min(spent):.3f}, max {max(spent):.3f}, "
            f"{rounds} rounds); load average {load}",
            flush=True,
        )


if __name__ == "__main__":
    main()
