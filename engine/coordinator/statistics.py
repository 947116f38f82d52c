"""What the coordinator reports: totals over its replicas' engines, and each replica."""

from __future__ import annotations

import attrs

from twostroke.engine.statistics import EngineStatistics

__all__ = ["CoordinatorStatistics", "ReplicaStatistics"]


@attrs.frozen
class ReplicaStatistics:
    """One replica, as the coordinator sees it.

    Attributes:
        index: The replica's index (``0 .. replicas - 1``).
        placement: ``"local"``, ``"process"`` or ``"ray"``.
        alive: It serves; ``False`` once it died (see ``failure``).
        healthy: Alive, and its step counter moved within ``unhealthy_after`` seconds
            whenever it had open requests.
        pid: Its process (``None`` in this process).
        num_open_requests: Requests the coordinator routed to it that have not ended.
        load_tokens: The router's count of its outstanding tokens.
        engine: Its engine's statistics (a remote replica's latest snapshot; ``None`` before
            the first).
        failure: Why it died.
    """

    index: int
    placement: str
    alive: bool
    healthy: bool
    pid: int | None
    num_open_requests: int
    load_tokens: int
    engine: EngineStatistics | None
    failure: str | None


@attrs.frozen
class CoordinatorStatistics(EngineStatistics):
    """Totals over the live replicas' engines, and one entry per replica.

    ``num_open_requests`` is the coordinator's own count; every other total is the sum of the
    live replicas' latest engine statistics.

    Attributes:
        num_replicas_alive: Replicas that have not died.
        num_resubmitted: Requests sent again to another replica because theirs died before
            it delivered any token (each request is resubmitted at most once).
        relay_seconds: Seconds the coordinator spent decoding remote replicas' frames and
            relaying their output into handles (a local replica's relay runs inside its
            engine's bookkeeping stroke and is counted there).
        replicas: One record per replica, by index, dead ones included.
    """

    num_replicas_alive: int = 0
    num_resubmitted: int = 0
    relay_seconds: float = 0.0
    replicas: tuple[ReplicaStatistics, ...] = ()
