"""The coordinator's configuration: checked by the shared validators, like the engine's."""

from __future__ import annotations

from twostroke.engine.coordinator import CoordinatorConfig
from twostroke.states.routing import RoutingConfig


def test_defaults_and_routing_none_is_the_default_routing() -> None:
    config = CoordinatorConfig()
    assert (config.replicas, config.placement, config.routing) == (1, "local", RoutingConfig())
    assert (config.unhealthy_after, config.grace_period) == (30.0, 5.0)
    assert CoordinatorConfig(routing=None).routing == RoutingConfig()
    tight = RoutingConfig(imbalance_tokens=8)
    assert CoordinatorConfig(routing=tight, grace_period=0).routing is tight
