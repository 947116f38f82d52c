"""The dependency rule between the three packages, proven two ways.

``states`` must import with torch, anyio and trio unavailable (run in a subprocess whose
import system refuses them), and an AST scan of every module checks what each package
imports: ``states`` only the standard library, attrs and itself (hypothesis in its
test-support module), ``gpu`` never ``engine`` nor ``states``.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

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


#: The package of ``states`` that supports tests and may import hypothesis (the test extra).
TEST_SUPPORT = ROOT / "states" / "testing"


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


def imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
    """Every module a file imports, absolute, at any depth (inside functions too)."""
    parts = path.relative_to(root).parent.parts
    package = ".".join(("twostroke", *parts))
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            # ``from twostroke import engine`` imports a package through its parent
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def sources(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", sources("states"), ids=_name)
def test_states_imports_only_the_standard_library_attrs_and_itself(path: pathlib.Path) -> None:
    allowed = set(sys.stdlib_module_names) | {"attrs", "__future__"}
    support = TEST_SUPPORT in path.parents
    if support:
        allowed.add("hypothesis")
    for module in imports(path):
        if module.startswith("twostroke"):
            # a name imported from a states module (``from twostroke.states.x import Y``)
            assert module.startswith("twostroke.states"), f"{_name(path)} imports {module}"
            if not support:
                # the core never leans on its test support
                assert not module.startswith("twostroke.states.testing"), (
                    f"{_name(path)} imports {module}"
                )
        else:
            assert _top(module) in allowed, f"{_name(path)} imports {module}"


@pytest.mark.parametrize("path", sources("gpu"), ids=_name)
def test_gpu_never_imports_engine_or_states(path: pathlib.Path) -> None:
    for module in imports(path):
        assert not module.startswith(("twostroke.engine", "twostroke.states")), (
            f"{_name(path)} imports {module}"
        )


#: What the data-parallel coordinator must never import: it routes and relays, and the
#: replicas tokenize, detokenize and sample (Megatron's deduplicated engine and coordinator).
MODEL_TEXT_MODULES = ("twostroke.engine.text", "twostroke.engine.runners.sampler")


@pytest.mark.parametrize("path", sources("engine/coordinator"), ids=_name)
def test_the_coordinator_never_imports_tokenizer_detokenizer_or_sampler(
    path: pathlib.Path,
) -> None:
    assert sources("engine/coordinator"), "the coordinator package moved"
    for module in imports(path):
        assert not module.startswith(MODEL_TEXT_MODULES), f"{_name(path)} imports {module}"


def test_the_scan_sees_every_kind_of_import(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "gpu"
    folder.mkdir()
    sample = folder / "sample.py"
    sample.write_text(
        "import torch.cuda\n"
        "from twostroke import engine\n"
        "from . import streams\n"
        "def late():\n"
        "    from twostroke.states.request import Request\n",
        encoding="utf-8",
    )
    found = imports(sample, root=tmp_path)
    assert {"torch.cuda", "twostroke.engine", "twostroke.gpu.streams"} <= found
    assert "twostroke.states.request" in found


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
