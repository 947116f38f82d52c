"""The feature test of llguidance: one clear error where it is missing or too old."""

from __future__ import annotations

import re
import subprocess
import sys
import types

import pytest

from twostroke.engine.errors import EngineError, StructuredOutputUnavailable
from twostroke.engine.structured.backend import MIN_VERSION, REQUIREMENT, load_llguidance

ADVICE = "structured output needs llguidance>=1.9,<2 (pip install 'llguidance>=1.9,<2')"


def test_the_installed_llguidance_passes() -> None:
    module = load_llguidance()
    assert module.__name__ == "llguidance"
    assert REQUIREMENT == "llguidance>=1.9,<2"
    assert MIN_VERSION == (1, 9)


def test_a_missing_backend_is_one_clear_error() -> None:
    with pytest.raises(StructuredOutputUnavailable) as caught:
        load_llguidance("twostroke_no_such_module")
    assert str(caught.value) == (
        f"{ADVICE}; importing it failed: No module named 'twostroke_no_such_module'"
    )
    assert isinstance(caught.value, ImportError)
    assert isinstance(caught.value, EngineError)


def test_an_old_or_partial_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    old = types.ModuleType("old_llguidance")
    old.__version__ = "0.7.30"  # type: ignore[attr-defined]
    for name in ("LLMatcher", "LLTokenizer", "LLExecutor", "LLParserLimits", "TokenizerWrapper"):
        setattr(old, name, object)
    monkeypatch.setitem(sys.modules, "old_llguidance", old)
    with pytest.raises(
        StructuredOutputUnavailable, match=f"^{re.escape(ADVICE)}; version 0.7.30 is installed$"
    ):
        load_llguidance("old_llguidance")
    partial = types.ModuleType("partial_llguidance")
    partial.__version__ = "1.10.0"  # type: ignore[attr-defined]
    partial.LLMatcher = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "partial_llguidance", partial)
    with pytest.raises(
        StructuredOutputUnavailable,
        match=f"^{re.escape(ADVICE)}; version 1.10.0 is installed, which lacks LLTokenizer, "
        "LLExecutor, LLParserLimits, TokenizerWrapper$",
    ):
        load_llguidance("partial_llguidance")


BLOCKED = """
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "llguidance":
            raise ImportError("llguidance is blocked in this test")
        return None

sys.meta_path.insert(0, Blocker())
import twostroke.engine  # the engine itself does not need it
try:
    import twostroke.engine.structured.compiler
except twostroke.engine.StructuredOutputUnavailable as error:
    print(error)
"""


def test_importing_any_part_without_llguidance_says_what_to_install() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"{ADVICE}; importing it failed: llguidance is blocked in this test"
    )
