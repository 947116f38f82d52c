"""The data-parallel coordinator: one engine-shaped front over N engine replicas.

Modules, one concept each, named by the side of the wire they run on (vLLM's ``core`` and
``core_client``): :mod:`.coordinator` (:class:`Coordinator`: its lifecycle and surface),
:mod:`.config` (:class:`CoordinatorConfig`: how many replicas, where, how they are watched),
:mod:`.relay` (its books of open requests, and what replicas report into them),
:mod:`.replica_client` (the coordinator's side of a replica: what it asks, what it is told,
and the client of a remote one), :mod:`.frames` (the wire: msgspec frames with a length
prefix), :mod:`.wire_constraints` (a request's sampling parameters on the wire, its
constraint apart, as its kind and its argument), :mod:`.wire_outputs` (a request's outputs
and errors on the wire, each conversion beside its inverse), :mod:`.replica_server` (a
replica's side of the wire: ``python -m twostroke.engine.coordinator.replica_server``), and
the three placements:
:mod:`.local` (engines in this process), :mod:`.process` and :mod:`.ray`. See
``docs/scaling.md``.
"""

from twostroke.engine.coordinator.config import CoordinatorConfig
from twostroke.engine.coordinator.coordinator import (
    Coordinator,
    CoordinatorStatistics,
    ReplicaStatistics,
)

__all__ = ["Coordinator", "CoordinatorConfig", "CoordinatorStatistics", "ReplicaStatistics"]
