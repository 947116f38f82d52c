"""JSON-schema coverage, compile time and compliance on the shared JSONSchemaBench sample.

Not a test (tests/engine/structured/test_coverage.py pins the policy on the same sample): the
measurement behind the coverage table of docs/structured-output.md. For each of the 210
schemas of ``../shared/data/jsonschemabench/`` (public, from guidance-ai/jsonschemabench; its
README says where each comes from), in the engine's own path (``JsonSchema`` then
``GrammarCompiler.compile_now``, the format and the limits of every request):

* **coverage**: the schema compiles (``JsonSchema`` takes it and the backend does not refuse
  it); a refusal is counted under its reason, cut to its first words;
* **compile time**: ``CompiledConstraint.seconds``, from the schema to a matcher whose first
  mask is computed, p50 and p95 over the schemas that compile, in ms;
* **compliance of the shipped instances**: each valid instance, written as every output is
  written (``", "``, ``": "``, keys in the order the schema gives them: the backend fixes it,
  any order validates), fed byte by byte through a fresh matcher: accepted when every byte is
  taken and the matcher is accepting at the end. Invalid instances that are accepted are
  counted apart (they must be none: a grammar wider than the schema would let outputs that
  do not validate through);
* **outputs**: ``--samples`` random walks per compiled schema, each byte picked at random
  among those the mask allows (structural bytes favoured, so that walks end), validated with
  ``jsonschema`` against the schema as it was given; walks that reach ``--max-bytes`` are
  counted as unfinished, not judged; walks the matcher's check after generation refused
  (``oneOf``, ``uniqueItems``: a request's ``ConstraintFailed``) and walks where the backend
  gave up (a limit) are counted apart;
* **per keyword** (``by_keyword``): for each keyword the engine relaxes or leaves to the
  check (``if``, ``not``, ``oneOf`` ...), the schemas that hold it, their random outputs
  that finished or that the check refused, and how many refusals named it: how often a
  relaxation lets the toy's random output through to a check that fails.

The vocabulary is the toy runner's bytes (257 tokens): what the constraint allows does not
depend on it, and it needs no model. ``--tokenizer smollm2`` compiles against SmolLM2's 49,152
tokens instead (the first mask costs more there), for the compile times and the instances
(tokenized by SmolLM2); it walks no random outputs.

Run: ``.venv/bin/python scripts/structured_coverage.py [--samples 3] [--json out.json]``. The
figures come with the CPU capability and the 1-minute load average: the development machines
are shared; compare figures of one run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jsonschema
import torch

from twostroke.engine.errors import MatcherError
from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.structured import GrammarCompiler, GuidanceMatcher, Vocabulary
from twostroke.engine.structured.schemas import ref_target
from twostroke.states.constraints import JsonSchema
from twostroke.states.errors import ConstraintRejected

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "jsonschemabench"
#: Bytes a random walk favours (so that strings close and containers end).
STRUCTURAL = tuple(b'"}],0')


def load_sample(folder: Path = DATA) -> list[dict[str, Any]]:
    """The sample's files, sorted by name, each with its ``name``."""
    entries = []
    for path in sorted(folder.glob("*.json")):
        entry = json.loads(path.read_text(encoding="utf-8"))
        entry["name"] = path.stem
        entries.append(entry)
    return entries


def _resolve(schema: Any, root: Any) -> Any:
    """Follow local ``$ref`` s (``#/...``) until a schema without one, at most 32 times."""
    for _ in range(32):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return schema
        target = ref_target(root, ref)
        if target is None:
            return schema
        merged = {key: value for key, value in schema.items() if key != "$ref"}
        schema = {**target, **merged} if isinstance(target, dict) else target
    return schema


def _key_order(
    schema: Any, root: Any, value: dict[str, Any], order: list[str], keyword: str
) -> None:
    """The keys of ``keyword`` (``properties``, then ``required``) in the order the backend
    writes them: it reads the schema's keywords in order, the branches of ``allOf`` and, of
    ``anyOf``/``oneOf``, the first that the value validates against, where they stand."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return
    for name, part in schema.items():
        if name == keyword:
            order.extend(key for key in part if key in value and key not in order)
        elif name == "allOf":
            for branch in part:
                _key_order(branch, root, value, order, keyword)
        elif name in ("anyOf", "oneOf"):
            for branch in part:
                if _valid(value, branch, root):
                    _key_order(branch, root, value, order, keyword)
                    break


def _valid(value: Any, schema: Any, root: Any) -> bool:
    if isinstance(schema, dict) and isinstance(root, dict):
        schema = {**schema, "$defs": root.get("$defs", {})}
        schema.setdefault("definitions", root.get("definitions", {}))
    try:
        cls = jsonschema.validators.validator_for(root if isinstance(root, dict) else {})
        return bool(cls(schema).is_valid(value))
    except Exception:
        return False


def _subschema(schema: Any, root: Any, key: str) -> Any:
    """The schema the value of ``key`` takes (properties, patternProperties, additional)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return True
    properties = schema.get("properties", {})
    if key in properties:
        return properties[key]
    for pattern, sub in schema.get("patternProperties", {}).items():
        try:
            if re.search(pattern, key):
                return sub
        except re.error:
            continue
    for keyword in ("allOf", "anyOf", "oneOf"):
        for branch in schema.get(keyword, []):
            sub = _subschema(branch, root, key)
            if sub is not True:
                return sub
    return schema.get("additionalProperties", True)


def in_schema_order(value: Any, schema: Any, root: Any) -> Any:
    """``value`` with each object's keys in the order the backend writes them."""
    schema = _resolve(schema, root)
    if isinstance(value, dict):
        order: list[str] = []
        _key_order(schema, root, value, order, "properties")
        _key_order(schema, root, value, order, "required")
        keys = order + [key for key in value if key not in order]
        return {
            key: in_schema_order(value[key], _subschema(schema, root, key), root) for key in keys
        }
    if isinstance(value, list):
        items: list[Any] = []
        prefix = schema.get("prefixItems", []) if isinstance(schema, dict) else []
        rest = schema.get("items", True) if isinstance(schema, dict) else True
        if isinstance(rest, list):  # draft 4-7 tuples
            prefix, rest = rest, schema.get("additionalItems", True)
        for index, item in enumerate(value):
            sub = prefix[index] if index < len(prefix) else rest
            items.append(in_schema_order(item, sub, root))
        return items
    return value


def accepts(compiled: Any, tokens: list[int]) -> bool:
    """Whether a fresh matcher takes ``tokens`` one by one and accepts at their end."""
    matcher: GuidanceMatcher = compiled.matcher()
    try:
        return all(matcher.advance(token) for token in tokens) and matcher.accepting
    except Exception:
        return False


def random_output(compiled: Any, rng: random.Random, max_bytes: int) -> bytes | str | None:
    """A random output the constraint allows, ``None`` if it is not done in ``max_bytes``,
    or the reason the backend gave up partway (a request's ``ConstraintFailed``)."""
    try:
        return _walk(compiled, rng, max_bytes)
    except MatcherError as exc:
        return str(exc)


def _walk(compiled: Any, rng: random.Random, max_bytes: int) -> bytes | str | None:
    matcher = compiled.matcher()
    eos = min(compiled.vocabulary.eos_token_ids)
    out: list[int] = []
    while len(out) < max_bytes:
        allowed = matcher.allowed_token_ids()
        if eos in allowed and rng.random() < 0.7:
            return _bytes(compiled, out)
        if not allowed or allowed == {eos}:
            if matcher.accepting:
                return _bytes(compiled, out)
            return matcher.failure  # a dead end: the check refused the complete output
        choices = sorted(allowed - {eos})
        structural = [token for token in STRUCTURAL if token in allowed]
        token = rng.choice(structural if structural and rng.random() < 0.4 else choices)
        if not matcher.advance(token):
            raise AssertionError(f"the matcher refused byte {token} that its mask allowed")
        out.append(token)
        if matcher.terminated:  # as a request: ends with stop, or fails (a dead end)
            return _bytes(compiled, out) if matcher.accepting else matcher.failure
    return None


def _bytes(compiled: Any, tokens: list[int]) -> bytes:
    return bytes(compiled.vocabulary.backend.decode_bytes(tokens))


#: The keyword a check's refusal names (``SchemaCheck``'s reason).
_CHECKED_BY = re.compile(r"; (\S+) is checked after generation")


def by_keyword(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per relaxed or checked keyword: the schemas that hold it, their walks that finished
    or were refused by the check, and the refusals that named it."""
    table: dict[str, dict[str, int]] = {}
    for row in rows:
        for keyword in row.get("checked", []):
            counts = table.setdefault(
                keyword, {"schemas": 0, "outputs": 0, "check_failed": 0, "named": 0}
            )
            counts["schemas"] += 1
            counts["outputs"] += row["outputs"]
            counts["check_failed"] += row["check_failed"]
            counts["named"] += row["failed_by"].get(keyword, 0)
    return dict(sorted(table.items()))


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def _reason(exc: BaseException) -> str:
    reason = exc.reason if isinstance(exc, ConstraintRejected) else str(exc)
    reason = re.sub(r"\d{3,}", "N", reason)
    return reason[:90]


def measure(
    entries: list[dict[str, Any]],
    compiler: GrammarCompiler,
    encode: Callable[[str], list[int]],
    samples: int,
    max_bytes: int,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    rows = []
    for entry in entries:
        schema, row = (
            entry["schema"],
            {"name": entry["name"], "subset": entry["name"].split("---")[0]},
        )
        try:
            compiled = compiler.compile_now(JsonSchema(schema))
        except (ConstraintRejected, TypeError, ValueError) as exc:
            row["refused"] = _reason(exc)
            rows.append(row)
            continue
        row["compile_ms"] = compiled.seconds * 1e3
        texts = {True: [], False: []}  # type: dict[bool, list[str]]
        for test in entry["tests"]:
            ordered = in_schema_order(test["data"], schema, schema)
            texts[bool(test["valid"])].append(json.dumps(ordered, ensure_ascii=False))
        row["valid"] = len(texts[True])
        row["valid_accepted"] = sum(accepts(compiled, encode(text)) for text in texts[True])
        row["invalid"] = len(texts[False])
        row["invalid_accepted"] = sum(accepts(compiled, encode(text)) for text in texts[False])
        validator = jsonschema.validators.validator_for(schema)(schema)
        outputs = [random_output(compiled, rng, max_bytes) for _ in range(samples)]
        done = [out for out in outputs if isinstance(out, bytes)]
        row["outputs"] = len(done)
        row["unfinished"] = sum(out is None for out in outputs)
        failed = [out for out in outputs if isinstance(out, str)]
        row["check_failed"] = sum(out.startswith("the output does not validate") for out in failed)
        row["checked"] = sorted(compiled.check.checked) if compiled.check is not None else []
        row["failed_by"] = collections.Counter(
            found[1] for out in failed if (found := _CHECKED_BY.search(out)) is not None
        )
        row["gave_up"] = len(failed) - row["check_failed"]
        bad = [out for out in done if not validator.is_valid(json.loads(out))]
        row["outputs_invalid"] = len(bad)
        if bad:
            row["invalid_example"] = bad[0][:300].decode("utf-8", "replace")
        rows.append(row)
    return summarize(rows)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    compiled = [row for row in rows if "refused" not in row]
    times = [row["compile_ms"] for row in compiled]
    refusals = collections.Counter(row["refused"] for row in rows if "refused" in row)
    by_subset: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for row in rows:
        by_subset[row["subset"]][0] += "refused" not in row
        by_subset[row["subset"]][1] += 1
    total = lambda key: sum(row.get(key, 0) for row in compiled)  # noqa: E731
    return {
        "schemas": len(rows),
        "compiled": len(compiled),
        "coverage": len(compiled) / len(rows),
        "compile_ms_p50": statistics.median(times) if times else float("nan"),
        "compile_ms_p95": _percentile(times, 0.95),
        "compile_ms_max": max(times, default=float("nan")),
        "valid_instances": total("valid"),
        "valid_accepted": total("valid_accepted"),
        "invalid_instances": total("invalid"),
        "invalid_accepted": total("invalid_accepted"),
        "outputs": total("outputs"),
        "outputs_unfinished": total("unfinished"),
        "outputs_gave_up": total("gave_up"),
        "outputs_check_failed": total("check_failed"),
        "outputs_invalid": total("outputs_invalid"),
        "by_keyword": by_keyword(rows),
        "by_subset": {name: f"{done}/{count}" for name, (done, count) in sorted(by_subset.items())},
        "refusals": refusals.most_common(),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the sample's folder")
    parser.add_argument("--samples", type=int, default=3, help="random outputs per schema")
    parser.add_argument("--max-bytes", type=int, default=4_000, help="a random output's bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", choices=["bytes", "smollm2"], default="bytes")
    parser.add_argument("--json", help="also write every row to this file")
    parser.add_argument("--verbose", action="store_true", help="print each refusal")
    args = parser.parse_args(argv)
    if args.tokenizer == "smollm2":
        from twostroke.engine.checkpoints.source import resolve_model
        from twostroke.engine.text.tokenizer import HFTokenizer

        tokenizer: Any = HFTokenizer.from_pretrained(resolve_model("smollm2"))
        args.samples = 0  # a random walk over 49,152 tokens' sets is minutes in Python
    else:
        tokenizer = ByteTokenizer()
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    compiler = GrammarCompiler(Vocabulary.from_tokenizer(tokenizer))
    encode: Callable[[str], list[int]] = tokenizer.encode
    if args.tokenizer == "smollm2":
        encode = partial(tokenizer.backend.encode, add_special_tokens=False)
    entries = load_sample(args.data)
    figures = measure(entries, compiler, encode, args.samples, args.max_bytes, args.seed)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "tokenizer": args.tokenizer,
        "seconds": round(time.perf_counter() - start, 1),
    }
    rows = figures.pop("rows")
    summary = {key: value for key, value in figures.items() if key != "refusals"}
    print(json.dumps(machine))
    print(json.dumps(summary, indent=1, default=str))
    for reason, count in figures["refusals"]:
        print(f"{count:4d}  {reason}")
    if args.verbose:
        for row in rows:
            if "refused" in row:
                print(f"{row['name']}: {row['refused']}")
            elif (
                row.get("outputs_invalid")
                or row["valid_accepted"] < row["valid"]
                or row["invalid_accepted"]
            ):
                print(f"{row['name']}: {json.dumps({k: v for k, v in row.items() if k != 'name'})}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine, **figures, "rows": rows}, indent=1), encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
