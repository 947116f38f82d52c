"""The coordinator's configuration: how many replicas, where, and how they are watched."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from twostroke.states.routing import RoutingConfig
from twostroke.states.validators import int_at_least, number_in, one_of

__all__ = ["PLACEMENTS", "CoordinatorConfig", "Placement"]

#: Where replicas run: engines in this task group, child processes, or Ray actors.
Placement = Literal["local", "process", "ray"]
PLACEMENTS: tuple[Placement, ...] = ("local", "process", "ray")


def _routing(value: RoutingConfig | None) -> RoutingConfig:
    return RoutingConfig() if value is None else value


def _check_routing(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, RoutingConfig):
        raise TypeError(f"{attribute.name} must be a RoutingConfig, got {type(value).__name__}")


@attrs.frozen(kw_only=True)
class CoordinatorConfig:
    """How a coordinator runs its replicas (the replicas' engines take an ``EngineConfig``).

    Args:
        replicas: How many engine replicas (>= 1).
        placement: ``"local"`` (engines in this task group), ``"process"`` (one child
            process each, torch threads split between them) or ``"ray"`` (Ray actors; needs
            ``twostroke[ray]`` and a running or startable Ray cluster).
        routing: The routing thresholds (``None``: :class:`RoutingConfig`'s defaults).
        unhealthy_after: Seconds a replica with open requests may go without a step before
            ``statistics()`` reports it unhealthy (> 0).
        grace_period: Seconds a replica process told to stop may take before it is killed
            (>= 0).

    Raises:
        TypeError: a value of the wrong type; the message names the field and the value.
        ValueError: a value out of range or not among a field's choices.
    """

    replicas: int = attrs.field(default=1, validator=int_at_least(1))
    placement: Placement = attrs.field(default="local", validator=one_of(*PLACEMENTS))
    routing: RoutingConfig = attrs.field(
        factory=RoutingConfig,
        converter=_routing,
        validator=_check_routing,
    )
    unhealthy_after: float = attrs.field(default=30.0, validator=number_in(0, low_open=True))
    grace_period: float = attrs.field(default=5.0, validator=number_in(0))
