"""Quality of each weight precision against float32 on SmolLM2 (not a test): the table of
docs/models.md.

For each weight mode, with float32 activations: ``none`` (float32 weights, MKL's products:
transformers' arithmetic, the reference), ``packed`` (float32 weights packed for oneDNN:
``dtype="auto"`` with ``quantization=None`` where auto is float32), ``fp16`` and ``int8``
(``quantization=``, the output projection in MKL's float32), ``auto`` (the engine's defaults
where ``dtype="auto"`` is float32: fp16 projections, the output projection packed),
``gguf`` (the file's blocks computed as stored, activations quantized
per block of 32), ``gguf_f32`` (the same blocks by the activations themselves) and
``gguf_f32-kv-float16`` (that, the KV cache in float16, as ``kv_cache_dtype="auto"`` takes it
for float32 activations), and ``q8_0``/``q4_0`` (the projections quantized into those blocks at
load, computed as ``gguf`` computes a file's). With
bfloat16 weights and activations: ``bfloat16`` (``dtype="bfloat16"``: oneDNN's products,
torch's operators) and ``bfloat16-auto`` (the engine's defaults where ``dtype="auto"`` is
bfloat16: the compiled projections and glue). The KV cache (``kv_cache_dtype``) is the
activations' dtype in every mode but ``gguf_f32-kv-float16``, ``kv-float16`` and
``kv-bfloat16``: the last two float32 weights and
activations as ``none``, the cache in 16 bits (read by the compiled attention, written by
torch's glue):

* greedy agreement: 20 prompts that no test uses, 128 greedy tokens each (EOS ignored, 2,560
  tokens in all) through ``LLM``, the whole engine; per prompt, the tokens that equal
  float32's before the first that differs;
* perplexity of the held-out text shipped with the tests (``tests/engine/data/heldout.txt``),
  one sequence through ``forward_logits``; and the largest logit difference from float32
  on it.

``llama.cpp`` is llama.cpp on the same GGUF file (``llama-cpp-python`` in another venv,
``--llamacpp-python``, in a child process: ``scripts/_llamacpp_perplexity.py``), with its own
defaults (a float16 KV cache): the same held-out token ids and prompt token ids, given to it
rather than re-tokenized, scored by the same code (the first position's logits predict the
second token; natural log; exp of the mean), and ``--max-tokens`` greedy tokens a prompt by
the binding (each step's argmax, EOS ignored).
``--heldout-chunk 32`` feeds the held-out text 32 tokens a step: fewer rows than
``DENSE_ROWS`` (``twostroke.engine.kernels.gguf_blocks``), so the blocks' modes compute it by
their own products, as at decode, where 256 a step takes their dense path (float32 or, with
8-bit activations on a CPU with native bfloat16, bfloat16 products). ``--model PATH`` takes
another GGUF file (or any model ``open_model`` takes, without the ``llama.cpp`` mode); the
reference is then that file dequantized.

Prints a Markdown table (and ``--json`` writes the figures). The CPU capability is printed
with it: fbgemm's kernels differ between AVX2 and AVX-512 machines.

    .venv/bin/python scripts/weight_quality.py [--modes none packed fp16 int8 auto]
        [--max-tokens 128]
    .venv/bin/python scripts/weight_quality.py --modes none bfloat16 bfloat16-auto
    .venv/bin/python scripts/weight_quality.py --modes none kv-float16 kv-bfloat16
    .venv/bin/python scripts/weight_quality.py --modes none gguf gguf_f32 gguf_f32-kv-float16
    .venv/bin/python scripts/weight_quality.py --modes none gguf gguf_f32 llama.cpp
        [--model FILE.gguf] [--llamacpp-python PY] [--heldout-chunk 32]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy
import torch

from twostroke.engine import LLM, SamplingParams
from twostroke.engine.checkpoints.source import is_gguf, resolve_model
from twostroke.engine.models.loading import open_model
from twostroke.engine.text.tokenizer import HFTokenizer
from twostroke.gpu.device import CpuDevice
from twostroke.gpu.dtype import default_dtype

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "tests" / "engine" / "data" / "heldout.txt"
LLAMACPP_CHILD = Path(__file__).resolve().parent / "_llamacpp_perplexity.py"
#: As the tests name it (``tests/engine/models/llamacpp_reference.py``).
LLAMACPP_PYTHON_ENV = "TWOSTROKE_LLAMACPP_PYTHON"

PROMPTS = (
    "The history of the printing press begins",
    "To bake a loaf of sourdough bread, you first need",
    "In a distant galaxy, a small robot named Pico",
    "The three laws of thermodynamics can be summarized as",
    "Dear hiring manager, I am writing to apply for",
    "The best way to learn a new programming language is",
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a village at the edge of a forest,",
    "The main causes of the French Revolution were",
    "Here is a short Python function that reverses a string:",
    "A healthy breakfast should include",
    "The stock market crashed in 1929 because",
    "My favourite season of the year is autumn, because",
    "Volcanoes form when",
    "The difference between a virus and a bacterium is",
    "Instructions for assembling a bookshelf: Step 1.",
    "The ocean covers more than seventy percent of",
    "If you want to improve your sleep, try",
    "The old sailor looked at the horizon and said,",
    "Machine learning models are trained by",
)


LABELS = {
    "none": 'float32 (`dtype="float32"`)',
    "packed": 'float32 packed (`dtype="auto", quantization=None`)',
    "fp16": '`quantization="fp16"`',
    "int8": '`quantization="int8"`',
    "auto": "the defaults (fp16 projections, packed output projection)",
    "gguf": 'the file\'s blocks as stored (`quantization="gguf"`)',
    "gguf_f32": 'the same blocks by float32 activations (`quantization="gguf_f32"`)',
    "gguf_f32-kv-float16": 'the same, the KV cache in float16 (`kv_cache_dtype="auto"`)',
    "q8_0": 'the projections quantized to Q8_0 at load (`quantization="q8_0"`)',
    "q4_0": 'the projections quantized to Q4_0 at load (`quantization="q4_0"`)',
    "bfloat16": 'bfloat16 (`dtype="bfloat16"`: oneDNN, torch\'s operators)',
    "bfloat16-auto": "the defaults where bfloat16 is native (compiled projections and glue)",
    "kv-float16": 'float32, the KV cache in float16 (`kv_cache_dtype="float16"`)',
    "kv-bfloat16": 'float32, the KV cache in bfloat16 (`kv_cache_dtype="bfloat16"`)',
    "llama.cpp": "llama.cpp on the same file (its defaults: float16 KV cache)",
}

F32, BF16 = torch.float32, torch.bfloat16

#: Per mode: the engine's ``dtype`` and ``quantization``, the loader's ``dtype``, ``exact``
#: and ``quantization`` that load the same weights for the held-out text, and the KV cache's
#: dtype for both (``"auto"`` with an explicit ``dtype`` is that dtype).
MODES: dict[str, tuple[Any, Any, torch.dtype, bool, Any, str]] = {
    "none": ("float32", None, F32, True, None, "auto"),
    "packed": ("auto", None, F32, False, None, "float32"),
    "fp16": ("float32", "fp16", F32, True, "fp16", "auto"),
    "int8": ("float32", "int8", F32, True, "int8", "auto"),
    "auto": ("auto", "auto", F32, False, "fp16", "float32"),
    "gguf": ("auto", "gguf", F32, False, "gguf", "float32"),
    "gguf_f32": ("auto", "gguf_f32", F32, False, "gguf_f32", "float32"),
    "gguf_f32-kv-float16": ("auto", "gguf_f32", F32, False, "gguf_f32", "float16"),
    "q8_0": ("auto", "q8_0", F32, False, "q8_0", "float32"),
    "q4_0": ("auto", "q4_0", F32, False, "q4_0", "float32"),
    "bfloat16": ("bfloat16", None, BF16, True, None, "auto"),
    "bfloat16-auto": ("auto", "auto", BF16, False, None, "auto"),
    "kv-float16": ("float32", None, F32, True, None, "float16"),
    "kv-bfloat16": ("float32", None, F32, True, None, "bfloat16"),
}


def greedy(model: str, mode: str, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts' token ids, as the engine tokenized them, and the greedy tokens of each."""
    dtype, quantization, _, _, _, cache = MODES[mode]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, dtype=dtype, quantization=quantization, kv_cache_dtype=cache) as llm:
        outputs = llm.generate(list(PROMPTS), params, progress=False)
    prompts = [list(output.prompt_token_ids) for output in outputs]
    return prompts, [list(output.token_ids) for output in outputs]


def heldout_logits(model: str, mode: str, ids: list[int], chunk: int) -> torch.Tensor:
    _, _, dtype, exact, quantization, cache = MODES[mode]
    loaded = open_model(
        model,
        dtype=dtype,
        device=torch.device("cpu"),
        exact=exact,
        quantization=quantization,
        kv_cache_dtype=None if cache == "auto" else getattr(torch, cache),
    )
    return loaded.module.forward_logits([ids], chunk_size=chunk, block_size=16)[0].float()


def llamacpp(
    python: Path, path: Path, ids: list[int], prompts: list[list[int]], max_tokens: int
) -> tuple[torch.Tensor, list[list[int]], str]:
    """llama.cpp's logits of the held-out ids, its greedy tokens for the prompts' ids and its
    version: ``scripts/_llamacpp_perplexity.py`` run by ``python`` on the GGUF file ``path``.

    Raises:
        SystemExit: the child failed; its last line of stderr says why.
    """
    job = {
        "path": str(path),
        "heldout": ids,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "threads": torch.get_num_threads(),
    }
    with tempfile.TemporaryDirectory() as folder:
        logits_file = Path(folder) / "logits.npy"
        done = subprocess.run(
            [str(python), str(LLAMACPP_CHILD), str(logits_file)],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise SystemExit(f"llama.cpp ({python}) failed on {path}: {last}")
        logits = torch.from_numpy(numpy.load(logits_file))
    result = json.loads(done.stdout)
    return logits, result["tokens"], result["version"]


def default_llamacpp_python() -> Path:
    """``$TWOSTROKE_LLAMACPP_PYTHON``, or the venv ``scripts/setup_llamacpp_peer.sh`` builds."""
    configured = os.environ.get(LLAMACPP_PYTHON_ENV)
    return Path(configured) if configured else REPO / ".venv-llamacpp" / "bin" / "python"


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    targets = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1], targets)
    return math.exp(nll.item())


def token_nll(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Each position's negative log-likelihood (natural log) of the next token, in float64."""
    targets = torch.tensor(ids[1:])
    return torch.nn.functional.cross_entropy(logits[:-1].double(), targets, reduction="none")


def departure_error(logits: torch.Tensor, reference: torch.Tensor, ids: list[int]) -> float:
    """The standard error of the mean per-token log-likelihood difference from the
    reference: how far the perplexity's departure (in log, so about a fraction of it) would
    move on another text of this length, were the tokens independent."""
    differences = token_nll(logits, ids) - token_nll(reference, ids)
    return float(differences.std() / math.sqrt(len(differences)))


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> list[int]:
    """Per prompt, the leading tokens equal to the reference's."""
    counts = []
    for ours, theirs in zip(tokens, reference, strict=True):
        same = 0
        while same < min(len(ours), len(theirs)) and ours[same] == theirs[same]:
            same += 1
        counts.append(same)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # llama.cpp is not the engine's (no entry of MODES): a row only when asked for.
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=[*MODES, "llama.cpp"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--heldout-chunk",
        type=int,
        default=256,
        help="tokens of the held-out text a forward step takes (below DENSE_ROWS, 64, the "
        "GGUF blocks compute every product block by block, as they do at decode)",
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="a model name or path open_model takes (a GGUF file for the llama.cpp mode)",
    )
    parser.add_argument(
        "--llamacpp-python",
        type=Path,
        default=default_llamacpp_python(),
        help=f"the Python llama_cpp is importable by (default ${LLAMACPP_PYTHON_ENV}, "
        "else .venv-llamacpp/bin/python)",
    )
    args = parser.parse_args()
    source = resolve_model(args.model)
    if "llama.cpp" in args.modes:
        if not is_gguf(source):
            parser.error(f"the llama.cpp mode needs a GGUF file: --model {args.model!r} is not")
        if not args.llamacpp_python.is_file():
            parser.error(
                f"the llama.cpp mode needs llama-cpp-python's interpreter: no "
                f"--llamacpp-python {str(args.llamacpp_python)!r} (build it with "
                f"scripts/setup_llamacpp_peer.sh, or set ${LLAMACPP_PYTHON_ENV})"
            )
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    native = default_dtype(CpuDevice())
    if native != torch.float32 and {"packed", "auto"} & set(args.modes):
        # (The block modes' dtype="auto" is float32 on every CPU.)
        parser.error("the packed and auto modes need a CPU where dtype='auto' is float32")
    if native != torch.bfloat16 and "bfloat16-auto" in args.modes:
        parser.error("the bfloat16-auto mode needs a CPU where dtype='auto' is bfloat16")
    loaded = open_model(args.model, dtype=torch.float32, device=torch.device("cpu"))
    ids = HFTokenizer.from_pretrained(loaded.source).encode(HELDOUT.read_text())
    del loaded
    modes = ["none", *(mode for mode in args.modes if mode != "none")]
    rows: dict[str, dict[str, Any]] = {}
    reference_tokens: list[list[int]] = []
    reference_prompts: list[list[int]] = []
    reference_logits = torch.empty(0)
    llamacpp_version = None
    for mode in modes:
        started = time.perf_counter()
        if mode == "llama.cpp":
            # The prompts' ids as the engine's float32 run tokenized them.
            logits, tokens, llamacpp_version = llamacpp(
                args.llamacpp_python, source, ids, reference_prompts, args.max_tokens
            )
        else:
            prompt_ids, tokens = greedy(args.model, mode, args.max_tokens)
            logits = heldout_logits(args.model, mode, ids, args.heldout_chunk)
        if mode == "none":
            reference_prompts, reference_tokens, reference_logits = prompt_ids, tokens, logits
        counts = agreement(reference_tokens, tokens)
        pairs = zip(counts, reference_tokens, strict=True)
        rows[mode] = {
            "perplexity": perplexity(logits, ids),
            "departure_standard_error": departure_error(logits, reference_logits, ids),
            # Per position, for paired comparisons between rows after the run.
            "token_nll": token_nll(logits, ids).tolist(),
            "max_logit_diff": float((logits - reference_logits).abs().max()),
            "agreeing_tokens": sum(counts),
            "generated_tokens": sum(len(t) for t in reference_tokens),
            "prompts_identical": sum(c == len(t) for c, t in pairs),
            "first_divergence_min": min(counts),
            "seconds": round(time.perf_counter() - started, 1),
        }
    base = rows["none"]["perplexity"]
    capability = torch.backends.cpu.get_cpu_capability()
    llamacpp_note = f", llama-cpp-python {llamacpp_version}" if llamacpp_version else ""
    print(
        f"{source.name} (the reference: dequantized to float32), activations in the weights' "
        f"dtype (float32 for fp16 and int8); "
        f"{len(PROMPTS)} prompts x {args.max_tokens} greedy tokens; held-out text "
        f"{len(ids)} tokens, {args.heldout_chunk} a step; CPU capability {capability}, "
        f"torch {torch.__version__}"
        f"{llamacpp_note}\n"
    )
    print(
        "| weights | perplexity | vs float32 (± standard error) | greedy tokens equal to float32's "
        "(before first divergence) | prompts identical | earliest divergence | "
        "max logit diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        label = LABELS[name]
        print(
            f"| {label} | {row['perplexity']:.3f} | {100 * (row['perplexity'] / base - 1):+.2f} % "
            f"(± {100 * row['departure_standard_error']:.2f}) "
            f"| {row['agreeing_tokens']} / {row['generated_tokens']} "
            f"({100 * row['agreeing_tokens'] / row['generated_tokens']:.1f} %) "
            f"| {row['prompts_identical']} / {len(PROMPTS)} | token {row['first_divergence_min']} "
            f"| {row['max_logit_diff']:.3g} |"
        )
    if args.json is not None:
        figures = {"capability": capability, "llama_cpp": llamacpp_version, "rows": rows}
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
