"""Speed of a GGUF file's blocks computed as stored against the engine's other weight forms
(not a test): the figures of docs/models.md's block section.

Two measurements, each side by side in one process, the forms interleaved round by round so
that a machine shared with other work slows them alike:

* **decode**: SmolLM2-135M-Instruct's single stream through ``LLM`` (the whole engine), one
  request at a time, ``--tokens`` greedy tokens each (EOS ignored), its TPOT as the engine
  measures it (``RequestMetrics.tpot``); the median over ``--rounds`` x 2 requests per form;
* **kernels**: one layer's four projections (q/k/v 960x576, o 576x576, gate/up 3072x576,
  down 576x1536) and the tied output projection (49152x576) at 1, 4 and 32 rows: the
  file's blocks (Q4_1 layers, Q8_0 head) against torch's float32 ``F.linear`` and fbgemm's
  float16 weights (``quantization="fp16"``, the defaults' form), best of 5 runs each;
* **types** (``--types``): each block type's products at 1, 4 and 32 rows by a 3072x1536
  and a 1536x3072 weight (widths the K types' 256 divide), against Q4_1's, each type's
  blocks and Q4_1's timed alternately, the best of 5 x 5 runs each; with ``--baseline
  SOURCE`` (another version of gguf_blocks.c, ``kernels.h`` and ``native_element.h`` beside
  it) also that library's products of the same weights, timed in the same rounds.

    .venv/bin/python scripts/gguf_blocks_speed.py [--forms auto gguf none] [--rounds 3]
    .venv/bin/python scripts/gguf_blocks_speed.py --skip-decode --skip-kernels --types
    git show HEAD:engine/kernels/gguf_blocks.c > /tmp/old/gguf_blocks.c  # and the headers
    .venv/bin/python scripts/gguf_blocks_speed.py --skip-decode --skip-kernels --types \
        --baseline /tmp/old/gguf_blocks.c
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from twostroke.engine import LLM, SamplingParams
from twostroke.engine.checkpoints.gguf import BLOCK_TYPES, BlockTensor
from twostroke.engine.kernels.gguf_blocks import (
    BlockKernel,
    block_kernel,
    build_blocks,
    random_blocks,
)
from twostroke.engine.models.forms import BlockWeight, QuantizedWeight
from twostroke.gpu.threads import torch_threads

PROMPTS = (
    "The history of the printing press begins",
    "To bake a loaf of sourdough bread, you first need",
)
LABELS = {
    "auto": "defaults (fp16 projections, fbgemm)",
    "gguf": 'blocks as stored (`quantization="gguf"`)',
    "none": "float32 weights (`quantization=None`)",
}
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD = (49152, 576)


def decode(forms: list[str], rounds: int, tokens: int) -> dict[str, list[float]]:
    """TPOT of one request at a time, per form, over ``rounds`` rounds."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llms = {form: LLM("smollm2", quantization=None if form == "none" else form) for form in forms}
    found: dict[str, list[float]] = {form: [] for form in forms}
    try:
        for llm in llms.values():  # warm up: the first steps build and fault in
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8), progress=False)
        for _ in range(rounds):
            for form, llm in llms.items():
                for prompt in PROMPTS:
                    [output] = llm.generate([prompt], params, progress=False)
                    assert output.metrics.tpot is not None
                    found[form].append(output.metrics.tpot)
    finally:
        for llm in llms.values():
            llm.close()
    return found


def batch(forms: list[str], rounds: int, tokens: int, count: int) -> dict[str, list[float]]:
    """Output tokens a second of ``count`` requests submitted at once, per form."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (take {i})" for i in range(count)]
    llms = {form: LLM("smollm2", quantization=None if form == "none" else form) for form in forms}
    found: dict[str, list[float]] = {form: [] for form in forms}
    try:
        for llm in llms.values():
            llm.generate(prompts[:4], SamplingParams(max_tokens=8), progress=False)
        for _ in range(rounds):
            for form, llm in llms.items():
                started = time.perf_counter()
                outputs = llm.generate(prompts, params, progress=False)
                done = sum(len(output.token_ids) for output in outputs)
                found[form].append(done / (time.perf_counter() - started))
    finally:
        for llm in llms.values():
            llm.close()
    return found


def best(function: Callable[[], object], calls: int) -> float:
    function()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            function()
        times.append((time.perf_counter() - started) / calls)
    return min(times)


def kernels(threads: int) -> list[tuple[int, str, float, float, float]]:
    """Per row count and part (layer or head): blocks, F.linear float32, fbgemm float16 in s."""
    kernel = block_kernel()
    assert kernel is not None
    generator = np.random.default_rng(0)
    rows_out = []
    with torch_threads(threads):
        for rows in (1, 4, 32):
            for part, shapes, kind in (
                ("layer", SHAPES, "Q4_1"),
                ("head", (HEAD,), "Q8_0"),
            ):
                blocks = dense = half = 0.0
                for out_features, in_features in shapes:
                    number = BLOCK_TYPES[kind]
                    data = random_blocks(generator, number, out_features, in_features)
                    weight = BlockWeight(kernel, (BlockTensor("w", number, data),))
                    full = torch.randn(out_features, in_features) * 0.02
                    fp16 = QuantizedWeight(full, None, "fp16")
                    x = torch.randn(rows, in_features)
                    calls = max(2, 400 // rows // (10 if part == "head" else 1))
                    blocks += best(lambda w=weight, x=x: w(x), calls)
                    dense += best(lambda w=full, x=x: F.linear(x, w), calls)
                    half += best(lambda w=fp16, x=x: w(x), calls)
                rows_out.append((rows, part, blocks, dense, half))
    return rows_out


def types(
    threads: int, row_counts: list[int], baseline: BlockKernel | None
) -> list[tuple[int, str, float, float, float | None]]:
    """Per row count and block type: its products' time, Q4_1's and the baseline library's
    of the same weights (``None`` without one), in s (the sum over the two shapes), timed
    alternately."""
    kernel = block_kernel()
    assert kernel is not None
    generator = np.random.default_rng(0)
    shapes = ((3072, 1536), (1536, 3072))
    found = []
    with torch_threads(threads):
        tensors = {
            name: [
                BlockTensor("w", number, random_blocks(generator, number, *shape))
                for shape in shapes
            ]
            for name, number in BLOCK_TYPES.items()
        }
        weights = {
            name: [BlockWeight(kernel, (tensor,)) for tensor in stored]
            for name, stored in tensors.items()
        }
        for rows in row_counts:
            inputs = [torch.randn(rows, shape[1]) for shape in shapes]
            calls = max(2, 40 // rows)
            for name in BLOCK_TYPES:
                if name == "Q4_1":
                    continue
                total = [0.0, 0.0, 0.0]
                for index, x in enumerate(inputs):
                    timed = [weights[name][index], weights["Q4_1"][index]]
                    if baseline is not None:
                        timed.append(BlockWeight(baseline, (tensors[name][index],)))
                    times: list[list[float]] = [[] for _ in timed]
                    for _ in range(5):
                        for which, weight in enumerate(timed):
                            times[which].append(best(lambda w=weight, x=x: w(x), calls))
                    for which, values in enumerate(times):
                        total[which] += min(values)
                found.append((rows, name, total[0], total[1], total[2] if baseline else None))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", nargs="+", default=["auto", "gguf"], choices=list(LABELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--batch", type=int, default=0, help="also N requests at once (0: not)")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--types", action="store_true", help="also each block type vs Q4_1")
    parser.add_argument("--type-rows", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument(
        "--baseline", type=Path, help="another gguf_blocks.c to time --types against"
    )
    args = parser.parse_args()
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}\n"
    )
    if not args.skip_decode:
        found = decode(args.forms, args.rounds, args.tokens)
        base = statistics.median(found[args.forms[0]])
        print(f"| weights | TPOT median (ms) | min | max | vs {args.forms[0]} |")
        print("|---|---|---|---|---|")
        for form, values in found.items():
            median = statistics.median(values)
            print(
                f"| {LABELS[form]} | {1e3 * median:.1f} | {1e3 * min(values):.1f} | "
                f"{1e3 * max(values):.1f} | {base / median:.2f}x |"
            )
        print()
    if args.batch:
        rates = batch(args.forms, args.rounds, args.tokens, args.batch)
        base = statistics.median(rates[args.forms[0]])
        print(f"{args.batch} requests at once, {args.tokens} tokens each: output tokens/s")
        print(f"| weights | median | min | max | vs {args.forms[0]} |")
        print("|---|---|---|---|---|")
        for form, values in rates.items():
            median = statistics.median(values)
            print(
                f"| {LABELS[form]} | {median:.1f} | {min(values):.1f} | {max(values):.1f} | "
                f"{median / base:.2f}x |"
            )
        print()
    for threads in () if args.skip_kernels else (1, 2):
        print(f"kernels, {threads} thread(s): time per call (us); speed-up of the blocks")
        print("| rows | part | blocks | float32 F.linear | fp16 fbgemm | vs float32 | vs fp16 |")
        print("|---|---|---|---|---|---|---|")
        for rows, part, blocks, dense, half in kernels(threads):
            print(
                f"| {rows} | {part} | {1e6 * blocks:.0f} | {1e6 * dense:.0f} | "
                f"{1e6 * half:.0f} | {dense / blocks:.2f}x | {half / blocks:.2f}x |"
            )
        print()
    if args.types:
        baseline = None if args.baseline is None else build_blocks(source=args.baseline)
        print("block types, 1 thread: time per call (us), 3072x1536 + 1536x3072")
        print("| rows | type | its blocks | Q4_1's | vs Q4_1 (time) | baseline's | speed-up |")
        print("|---|---|---|---|---|---|---|")
        for rows, name, mine, theirs, before in types(1, args.type_rows, baseline):
            against = "| - | -"
            if before is not None:
                against = f"| {1e6 * before:.0f} | {before / mine:.2f}x"
            print(
                f"| {rows} | {name} | {1e6 * mine:.0f} | {1e6 * theirs:.0f} | "
                f"{mine / theirs:.2f}x {against} |"
            )
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
