"""Structured output: constraints compiled by llguidance, behind the states' Matcher protocol.

* :class:`Vocabulary`: a tokenizer's tokens as bytes, built once per tokenizer.
* :class:`GrammarCompiler`: compiles a :data:`~twostroke.states.constraints.Constraint` into a
  :class:`CompiledConstraint` off the event loop, bounded in time, cached by value; a
  constraint the backend cannot enforce is a
  :class:`~twostroke.states.errors.ConstraintRejected` naming the field and the reason.
* :class:`GuidanceMatcher`: one request's matcher (:meth:`CompiledConstraint.matcher`), and
  :func:`fill_bitmasks`, which fills many matchers' rows at once.
* :func:`allocate_bitmask`, :func:`bitmask_row`, :func:`bitmask_rows` and
  :func:`apply_bitmask`: the bitmask as torch tensors, applied to a batch's constrained rows
  with no host-device synchronization.

* :mod:`~twostroke.engine.structured.constraining` and
  :mod:`~twostroke.engine.structured.masks`: the engine's side, its constrained requests and
  the masks each step hands the runner.

Every part that uses llguidance checks it first (:func:`~.backend.load_llguidance`): where it
is missing or too old, importing that part (or asking the package for one of its names)
raises :class:`~twostroke.engine.errors.StructuredOutputUnavailable` saying what to install.
docs/structured-output.md says why llguidance, with the measurements.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from twostroke.engine.structured.bitmask import (
        allocate_bitmask,
        apply_bitmask,
        bitmask_row,
        bitmask_rows,
    )
    from twostroke.engine.structured.compiler import (
        DEFAULT_COMPILE_TIMEOUT,
        CompiledConstraint,
        CompilerConfig,
        CompilerStatistics,
        GrammarCompiler,
    )
    from twostroke.engine.structured.matcher import GuidanceMatcher, fill_bitmasks
    from twostroke.engine.structured.vocabulary import TokenBytes, Vocabulary

#: Where each public name lives: imported when first asked for, so that importing the
#: package (for the engine's manager of constrained requests, or the masks) needs no
#: llguidance; a module that does checks it first (:mod:`.backend`).
_WHERE = {
    "allocate_bitmask": "bitmask",
    "apply_bitmask": "bitmask",
    "bitmask_row": "bitmask",
    "bitmask_rows": "bitmask",
    "DEFAULT_COMPILE_TIMEOUT": "compiler",
    "CompiledConstraint": "compiler",
    "CompilerConfig": "compiler",
    "CompilerStatistics": "compiler",
    "GrammarCompiler": "compiler",
    "GuidanceMatcher": "matcher",
    "fill_bitmasks": "matcher",
    "TokenBytes": "vocabulary",
    "Vocabulary": "vocabulary",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "DEFAULT_COMPILE_TIMEOUT",
    "CompiledConstraint",
    "CompilerConfig",
    "CompilerStatistics",
    "GrammarCompiler",
    "GuidanceMatcher",
    "TokenBytes",
    "Vocabulary",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_row",
    "bitmask_rows",
    "fill_bitmasks",
]
