"""The dependency rules between and inside the three packages, proven two ways.

``states`` must import with torch, anyio and trio unavailable (run in a subprocess whose
import system refuses them), and an AST scan of every module follows every chain of imports
from it: ``states`` reaches only the standard library, attrs and itself (hypothesis in its
test-support package), ``gpu`` never ``engine`` nor ``states``, the data-parallel
coordinator never the tokenizer, detokenizer or sampler but through the modules that run a
replica's engine, and no module imports itself through others (no import cycle beyond the
known ones).
"""

from __future__ import annotations

import ast
import collections
import functools
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Collection, Mapping

import pytest

ROOT = pathlib.Path(__file__).parents[1]

BLOCKED_IMPORT = """
import importlib, importlib.abc, json, pkgutil, sys

BLOCKED = {"torch", "anyio", "trio"}


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None


sys.meta_path.insert(0, Blocker())
for name in BLOCKED:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"the blocker let {name} through")

import twostroke.states as states

names = sorted(m.name for m in pkgutil.iter_modules(states.__path__))
pure = [name for name in names if name != "testing"]
for name in pure:
    importlib.import_module(f"twostroke.states.{name}")
before_testing = sorted(sys.modules)
importlib.import_module("twostroke.states.testing")
after = sorted(sys.modules)
print(json.dumps({"modules": names, "before_testing": before_testing, "after": after}))
"""


def _top(name: str) -> str:
    return name.partition(".")[0]


def test_states_imports_without_torch_anyio_or_trio() -> None:
    # trio registers a hypothesis plugin (an entry point), which hypothesis loads when it is
    # imported; where trio is really absent, so is its entry point. Blocking trio without
    # uninstalling it needs hypothesis told to skip plugins.
    env = {**os.environ, "HYPOTHESIS_NO_PLUGINS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORT],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    expected = sorted(
        [path.stem for path in (ROOT / "states").glob("*.py") if path.stem != "__init__"]
        + ["testing"]
    )
    assert result["modules"] == expected
    for loaded in (result["before_testing"], result["after"]):
        assert not {"torch", "anyio", "trio"} & {_top(name) for name in loaded}
        assert not [
            name for name in loaded if name.startswith(("twostroke.gpu", "twostroke.engine"))
        ]
    # hypothesis comes only with the test-support modules
    assert "hypothesis" not in {_top(name) for name in result["before_testing"]}
    assert "twostroke.states.testing" in result["after"]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of a module, at any depth (inside functions too), and whether
    it runs only for the type checker (under ``if TYPE_CHECKING:``)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, typing_only))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(tree, False)
    return found


def _package(path: pathlib.Path, root: pathlib.Path) -> str:
    return ".".join(("twostroke", *path.relative_to(root).parent.parts))


def _from_base(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
    """Every module a file imports, absolute, at any depth (inside functions too).

    ``from a import b`` counts as ``a`` and as ``a.b`` (``b`` may be a module of ``a``).
    """
    package = _package(path, root)
    found: set[str] = set()
    for node, _ in _statements(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            module = _from_base(node, package)
            found.add(module)
            # ``from twostroke import engine`` imports a package through its parent
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


# --- the graph of twostroke's own modules ----------------------------------------------
#
# The rules below follow every chain of imports, not only a module's own import lines: a
# rule a module keeps itself but breaks through a module it imports is broken. Like
# import-linter's graph, an edge is an import a module's code names (``import a.b`` is an
# edge to ``a.b``; ``from a import b`` to the module ``a.b`` if there is one, else to
# ``a``); the ``__init__`` that Python runs before any module of a package is not an edge
# of every module in it. (``twostroke.engine``'s ``__init__`` imports the whole engine
# for its public names, so any import of one of its modules loads all of them: that is
# packaging, not what a module's code depends on.)


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Every module of the three packages (a package under its own name), and its file."""
    found: dict[str, pathlib.Path] = {}
    for folder in ("states", "gpu", "engine"):
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(("twostroke", *parts))] = path
    return found


def internal_imports(
    path: pathlib.Path, known: Collection[str], root: pathlib.Path = ROOT, *, runtime: bool
) -> set[str]:
    """The modules of ``known`` that a file imports (``runtime``: not those imported only
    for the type checker)."""
    package = _package(path, root)
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node, typing_only in _statements(tree):
        if runtime and typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
            continue
        module = _from_base(node, package)
        for alias in node.names:
            submodule = f"{module}.{alias.name}"
            if submodule in known:
                found.add(submodule)
            elif module in known:
                found.add(module)
    return found


@functools.cache
def import_graph(*, runtime: bool = False) -> dict[str, frozenset[str]]:
    """Each module of the three packages, and the modules of theirs it imports."""
    files = module_files()
    return {
        name: frozenset(internal_imports(path, files, runtime=runtime) - {name})
        for name, path in files.items()
    }


def import_chains(
    start: str, graph: Mapping[str, Collection[str]], stop: Collection[str] = ()
) -> dict[str, list[str]]:
    """Every module ``start`` reaches, with a shortest chain of imports to it (from
    ``start``), not going on through the modules of ``stop``."""
    chains = {start: [start]}
    queue = collections.deque([start])
    while queue:
        module = queue.popleft()
        if module in stop and module != start:
            continue
        for target in sorted(graph[module]):
            if target not in chains:
                chains[target] = [*chains[module], target]
                queue.append(target)
    del chains[start]
    return chains


def _chain(chain: list[str]) -> str:
    return " -> ".join(chain)


def _modules_of(folder: str) -> list[str]:
    return sorted(name for name in module_files() if name.split(".")[1] == folder)


@pytest.mark.parametrize("module", _modules_of("states"))
def test_states_reaches_only_the_standard_library_attrs_and_itself(module: str) -> None:
    files = module_files()
    # The test-support package may import hypothesis (the test extra); the core may not.
    support = module.startswith("twostroke.states.testing")
    allowed = set(sys.stdlib_module_names) | {"attrs", "__future__"}
    if support:
        allowed.add("hypothesis")
    chains = {module: [module], **import_chains(module, import_graph())}
    for name, chain in chains.items():
        assert name.startswith("twostroke.states"), f"{_chain(chain)}"
        if not support:
            # the core never leans on its test support
            assert not name.startswith("twostroke.states.testing"), f"{_chain(chain)}"
        for imported in imports(files[name]):
            if not imported.startswith("twostroke"):
                assert _top(imported) in allowed, f"{_chain(chain)} imports {imported}"


@pytest.mark.parametrize("module", _modules_of("gpu"))
def test_gpu_never_reaches_engine_or_states(module: str) -> None:
    files = module_files()
    chains = {module: [module], **import_chains(module, import_graph())}
    for name, chain in chains.items():
        assert name.startswith("twostroke.gpu"), f"{_chain(chain)}"
        for imported in imports(files[name]):
            assert not imported.startswith(("twostroke.engine", "twostroke.states")), (
                f"{_chain(chain)} imports {imported}"
            )


#: What the data-parallel coordinator must never reach: it routes and relays, and the
#: replicas tokenize, detokenize and sample (Megatron's deduplicated engine and coordinator).
MODEL_TEXT_MODULES = ("twostroke.engine.text", "twostroke.engine.runners.sampler")
#: The coordinator's modules that run a replica's engine, and so reach all of it: the
#: ``local`` placement's engines in this process, and a replica's side of the wire.
REPLICA_ENGINES = frozenset(
    {"twostroke.engine.coordinator.local", "twostroke.engine.coordinator.replica_server"}
)


COORDINATOR_SIDE = [
    name
    for name in _modules_of("engine")
    if name.startswith("twostroke.engine.coordinator") and name not in REPLICA_ENGINES
]


def test_the_coordinators_modules_are_where_the_rule_says() -> None:
    assert module_files().keys() >= REPLICA_ENGINES, "a replica's engine moved"
    assert "twostroke.engine.coordinator.coordinator" in COORDINATOR_SIDE


@pytest.mark.parametrize("module", COORDINATOR_SIDE)
def test_the_coordinator_reaches_text_and_sampling_only_through_a_replicas_engine(
    module: str,
) -> None:
    for name, chain in import_chains(module, import_graph(), stop=REPLICA_ENGINES).items():
        assert not name.startswith(MODEL_TEXT_MODULES), f"the coordinator: {_chain(chain)}"


#: Import cycles that were there before the graph was checked, to be taken apart: none left.
KNOWN_CYCLES: list[frozenset[str]] = []


def import_cycles(graph: Mapping[str, Collection[str]]) -> list[frozenset[str]]:
    """The modules that import each other, directly or not: the graph's strongly connected
    components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(frozenset(component))
    return cycles


def test_no_new_import_cycle() -> None:
    """Modules that import each other at run time (typing-only imports aside)."""
    new = [sorted(cycle) for cycle in import_cycles(import_graph(runtime=True))]
    assert [cycle for cycle in new if frozenset(cycle) not in KNOWN_CYCLES] == []


def test_no_import_cycle_even_for_the_type_checker() -> None:
    """Modules that import each other only under ``if TYPE_CHECKING:`` are a loop too: the
    names of one are the other's business (frames and wire_constraints were one)."""
    assert [sorted(cycle) for cycle in import_cycles(import_graph())] == []


def test_the_scan_sees_every_kind_of_import(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "gpu"
    folder.mkdir()
    sample = folder / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "import torch.cuda\n"
        "from twostroke import engine\n"
        "from . import streams\n"
        "from .streams import Stream\n"
        "def late():\n"
        "    from twostroke.states.request import Request\n"
        "if TYPE_CHECKING:\n"
        "    from twostroke.states.plan import StepPlan\n",
        encoding="utf-8",
    )
    (folder / "streams.py").write_text("", encoding="utf-8")
    found = imports(sample, root=tmp_path)
    assert {"torch.cuda", "twostroke.engine", "twostroke.gpu.streams"} <= found
    assert {"twostroke.states.request", "twostroke.states.plan"} <= found
    known = {
        "twostroke.engine",
        "twostroke.gpu.streams",
        "twostroke.states.request",
        "twostroke.states.plan",
    }
    assert internal_imports(sample, known, tmp_path, runtime=False) == known
    assert internal_imports(sample, known, tmp_path, runtime=True) == known - {
        "twostroke.states.plan"
    }


def test_the_graph_finds_chains_and_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set(), "e": {"a"}}
    assert import_chains("a", graph) == {
        "b": ["a", "b"],
        "c": ["a", "b", "c"],
        "d": ["a", "b", "c", "d"],
    }
    assert import_chains("a", graph, stop={"c"}) == {"b": ["a", "b"], "c": ["a", "b", "c"]}
    assert import_cycles(graph) == [frozenset({"b", "c"})]
    assert import_cycles({"a": {"a"}}) == []  # one module alone is no cycle


def test_the_engine_and_its_toy_runner_do_not_need_the_test_extra() -> None:
    """hypothesis is a test dependency: importing the engine (and its toy model) avoids it."""
    code = (
        "import sys, twostroke.engine, twostroke.engine.runners.toy\n"
        "import twostroke.engine.runners.loading\n"
        "assert 'hypothesis' not in sys.modules, 'hypothesis was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


#: The most modules the engine's root folder holds (the house rule): a concept that needs
#: more modules than one gets a folder of its own (engine/strokes, engine/structured, ...).
ENGINE_ROOT_MODULES = 10


def test_the_engine_root_holds_at_most_ten_modules() -> None:
    root = sorted(path.name for path in (ROOT / "engine").glob("*.py"))
    assert len(root) <= ENGINE_ROOT_MODULES, root


#: The CPU wing's floors, lowest first: the compiled kernels know tensors and C only
#: (ggml-cpu's rule: the CPU library imports nothing of the model); the checkpoint readers
#: know files; the attention knows the paged cache; the models compose layers and decide the
#: run's plan; the runners drive a model. A module may import its own floor and those below.
FLOORS = (
    "twostroke.engine.kernels",
    "twostroke.engine.checkpoints",
    "twostroke.engine.attention",
    "twostroke.engine.models",
    "twostroke.engine.runners",
)
#: What the lowest floor may import besides itself.
KERNELS_MAY_IMPORT = ("twostroke.engine.kernels", "twostroke.engine.artifacts", "twostroke.gpu")


def _floor(module: str) -> int | None:
    for index, floor in enumerate(FLOORS):
        if module == floor or module.startswith(floor + "."):
            return index
    return None


@pytest.mark.parametrize("module", _modules_of("engine"))
def test_no_import_runs_from_a_lower_floor_up(module: str) -> None:
    """Every import of a floor's module, for the type checker too, stays on its floor or
    goes down (the ``engine.models`` and ``engine.kernels`` of a review at 893269d ran both
    ways)."""
    own = _floor(module)
    if own is None:
        return
    for imported in sorted(import_graph()[module]):
        floor = _floor(imported)
        assert floor is None or floor <= own, f"{module} imports {imported}, a floor up"


@pytest.mark.parametrize("module", [name for name in _modules_of("engine") if _floor(name) == 0])
def test_the_kernels_import_only_artifacts_and_gpu(module: str) -> None:
    for imported in sorted(import_graph()[module]):
        assert imported.startswith(KERNELS_MAY_IMPORT), f"{module} imports {imported}"


def test_the_floors_are_where_the_rule_says() -> None:
    files = module_files()
    assert all(floor in files for floor in FLOORS), "a floor's package moved"
    assert {_floor(name) for name in files} >= set(range(len(FLOORS)))
