"""JSON-schema coverage, compile time and compliance on a JSONSchemaBench sample.

Not a test (tests/engine/structured/test_coverage.py pins the policy on the same sample): the
measurement behind the coverage table of docs/structured-output.md. For each schema of the
sample (by default the 210 of ``../shared/data/jsonschemabench/``: public, from
guidance-ai/jsonschemabench; its README says where each comes from), in the engine's own
path (``JsonSchema`` then ``GrammarCompiler.compile_now``, the format and the limits of every
request):

* **coverage**: the schema compiles (``JsonSchema`` takes it and the backend does not refuse
  it); a refusal is counted under its reason, cut to its first words;
* **compile time**: ``CompiledConstraint.seconds``, from the schema to a matcher whose first
  mask is computed, p50 and p95 over the schemas that compile, in ms;
* **compliance of the shipped instances**: each valid instance, written as every output is
  written (``", "``, ``": "``, keys in the order the schema gives them: the backend fixes it,
  any order validates; a number of integral value as an integer, the same number to JSON
  Schema), fed byte by byte through a fresh matcher: accepted when every byte is
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

``--data DIR`` measures another sample of the same layout; ``--draw GIT_DIR --data DIR``
first draws one (:func:`draw_sample`: ``--per-subset`` schemas of each of JSONSchemaBench's
ten subsets, seeded by ``--seed``, none of the shared sample's) from a clone of
guidance-ai/jsonschemabench: ``../shared/data/jsonschemabench-fresh/`` is ``--per-subset 40
--seed 53``.

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
import subprocess
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
from twostroke.engine.structured.schemas import ignores_ref_siblings, ref_target
from twostroke.states.constraints import JsonSchema
from twostroke.states.errors import ConstraintRejected

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "jsonschemabench"
#: Bytes a random walk favours (so that strings close and containers end).
STRUCTURAL = tuple(b'"}],0')


#: JSONSchemaBench's ten subsets (the paper's table 1), as its ``maskbench/data`` names them.
SUBSETS = (
    *("Glaiveai2K", "Github_trivial", "Github_easy", "Github_medium", "Github_hard"),
    *("Github_ultra", "Snowplow", "Kubernetes", "WashingtonPost", "JsonSchemaStore"),
)
#: Instances kept a schema, of each kind (as the shared sample keeps them).
KEPT_TESTS = 3


def draw_sample(
    git_dir: Path, out: Path, per_subset: int, seed: int, exclude: Path | None = DATA
) -> dict[str, int]:
    """Draw a fresh sample from a snapshot of guidance-ai/jsonschemabench into ``out``.

    Why here: a figure on schemas the relaxations were written against says little, so the
    sample is redrawn from the benchmark itself, in the shared sample's file layout, with
    the names ``exclude`` holds left out. Reads the bare git directory that ``git clone
    --bare`` (or the ``fetch`` tool) leaves, at its ``HEAD``; every schema of a subset is a
    candidate, with instances or without.

    Args:
        git_dir: the snapshot's git directory.
        out: the folder to write into (created; files of the same name replaced).
        per_subset: schemas drawn from each of :data:`SUBSETS`, seeded, without replacement.
        seed: the draw's seed.
        exclude: a sample folder whose file names are not drawn again, or ``None``.

    Returns:
        The count drawn per subset.

    Raises:
        ValueError: ``per_subset`` is below 1, or a subset holds fewer candidates than that.
    """
    if per_subset < 1:
        raise ValueError(f"per_subset must be >= 1, got {per_subset}")
    git = ["git", f"--git-dir={git_dir}"]
    listing = subprocess.run(
        [*git, "ls-tree", "-r", "HEAD", "maskbench/data/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    commit = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    seen = {path.stem for path in exclude.glob("*.json")} if exclude is not None else set()
    blobs: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        name = Path(path).stem
        subset = name.split("---")[0]
        if subset in SUBSETS and "---" in name and name not in seen:
            blobs[subset].append((name, meta.split()[2]))
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    drawn = {}
    for subset in SUBSETS:
        candidates = sorted(blobs[subset])
        if len(candidates) < per_subset:
            raise ValueError(
                f"per_subset must be <= the {len(candidates)} fresh schemas of {subset}, "
                f"got {per_subset}"
            )
        for name, blob in rng.sample(candidates, per_subset):
            entry = json.loads(
                subprocess.run(
                    [*git, "cat-file", "blob", blob], check=True, capture_output=True
                ).stdout
            )
            tests = entry.get("tests", [])
            kept = [test for test in tests if test["valid"]][:KEPT_TESTS]
            kept += [test for test in tests if not test["valid"]][:KEPT_TESTS]
            record = {
                "source": f"guidance-ai/jsonschemabench@{commit[:12]}:maskbench/data/{name}.json",
                "subset": subset,
                "features": entry.get("meta", {}).get("features", []),
                "schema": entry["schema"],
                "tests": [{"valid": test["valid"], "data": test["data"]} for test in kept],
            }
            (out / f"{name}.json").write_text(
                json.dumps(record, ensure_ascii=False, separators=(",", ":")), encoding="utf-8"
            )
        drawn[subset] = per_subset
    return drawn


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
        if ignores_ref_siblings(root):  # before 2019-09 the keys beside a $ref are ignored
            merged = {}
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


def _subschema(schema: Any, root: Any, key: str, value: dict[str, Any]) -> Any:
    """The schema the value of ``key`` takes (properties, patternProperties, additional), in
    ``allOf`` and in the branches of ``anyOf``/``oneOf`` that the object ``value`` validates
    against."""
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
            if keyword != "allOf" and not _valid(value, branch, root):
                continue
            sub = _subschema(branch, root, key, value)
            if sub is not True:
                return sub
    return schema.get("additionalProperties", True)


def _array_branch(schema: Any, root: Any, value: list[Any]) -> Any:
    """The (sub)schema that gives an array's items: ``schema`` itself where it names them,
    else the branch of ``allOf`` that does or of ``anyOf``/``oneOf`` that ``value`` validates
    against (the backend writes the items as that branch says)."""
    for _ in range(32):
        schema = _resolve(schema, root)
        if not isinstance(schema, dict) or "items" in schema or "prefixItems" in schema:
            return schema
        branches = [
            branch
            for keyword in ("allOf", "anyOf", "oneOf")
            for branch in schema.get(keyword, [])
            if keyword == "allOf" or _valid(value, branch, root)
        ]
        named = [
            branch
            for branch in branches
            if isinstance(resolved := _resolve(branch, root), dict)
            and (
                "items" in resolved
                or "prefixItems" in resolved
                or "anyOf" in resolved
                or "oneOf" in resolved
                or "allOf" in resolved
            )
        ]
        if not named:
            return schema
        schema = named[0]
    return schema


def in_schema_order(value: Any, schema: Any, root: Any) -> Any:
    """``value`` with each object's keys in the order the backend writes them."""
    schema = _resolve(schema, root)
    if isinstance(value, dict):
        order: list[str] = []
        _key_order(schema, root, value, order, "properties")
        _key_order(schema, root, value, order, "required")
        keys = order + [key for key in value if key not in order]
        return {
            key: in_schema_order(value[key], _subschema(schema, root, key, value), root)
            for key in keys
        }
    if isinstance(value, list):
        schema = _array_branch(schema, root, value)
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


def integral(value: Any) -> Any:
    """``value`` with each float of integral value written as an integer (``6000.0`` as
    ``6000``): the same number to JSON Schema, and the spelling the backend's grammar takes
    where ``multipleOf`` is an integer (one valid instance of the fresh sample spells it
    ``6000.0``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [integral(item) for item in value]
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
            # Invalid ones as given: under draft 4 an integral float is no integer.
            data = integral(test["data"]) if test["valid"] else test["data"]
            ordered = in_schema_order(data, schema, schema)
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
    parser.add_argument(
        "--draw",
        type=Path,
        metavar="GIT_DIR",
        help="first draw a fresh sample into --data from this jsonschemabench git snapshot",
    )
    parser.add_argument("--per-subset", type=int, default=40, help="schemas drawn a subset")
    args = parser.parse_args(argv)
    if args.draw is not None:
        if args.data.resolve() == DATA.resolve():
            parser.error("--draw writes into --data: name a folder other than the shared sample")
        drawn = draw_sample(args.draw, args.data, args.per_subset, args.seed)
        print(json.dumps({"drawn": drawn, "into": str(args.data)}))
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
