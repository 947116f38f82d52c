"""What the coordinator reports: totals over its replicas' engines, and each replica."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from twostroke.engine.statistics import EngineStatistics
from twostroke.states.statistics import zero
from twostroke.states.validators import is_int

__all__ = ["CoordinatorStatistics", "ReplicaStatistics", "engine_statistics"]


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
    live replicas' latest engine statistics (each field a count or seconds, as
    :class:`EngineStatistics` declares it: :func:`~twostroke.states.statistics.total`).

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


def engine_statistics(values: object) -> EngineStatistics:
    """A remote replica's statistics snapshot (field name to value) as ``EngineStatistics``.

    Replicas and coordinator may come from different versions (a Ray cluster upgraded one
    node at a time): a field this version does not know is ignored, and one it knows but the
    replica did not send counts as 0.

    Raises:
        TypeError: ``values`` is not a mapping of names to numbers, or a known field holds
            a value of the wrong kind (a float where a count belongs).
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"statistics must be a mapping, got {type(values).__name__}")
    known: dict[str, Any] = {}
    for field in attrs.fields(EngineStatistics):
        start = zero(field)
        if isinstance(start, tuple):  # counts per position: a list of ints off the wire
            value = values.get(field.name, start)
            if not (
                isinstance(value, list | tuple)
                and len(value) == len(start)
                and all(is_int(item) for item in value)
            ):
                raise TypeError(
                    f"statistics field {field.name} must be {len(start)} ints, got {value!r}"
                )
            known[field.name] = tuple(value)
            continue
        counts = isinstance(start, int)  # as declared: a count, or seconds
        value = values.get(field.name, 0)
        if is_int(value):
            known[field.name] = value if counts else float(value)
        elif isinstance(value, float) and not counts:
            known[field.name] = value
        else:
            kind = "an int" if counts else "a number"
            raise TypeError(f"statistics field {field.name} must be {kind}, got {value!r}")
    return EngineStatistics(**known)
