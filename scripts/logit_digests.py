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
from twostroke.engine.models.loading import open_model
from twostroke.states.errors import EngineError

CPU = torch.device("cpu")

#: (dtype, exact, quantization, deterministic): every weight form the loader makes on a CPU
#: (a form that does not load for a model, the GGUF blocks of a directory, prints its error).
FORMS: list[tuple[torch.dtype, bool, str | None, bool | None]] = [
    (torch.float32, True, None, None),
    (torch.float32, False, None, None),
    (torch.float32, False, "fp16", None),
    (torch.float32, False, "int8", None),
    (torch.float32, False, "auto", None),
    (torch.float32, False, "auto", True),
    (torch.float32, False, "gguf", None),
    (torch.float32, False, "gguf_f32", None),
    (torch.float32, False, "gguf", True),
    (torch.float32, False, "q8_0", None),
    (torch.float32, False, "q4_0", None),
    (torch.bfloat16, True, None, None),
    (torch.bfloat16, False, None, None),
    (torch.bfloat16, False, None, True),
]
KERNELS = ("native", "bag", "matmul", "sdpa")


def _load(
    source: str | Path,
    dtype: torch.dtype,
    exact: bool,
    quantization: str | None,
    deterministic: bool | None,
) -> tuple[Any, str | None]:
    """The loaded model and the name of its weights' form."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 / int8 unavailable, emulated bf16
        loaded = open_model(
            source,
            dtype=dtype,
            device=CPU,
            exact=exact,
            quantization=quantization,  # type: ignore[arg-type]
            deterministic=deterministic,
        )
    return loaded, loaded.quantization


def digests(source: str | Path, sequences: list[list[int]], label: str) -> list[str]:
    lines = []
    for dtype, exact, quantization, deterministic in FORMS:
        asked = f"{str(dtype).removeprefix('torch.')} exact={exact} {quantization} {deterministic}"
        try:
            loaded, weights = _load(source, dtype, exact, quantization, deterministic)
        except (ValueError, EngineError) as error:  # a form this model does not load in
            lines.append(f"{label} | {asked} | {type(error).__name__}: {error}")
            continue
        form = f"{asked} weights={weights}"
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
