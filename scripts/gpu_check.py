"""The prepared GPU check's measurements (run by scripts/gpu_check.sh; see docs/performance.md).

Four parts, each recorded in one JSON file whatever the others do:

1. ``cuda_tests``: the tests marked ``cuda`` (``pytest -m cuda``), with their counts.
2. ``parity``: twostroke's greedy tokens on the device against transformers reading the same
   weights, by teacher forcing (one transformers forward over prompt + our tokens, whose
   argmax at every position must be our next token), in float32. A mismatch where
   transformers' top two logits are within ``NEAR_TIE`` is counted apart: kernels that sum
   in another order may flip a near tie.
3. ``engine``: the engine at pipeline depth 1 and 2 on the device, one offline batch each
   (after a warm-up), with its ``forward_idle_seconds`` and how many times the bookkeeping
   stroke polled a completion's event.
4. ``bench``: a short ``twostroke bench --device`` run of twostroke's systems; its
   ``bench.json`` is included.

``--dry-run`` runs the same code on the CPU with a tiny random model and skips the bench
(its command is recorded): ``make test`` runs it (tests/test_gpu_check.py), so the script
cannot rot while no GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch

from twostroke.engine import Engine, SamplingParams
from twostroke.engine.models.loading import LoadedModel, open_model
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.text.tokenizer import HFTokenizer, Tokenizer
from twostroke.gpu.completion import Completion, Launched
from twostroke.gpu.device import CpuDevice, CudaDevice, Device

ROOT = Path(__file__).resolve().parent.parent
#: A mismatch where transformers' top two logits are closer than this is a near tie.
NEAR_TIE = 1e-3
PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "Water boils at",
    "Write a haiku about the sea:",
]


def _counting(device: Device) -> tuple[Device, list[Completion[Any]]]:
    """``device``, recording every completion the engine hands it (to count their polls)."""
    seen: list[Completion[Any]] = []
    base = type(device)

    class Counting(base):  # type: ignore[valid-type, misc]
        async def run(self, work: Callable[[], Launched[Any]], completion: Completion[Any]) -> None:
            seen.append(completion)
            await super().run(work, completion)

    device.__class__ = Counting
    return device, seen


def new_device(kind: str) -> Device:
    return CudaDevice(0) if kind == "cuda" else CpuDevice()


# --- 1. the CUDA-marked tests ----------------------------------------------------------------


def cuda_tests(out_dir: Path) -> dict[str, Any]:
    report = out_dir / "cuda-tests.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        "tests/gpu/test_cuda.py",
        "tests/engine/test_cuda.py",
    ]
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    result: dict[str, Any] = {
        "command": " ".join(command[1:]),
        "returncode": done.returncode,
        "seconds": round(time.perf_counter() - began, 1),
        "tail": done.stdout.strip().splitlines()[-12:],
    }
    if report.exists():
        import xml.etree.ElementTree as ElementTree

        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        result |= {
            key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")
        }
    return result


# --- 2. greedy parity with transformers ------------------------------------------------------


def _tiny_model(folder: Path) -> tuple[Any, Path]:
    """A tiny random grouped-query Llama saved by transformers (the dry run's model)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model, folder


def _transformers_smollm2(loaded: LoadedModel) -> Any:
    """transformers' model from the same GGUF twostroke loaded, in float32."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = loaded.source
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=reference)
    reference.load_state_dict(state["tensors"], strict=False)
    reference.tie_weights()
    return reference.eval()


def _tokenizer(model: str, loaded: LoadedModel) -> Tokenizer:
    """The byte tokenizer for the tiny model (257 ids: bytes and EOS), else the model's."""
    if model == "tiny":
        return ByteTokenizer()
    return HFTokenizer.from_pretrained(loaded.source)


def _prompt_ids(model: str, tokenizer: Tokenizer) -> list[list[int]]:
    if model == "tiny":
        generator = torch.Generator().manual_seed(1)
        return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (3, 9, 17, 30)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def parity(model: str, device_kind: str, work: Path, max_tokens: int) -> dict[str, Any]:
    began = time.perf_counter()
    device = new_device(device_kind)
    torch_device = device.torch_device
    if model == "tiny":
        reference, source = _tiny_model(work / "tiny")
        loaded = open_model(source, dtype=torch.float32, device=torch_device)
    else:
        loaded = open_model(model, dtype=torch.float32, device=torch_device)
        reference = _transformers_smollm2(loaded)
    reference = reference.to(torch_device)
    tokenizer = _tokenizer(model, loaded)
    prompts = _prompt_ids(model, tokenizer)
    runner = TorchModelRunner.from_loaded(loaded, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def serve() -> list[list[int]]:
        async with Engine.open(
            runner=runner,
            tokenizer=tokenizer,
            device=device,
            num_blocks=256,
            block_size=16,
        ) as engine:
            results: dict[int, list[int]] = {}
            async with anyio.create_task_group() as task_group:

                async def one(index: int) -> None:
                    output = await engine.generate(prompts[index], params)
                    results[index] = list(output.token_ids)

                for index in range(len(prompts)):
                    task_group.start_soon(one, index)
            return [results[index] for index in range(len(prompts))]

    ours = anyio.run(serve)
    mismatches = near_ties = 0
    for prompt, tokens in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt + tokens], device=torch_device)
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()
        top2 = logits.topk(2, dim=-1)
        for position, token in enumerate(tokens):
            if int(top2.indices[position, 0]) != token:
                margin = float(top2.values[position, 0] - logits[position, token])
                if margin < NEAR_TIE:
                    near_ties += 1
                else:
                    mismatches += 1
    return {
        "model": model,
        "device": str(torch_device),
        "dtype": "float32",
        "prompts": len(prompts),
        "tokens_each": max_tokens,
        "mismatches": mismatches,
        "near_tie_mismatches": near_ties,
        "passed": mismatches == 0,
        "seconds": round(time.perf_counter() - began, 1),
    }


# --- 3. the engine at depth 1 and 2 ------------------------------------------------------------


def engine_runs(
    model: str, device_kind: str, work: Path, num_requests: int, max_tokens: int
) -> dict[str, Any]:
    torch_device = new_device(device_kind).torch_device
    if model == "tiny":
        _, source = _tiny_model(work / "tiny-engine")
        loaded = open_model(source, dtype=torch.float32, device=torch_device)
        dtype = "float32"
    else:
        dtype = "bfloat16" if device_kind == "cuda" else "float32"
        loaded = open_model(model, dtype=getattr(torch, dtype), device=torch_device)
    tokenizer = _tokenizer(model, loaded)
    generator = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(0, 256, (int(n),), generator=generator).tolist()
        for n in torch.randint(32, 256, (num_requests,), generator=generator)
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs: dict[str, Any] = {"model": model, "device": str(torch_device), "dtype": dtype}
    for depth in (2, 1, 2):  # the first depth-2 run warms up (kernels, allocator): not kept
        device, completions = _counting(new_device(device_kind))
        runner = TorchModelRunner.from_loaded(loaded, max_num_seqs=num_requests, seed=0)

        async def serve(
            runner: TorchModelRunner = runner, device: Device = device, depth: int = depth
        ) -> tuple[Any, float]:
            async with Engine.open(
                runner=runner,
                tokenizer=tokenizer,
                device=device,
                pipeline_depth=depth,
                num_blocks=64 * num_requests,
                block_size=16,
                max_num_seqs=num_requests,
            ) as engine:
                began = time.perf_counter()
                async with anyio.create_task_group() as task_group:
                    for prompt in prompts:
                        task_group.start_soon(engine.generate, prompt, params)
                wall = time.perf_counter() - began
                return engine.statistics(), wall

        stats, wall = anyio.run(serve)
        polls = [completion.statistics().polls for completion in completions]
        runs[f"depth{depth}"] = {
            "wall_seconds": round(wall, 3),
            "output_tokens_per_second": round(stats.num_tokens_generated / wall, 1),
            "steps": stats.num_steps,
            "forward_seconds": round(stats.forward_seconds, 4),
            "forward_idle_seconds": round(stats.forward_idle_seconds, 4),
            "bookkeeping_seconds": round(stats.bookkeeping_seconds, 4),
            "completion_polls": sum(polls),
            "completion_polls_per_step": round(sum(polls) / max(len(polls), 1), 2),
        }
    runs["requests"] = num_requests
    runs["max_tokens"] = max_tokens
    return runs


# --- 4. the bench ------------------------------------------------------------------------------


def bench(device_kind: str, out_dir: Path, *, dry_run: bool) -> dict[str, Any]:
    folder = out_dir / "bench"
    command = [
        sys.executable,
        "-m",
        "twostroke.engine.cli",
        "bench",
        "--device",
        device_kind,
        "--dtype",
        "bfloat16" if device_kind == "cuda" else "float32",
        "--systems",
        "twostroke-depth2,twostroke-depth1",
        "--num-requests",
        "32",
        "--prompt-len",
        "32",
        "256",
        "--output-len",
        "32",
        "128",
        "--no-progress",
        "--out",
        str(folder),
    ]
    shown = " ".join(["twostroke", *command[3:]])
    if dry_run:
        return {"command": shown, "skipped": "dry run"}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    result: dict[str, Any] = {
        "command": shown,
        "returncode": done.returncode,
        "seconds": round(time.perf_counter() - began, 1),
        "tail": (done.stdout + done.stderr).strip().splitlines()[-20:],
    }
    report = folder / "bench.json"
    if report.exists():
        result["report"] = json.loads(report.read_text())
    return result


# --- the whole check ---------------------------------------------------------------------------


def _machine(device_kind: str) -> dict[str, Any]:
    machine: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }
    if device_kind == "cuda" and torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
        machine["gpus"] = torch.cuda.device_count()
    return machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file the figures go to")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, no bench")
    parser.add_argument("--model", default=None, help="default: smollm2 (tiny on a dry run)")
    args = parser.parse_args(argv)
    device_kind = "cpu" if args.dry_run else "cuda"
    model = args.model or ("tiny" if args.dry_run else "smollm2")
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {
        "dry_run": args.dry_run,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": _machine(device_kind),
    }
    if device_kind == "cuda" and not torch.cuda.is_available():
        figures["error"] = "torch.cuda.is_available() is False: use --dry-run on a CPU"
        out.write_text(json.dumps(figures, indent=1))
        print(figures["error"], file=sys.stderr)
        return 2
    small = args.dry_run
    parts: list[tuple[str, Callable[[Path], dict[str, Any]]]] = [
        ("cuda_tests", lambda work: cuda_tests(out.parent)),
        ("parity", lambda work: parity(model, device_kind, work, 8 if small else 32)),
        (
            "engine",
            lambda work: engine_runs(
                model, device_kind, work, 4 if small else 32, 8 if small else 128
            ),
        ),
        ("bench", lambda work: bench(device_kind, out.parent, dry_run=args.dry_run)),
    ]
    failed = False
    with tempfile.TemporaryDirectory(prefix="twostroke-gpu-check-") as work:
        for name, part in parts:
            print(f"gpu check: {name} ...", flush=True)
            try:
                figures[name] = part(Path(work))
            except Exception as exc:  # each part is recorded, whatever the others do
                figures[name] = {"error": repr(exc)}
            result = figures[name]
            failed |= bool(
                "error" in result or result.get("returncode") or result.get("passed") is False
            )
            out.write_text(json.dumps(figures, indent=1))
    figures["passed"] = not failed
    out.write_text(json.dumps(figures, indent=1))
    print(json.dumps({k: v for k, v in figures.items() if k != "bench"}, indent=1))
    print(f"gpu check: figures in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
