"""A request's sampling parameters on the wire, its structured-output constraint as a tagged value.

The coordinator's :class:`~twostroke.engine.coordinator.frames.Add` frame carries a request's
:class:`~twostroke.states.params.SamplingParams` in two parts: every field by name but the
constraint, and the constraint apart as one of the tagged structs below (a
:data:`WireConstraint`), since a constraint is a value of one of several kinds that a plain
field dict cannot tell apart. :func:`wire_params` splits the parameters on the coordinator's
side; :func:`params_from_wire` joins them again in the replica.

Each struct bounds its fields by the constraint's own limits (``MAX_SCHEMA_LENGTH`` and the
rest, from :mod:`twostroke.states.constraints`), so a longer one is a malformed frame that
decoding refuses (:class:`~twostroke.engine.coordinator.frames.FrameError`). The replica makes
the constraint from what arrived, so the constraint's other rules (a schema's JSON, its depth)
are the request's refusal there, as ``submit``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

import attrs
import msgspec

from twostroke.states.constraints import (
    MAX_CHOICE_LENGTH,
    MAX_CHOICES,
    MAX_GRAMMAR_LENGTH,
    MAX_PATTERN_LENGTH,
    MAX_SCHEMA_LENGTH,
    AnyJsonObject,
    Choice,
    Constraint,
    Grammar,
    JsonSchema,
    Regex,
)
from twostroke.states.params import SamplingParams

if TYPE_CHECKING:  # frames imports WireConstraint from here for its Add frame
    from twostroke.engine.coordinator.frames import Add

__all__ = [
    "WireAnyJsonObject",
    "WireChoice",
    "WireConstraint",
    "WireGrammar",
    "WireJsonSchema",
    "WireRegex",
    "params_from_wire",
    "wire_params",
]


class WireJsonSchema(msgspec.Struct, tag="json", array_like=True):
    """A :class:`~twostroke.states.constraints.JsonSchema`: the schema's JSON text."""

    schema: Annotated[str, msgspec.Meta(max_length=MAX_SCHEMA_LENGTH)]


class WireAnyJsonObject(msgspec.Struct, tag="json_object", array_like=True):
    """An :class:`~twostroke.states.constraints.AnyJsonObject`: nothing but its tag."""


class WireRegex(msgspec.Struct, tag="regex", array_like=True):
    """A :class:`~twostroke.states.constraints.Regex`: its pattern."""

    pattern: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATTERN_LENGTH)]


class WireChoice(msgspec.Struct, tag="choice", array_like=True):
    """A :class:`~twostroke.states.constraints.Choice`: its choices, in order."""

    choices: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CHOICE_LENGTH)]],
        msgspec.Meta(min_length=1, max_length=MAX_CHOICES),
    ]


class WireGrammar(msgspec.Struct, tag="grammar", array_like=True):
    """A :class:`~twostroke.states.constraints.Grammar`: its source."""

    source: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GRAMMAR_LENGTH)]


#: A :data:`~twostroke.states.constraints.Constraint` on the wire.
WireConstraint: TypeAlias = (
    WireJsonSchema | WireAnyJsonObject | WireRegex | WireChoice | WireGrammar
)


def wire_params(params: SamplingParams) -> tuple[dict[str, Any], WireConstraint | None]:
    """A request's parameters as they travel: the fields by name but the constraint, and the
    constraint as a tagged value (inverse: :func:`params_from_wire`)."""
    fields = attrs.asdict(params, filter=lambda field, _: field.name != "constraint")
    constraint = params.constraint
    wire: WireConstraint | None
    if constraint is None:
        wire = None
    elif isinstance(constraint, JsonSchema):
        wire = WireJsonSchema(constraint.schema)
    elif isinstance(constraint, AnyJsonObject):
        wire = WireAnyJsonObject()
    elif isinstance(constraint, Regex):
        wire = WireRegex(constraint.pattern)
    elif isinstance(constraint, Choice):
        wire = WireChoice(list(constraint.choices))
    else:
        wire = WireGrammar(constraint.source)
    return fields, wire


def params_from_wire(frame: Add) -> SamplingParams:
    """The parameters an :class:`~twostroke.engine.coordinator.frames.Add` frame carries
    (inverse: :func:`wire_params`).

    Raises:
        TypeError, ValueError: a field the parameters or the constraint refuse (a schema
            that is not a JSON object, a ``constraint`` other than ``None`` among the named
            fields): the request's refusal, as ``submit``'s.
    """
    wire = frame.constraint
    constraint: Constraint | None
    if wire is None:
        constraint = None
    elif isinstance(wire, WireJsonSchema):
        constraint = JsonSchema(wire.schema)
    elif isinstance(wire, WireAnyJsonObject):
        constraint = AnyJsonObject()
    elif isinstance(wire, WireRegex):
        constraint = Regex(wire.pattern)
    elif isinstance(wire, WireChoice):
        constraint = Choice(wire.choices)
    else:
        constraint = Grammar(wire.source)
    fields = dict(frame.params)
    # An older coordinator names it, always None (it refused constraints): taken as absent.
    if fields.pop("constraint", None) is not None:
        raise TypeError("params must not name a constraint: it travels as its own field")
    return SamplingParams(**fields, constraint=constraint)
