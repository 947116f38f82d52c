"""The structured-output backend, llguidance, feature-tested once at import.

Every module of the package that uses llguidance takes it from here (``from
twostroke.engine.structured.backend import llguidance``), and this module runs
:func:`load_llguidance` before it imports llguidance, so a missing or too old installation
gives one clear error, :class:`~twostroke.engine.errors.StructuredOutputUnavailable`, when
any such module is imported, rather than an ``ImportError`` or ``AttributeError`` deep
inside it. The parts that need no backend (the engine's manager of constrained requests,
:mod:`~twostroke.engine.structured.constraining`, and the masks' hand-over,
:mod:`~twostroke.engine.structured.masks`) import without it, so the engine itself does
not need llguidance. Why llguidance and not xgrammar is in docs/structured-output.md
(measured on SmolLM2's vocabulary).
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

from twostroke.engine.errors import StructuredOutputUnavailable

__all__ = ["MIN_VERSION", "REQUIREMENT", "llguidance", "load_llguidance"]

#: The oldest llguidance whose API this package uses (``LLMatcher.try_consume_tokens``,
#: ``validate_grammar_with_warnings``, ``LLParserLimits``, ``LLExecutor``).
MIN_VERSION = (1, 9)
#: What to install, as pyproject.toml pins it.
REQUIREMENT = "llguidance>=1.9,<2"
_NEEDED = ("LLMatcher", "LLTokenizer", "LLExecutor", "LLParserLimits", "TokenizerWrapper")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def load_llguidance(name: str = "llguidance") -> ModuleType:
    """Import llguidance and check that it is recent enough.

    Args:
        name: The module to import (tests pass another name to see the error).

    Returns:
        The module.

    Raises:
        StructuredOutputUnavailable: it cannot be imported, is older than
            :data:`MIN_VERSION`, or lacks a class this package uses.
    """
    advice = f"structured output needs {REQUIREMENT} (pip install '{REQUIREMENT}')"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise StructuredOutputUnavailable(f"{advice}; importing it failed: {exc}") from exc
    version = str(getattr(module, "__version__", "0"))
    missing = [attribute for attribute in _NEEDED if not hasattr(module, attribute)]
    if _version(version) < MIN_VERSION or missing:
        raise StructuredOutputUnavailable(
            f"{advice}; version {version} is installed"
            + (f", which lacks {', '.join(missing)}" if missing else "")
        )
    return module


load_llguidance()

import llguidance as llguidance  # noqa: E402  (after the feature test)
