"""Digests of the decoder's logits on every kernel path and weight form, to compare two trees.

Not a test: run it by hand, before and after a change that must not change any bit of any
path (a refactor), on the same machine and personality, and compare the two outputs::

    python scripts/logit_digests.py > before.txt
    (change the code)
    python scripts/logit_digests.py > after.txt
    diff before.txt after.txt

Logits differ between CPUs (their kernels sum in other orders), so the digests are not
constants to pin in a test: only two runs on one machine are comparable. Each line is a
model, a weight form (dtype, whether transformers' exact arithmetic is asked for, the
weight precision), an attention kernel and a chunk size, then the SHA-256 of every logit's
bytes. One torch thread, so a team's split of a reduction cannot differ between runs.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.engine.models

from tests.engine.models.test_llama import make_tiny_model, random_sequences
from twostroke.engine.checkpoints.loader import load_model

CPU = torch.device("cpu")

#: (dtype, exact, quantization): every weight form the loader makes on a CPU.
FORMS: list[tuple[torch.dtype, bool, str | None]] = [
    (torch.float32, True, None),
    (torch.float32, False, None),
    (torch.float32, False, "fp16"),
    (torch.float32, False, "int8"),
    (torch.bfloat16, True, None),
    (torch.bfloat16, False, None),
]
KERNELS = ("native", "bag", "matmul", "sdpa")


def digests(source: str | Path, sequences: list[list[int]], label: str) -> list[str]:
    lines = []
    for dtype, exact, quantization in FORMS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16 / int8 unavailable, emulated bf16
            loaded = load_model(
                source,
                dtype=dtype,
                device=CPU,
                exact=exact,
                quantization=quantization,  # type: ignore[arg-type]
            )
        form = f"{str(dtype).removeprefix('torch.')} exact={exact} weights={loaded.quantization}"
        for kernel in KERNELS:
            for chunk in (None, 3):
                try:
                    logits = loaded.module.forward_logits(
                        sequences, chunk_size=chunk, kernel=kernel
                    )  # type: ignore[arg-type]
                except ValueError as error:  # a kernel that does not run here
                    lines.append(f"{label} | {form} | {kernel} | chunk={chunk} | {error}")
                    continue
                digest = hashlib.sha256()
                for part in logits:
                    digest.update(part.contiguous().numpy().tobytes())
                lines.append(
                    f"{label} | {form} | {kernel} | chunk={chunk} | {digest.hexdigest()[:24]}"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-smollm2", action="store_true", help="the tiny models only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        for kind, tied in (("llama", True), ("qwen2", False)):
            path = Path(folder) / kind
            make_tiny_model(kind, path, seed=5, tie_word_embeddings=tied)
            lines += digests(path, random_sequences([5, 17, 1], seed=3), f"tiny {kind}")
    if not args.no_smollm2:
        prompts: Any = [[1, 504, 3458, 314, 260, 2987, 30], [28, 4, 99, 1010, 22, 7, 19, 30, 2]]
        lines += digests("smollm2", prompts, "smollm2")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
