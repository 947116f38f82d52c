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

Importing this package checks llguidance first (:func:`~.backend.load_llguidance`): where it
is missing or too old, the import raises
:class:`~twostroke.engine.errors.StructuredOutputUnavailable` saying what to install.
docs/structured-output.md says why llguidance, with the measurements.
"""

from twostroke.engine.structured.backend import load_llguidance

load_llguidance()

from twostroke.engine.structured.bitmask import (  # noqa: E402  (after the feature test)
    allocate_bitmask,
    apply_bitmask,
    bitmask_row,
    bitmask_rows,
)
from twostroke.engine.structured.compiler import (  # noqa: E402
    DEFAULT_COMPILE_TIMEOUT,
    CompiledConstraint,
    CompilerConfig,
    CompilerStatistics,
    GrammarCompiler,
)
from twostroke.engine.structured.matcher import GuidanceMatcher, fill_bitmasks  # noqa: E402
from twostroke.engine.structured.vocabulary import TokenBytes, Vocabulary  # noqa: E402

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
