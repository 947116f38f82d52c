"""JSON-schema coverage on the shared JSONSchemaBench sample (../shared/data/jsonschemabench):
what compiles, and that every refusal is one docs/structured-output.md lists.

The figure is not pinned as a count of this machine: each schema either compiles or is
refused for a documented reason that the schema really gives (a keyword it holds, its
size), and the share that compiles must reach the issue's target. The one schema that takes
seconds to compile is left to scripts/structured_coverage.py and counted as not compiled.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from twostroke.engine.structured import GrammarCompiler
from twostroke.engine.structured.schemas import subschemas
from twostroke.states.constraints import MAX_SCHEMA_LENGTH, JsonSchema
from twostroke.states.errors import ConstraintRejected

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "jsonschemabench"
#: The share of the sample that must compile (issue 53's target).
TARGET = 0.97
#: Keywords llguidance neither enforces nor leaves to a check, refused naming them
#: (docs/structured-output.md, "What the backend refuses").
REFUSED_KEYWORDS = frozenset({"$dynamicRef", "$recursiveRef"})
#: Compact JSON past this many characters compiles in seconds here: left to the script.
SLOW = 65_536

pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"no shared sample at {DATA}")


def _keywords(schema: Any) -> set[str]:
    """Every keyword of every subschema."""
    found: set[str] = set()
    stack = [schema] if isinstance(schema, dict) else []
    while stack:
        node = stack.pop()
        found.update(node)
        stack.extend(sub for _, sub in subschemas(node))
    return found


def _justified(reason: str, schema: dict[str, Any], text: str) -> bool:
    """Whether a refusal is one the docs list, and the schema gives its cause."""
    if reason.startswith(f"schema must be <= {MAX_SCHEMA_LENGTH} characters"):
        return len(text) > MAX_SCHEMA_LENGTH
    unimplemented = re.fullmatch(r"Unimplemented keys: \[(.*)\]", reason)
    if unimplemented:
        keys = set(json.loads(f"[{unimplemented[1]}]"))
        return keys <= REFUSED_KEYWORDS and keys <= _keywords(schema)
    return False


def test_the_shared_sample_compiles_but_for_documented_refusals(
    byte_compiler: GrammarCompiler,
) -> None:
    paths = sorted(DATA.glob("*.json"))
    assert len(paths) >= 200
    compiled, unexplained = 0, []
    for path in paths:
        schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if MAX_SCHEMA_LENGTH >= len(text) > SLOW:
            continue
        try:
            byte_compiler.compile_now(JsonSchema(schema))
        except ConstraintRejected as exc:
            reason = exc.reason
        except ValueError as exc:  # JsonSchema's own limits
            reason = str(exc)
        else:
            compiled += 1
            continue
        if not _justified(reason, schema, text):
            unexplained.append(f"{path.stem}: {reason}")
    assert unexplained == []
    assert compiled / len(paths) >= TARGET, f"{compiled}/{len(paths)}"


def _coverage_script() -> Any:
    path = Path(__file__).resolve().parents[3] / "scripts" / "structured_coverage.py"
    spec = importlib.util.spec_from_file_location("structured_coverage", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The fresh sample (issue 53), drawn by ``structured_coverage.py --draw``: 40 schemas from
#: each of JSONSchemaBench's ten subsets, none of the shared sample's.
FRESH = DATA.parent / "jsonschemabench-fresh"


@pytest.mark.parametrize(
    ("folder", "at_least"),
    [
        pytest.param(DATA, 280, id="shared"),
        pytest.param(
            FRESH,
            500,
            id="fresh",
            marks=pytest.mark.skipif(not FRESH.is_dir(), reason=f"no fresh sample at {FRESH}"),
        ),
    ],
)
def test_every_valid_instance_of_the_sample_is_accepted(
    byte_compiler: GrammarCompiler, folder: Path, at_least: int
) -> None:
    """Each shipped valid instance, written as outputs are, goes through its compiled
    constraint byte by byte (no rewrite may refuse what the schema admits); no invalid one
    both goes through and passes the check. About 3 s here for the shared sample, 8 s for
    the fresh one."""
    script = _coverage_script()
    refused, admitted, valid = [], [], 0
    for entry in script.load_sample(folder):
        schema = entry["schema"]
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if len(text) > SLOW:
            continue
        try:
            compiled = byte_compiler.compile_now(JsonSchema(schema))
        except (ConstraintRejected, ValueError):
            continue
        for test in entry["tests"]:
            data = script.integral(test["data"]) if test["valid"] else test["data"]
            ordered = script.in_schema_order(data, schema, schema)
            tokens = list(json.dumps(ordered, ensure_ascii=False).encode())
            accepted = script.accepts(compiled, tokens)
            if test["valid"]:
                valid += 1
                if not accepted:
                    refused.append(f"{entry['name']}: {test['data']!r}"[:200])
            elif accepted:
                admitted.append(f"{entry['name']}: {test['data']!r}"[:200])
    assert refused == []
    assert admitted == []
    assert valid >= at_least
