"""A request's sampling parameters on the wire, its structured-output constraint apart.

The coordinator's :class:`~twostroke.engine.coordinator.frames.Add` frame carries a request's
:class:`~twostroke.states.params.SamplingParams` as every field by name but the constraint
(:func:`wire_params`), and its constraint by id. A remote replica's client sends each
constraint once, in a :class:`~twostroke.engine.coordinator.frames.DefineConstraint` frame,
and every request that carries it names its id until the last of them has ended
(:class:`~twostroke.engine.coordinator.frames.ForgetConstraint`): a 2 MB choice with
``n=128`` was 128 copies in 128 frames, 541 MiB in all. :func:`params_from_wire` joins the
parameters and the constraint again in the replica.

A constraint travels as what it says it is: its ``kind`` and its argument's ``value``
(:class:`~twostroke.engine.coordinator.frames.WireConstraint`, whose decoding holds the
argument to its kind's limits), and the replica makes it again with
:func:`~twostroke.states.constraints.constraint_from`, so the constraint's other rules (a
schema's JSON, its depth) are the refusal of each request that names it, as ``submit``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from twostroke.engine.coordinator.frames import Add, WireConstraint
from twostroke.states.constraints import Constraint, constraint_from
from twostroke.states.params import SamplingParams

__all__ = [
    "constraint_from_wire",
    "params_from_wire",
    "wire_constraint",
    "wire_params",
]


def wire_constraint(constraint: Constraint) -> WireConstraint:
    """A constraint as it travels (inverse: :func:`constraint_from_wire`)."""
    return WireConstraint(constraint.kind, constraint.value)


def constraint_from_wire(wire: WireConstraint) -> Constraint:
    """The constraint a frame carries (inverse: :func:`wire_constraint`).

    Raises:
        TypeError, ValueError: the constraint's own checks refuse it.
    """
    return constraint_from(wire.kind, wire.argument)


def wire_params(params: SamplingParams) -> dict[str, Any]:
    """A request's parameters as they travel: every field by name but the constraint, which
    travels apart (inverse: :func:`params_from_wire`)."""
    return attrs.asdict(params, filter=lambda field, _: field.name != "constraint")


def params_from_wire(
    frame: Add, defined: Mapping[int, Constraint | Exception] | None = None
) -> SamplingParams:
    """The parameters an :class:`~twostroke.engine.coordinator.frames.Add` frame carries
    (inverse: :func:`wire_params` and the frame's constraint id).

    Args:
        frame: The frame.
        defined: The constraints ``DefineConstraint`` frames sent, by id (or why each was
            refused), for the constraint the frame names.

    Raises:
        TypeError, ValueError: a field the parameters or the constraint refuse (a schema
            that is not a JSON object, a ``constraint`` other than ``None`` among the named
            fields, a constraint never defined or refused): the request's refusal, as
            ``submit``'s.
    """
    constraint: Constraint | None = None
    if frame.constraint_id is not None:
        found = (defined or {}).get(frame.constraint_id)
        if found is None:
            raise ValueError(f"constraint {frame.constraint_id} was never defined (or forgotten)")
        if isinstance(found, Exception):  # refused when defined: each request's refusal
            raise type(found)(*found.args)
        constraint = found
    fields = dict(frame.params)
    # An older coordinator names it, always None (it refused constraints): taken as absent.
    if fields.pop("constraint", None) is not None:
        raise TypeError("params must not name a constraint: it travels as its own field")
    return SamplingParams(**fields, constraint=constraint)
