"""The data-parallel coordinator: one engine-shaped front over N engine replicas.

Modules, one concept each: :mod:`.coordinator` (:class:`Coordinator`: its lifecycle and
surface), :mod:`.relay` (its books of open requests, and what replicas report into them),
:mod:`.replicas` (the coordinator's side of a replica: in this process, or over frames),
:mod:`.frames` (the wire: msgspec frames with a length prefix), :mod:`.replica` (a replica's
side of the wire: ``python -m twostroke.engine.coordinator.replica``), :mod:`.process` and
:mod:`.ray` (the two remote placements). See ``docs/scaling.md``.

:mod:`.config` holds :class:`CoordinatorConfig`: how many replicas, where, how they are watched.
"""

from twostroke.engine.coordinator.config import CoordinatorConfig
from twostroke.engine.coordinator.coordinator import (
    Coordinator,
    CoordinatorStatistics,
    ReplicaStatistics,
)

__all__ = ["Coordinator", "CoordinatorConfig", "CoordinatorStatistics", "ReplicaStatistics"]
