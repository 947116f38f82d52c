"""A request's sampling parameters on the wire, its structured-output constraint as a tagged value.

The coordinator's :class:`~twostroke.engine.coordinator.frames.Add` frame carries a request's
:class:`~twostroke.states.params.SamplingParams` in two parts: every field by name but the
constraint, and the constraint apart as one of the tagged structs below (a
:data:`WireConstraint`), since a constraint is a value of one of several kinds that a plain
field dict cannot tell apart. :func:`wire_params` splits the parameters on the coordinator's
side; :func:`params_from_wire` joins them again in the replica.

A remote replica's client sends each constraint once, in a
:class:`~twostroke.engine.coordinator.frames.DefineConstraint` frame, and every request that
carries it names it (:class:`WireConstraintRef`) until the last of them has ended
(:class:`~twostroke.engine.coordinator.frames.ForgetConstraint`): a 2 MB choice with ``n=128``
was 128 copies in 128 frames, 541 MiB in all.

Each struct bounds its fields by the constraint's own limits (``MAX_SCHEMA_LENGTH`` and the
rest, from :mod:`twostroke.states.constraints`), so a longer one is a malformed frame that
decoding refuses (:class:`~twostroke.engine.coordinator.frames.FrameError`). The replica makes
the constraint from what arrived, so the constraint's other rules (a schema's JSON, its depth)
are the request's refusal there, as ``submit``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    "WireConstraintRef",
    "WireGrammar",
    "WireJsonSchema",
    "WireRegex",
    "constraint_from_wire",
    "params_from_wire",
    "wire_constraint",
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


class WireConstraintRef(msgspec.Struct, tag="ref", array_like=True):
    """A constraint a :class:`~twostroke.engine.coordinator.frames.DefineConstraint` frame
    sent before, by its id."""

    constraint_id: Annotated[int, msgspec.Meta(ge=0)]


#: A :data:`~twostroke.states.constraints.Constraint` on the wire.
WireConstraint: TypeAlias = (
    WireJsonSchema | WireAnyJsonObject | WireRegex | WireChoice | WireGrammar
)


def wire_constraint(constraint: Constraint) -> WireConstraint:
    """A constraint as it travels (inverse: :func:`constraint_from_wire`)."""
    if isinstance(constraint, JsonSchema):
        return WireJsonSchema(constraint.schema)
    if isinstance(constraint, AnyJsonObject):
        return WireAnyJsonObject()
    if isinstance(constraint, Regex):
        return WireRegex(constraint.pattern)
    if isinstance(constraint, Choice):
        return WireChoice(list(constraint.choices))
    return WireGrammar(constraint.source)


def constraint_from_wire(wire: WireConstraint) -> Constraint:
    """The constraint a frame carries (inverse: :func:`wire_constraint`).

    Raises:
        TypeError, ValueError: the constraint's own checks refuse it.
    """
    if isinstance(wire, WireJsonSchema):
        return JsonSchema(wire.schema)
    if isinstance(wire, WireAnyJsonObject):
        return AnyJsonObject()
    if isinstance(wire, WireRegex):
        return Regex(wire.pattern)
    if isinstance(wire, WireChoice):
        return Choice(wire.choices)
    return Grammar(wire.source)


def wire_params(params: SamplingParams) -> tuple[dict[str, Any], WireConstraint | None]:
    """A request's parameters as they travel: the fields by name but the constraint, and the
    constraint as a tagged value (inverse: :func:`params_from_wire`)."""
    fields = attrs.asdict(params, filter=lambda field, _: field.name != "constraint")
    constraint = params.constraint
    return fields, None if constraint is None else wire_constraint(constraint)


def params_from_wire(
    frame: Add, defined: Mapping[int, Constraint | Exception] | None = None
) -> SamplingParams:
    """The parameters an :class:`~twostroke.engine.coordinator.frames.Add` frame carries
    (inverse: :func:`wire_params`).

    Args:
        frame: The frame.
        defined: The constraints ``DefineConstraint`` frames sent, by id (or why each was
            refused), for a constraint the frame names by reference.

    Raises:
        TypeError, ValueError: a field the parameters or the constraint refuse (a schema
            that is not a JSON object, a ``constraint`` other than ``None`` among the named
            fields, a reference to a constraint never defined or refused): the request's
            refusal, as ``submit``'s.
    """
    wire = frame.constraint
    constraint: Constraint | None
    if wire is None:
        constraint = None
    elif isinstance(wire, WireConstraintRef):
        found = (defined or {}).get(wire.constraint_id)
        if found is None:
            raise ValueError(f"constraint {wire.constraint_id} was never defined (or forgotten)")
        if isinstance(found, Exception):  # refused when defined: each request's refusal
            raise type(found)(*found.args)
        constraint = found
    else:
        constraint = constraint_from_wire(wire)
    fields = dict(frame.params)
    # An older coordinator names it, always None (it refused constraints): taken as absent.
    if fields.pop("constraint", None) is not None:
        raise TypeError("params must not name a constraint: it travels as its own field")
    return SamplingParams(**fields, constraint=constraint)
