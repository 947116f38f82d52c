"""Routing whole requests to engine replicas: a pure policy, driven by the coordinator.

The coordinator (``twostroke.engine.coordinator``) asks :meth:`Router.route` where a new
request goes and tells the router what came back; the router holds no clock, does no I/O
and never looks at a replica itself. Two signals decide:

* **Load**, in outstanding tokens: the unprefilled prompt tokens plus the tokens still to be
  generated of every open request, tracked exactly from what the coordinator sent and what
  came back (vLLM's data-parallel router balances on periodically refreshed counts, and its
  users report requests piling onto a few ranks: vLLM #36748, #48027).
* **Prefix affinity**: which replica last served the longest prefix of this prompt, as given
  (text or token ids), so that its prefix cache is reused (SGLang's cache-aware router). The
  prompt is cut into chunks of ``prefix_chunk`` units (characters or token ids) whose hashes
  are chained from a fixed root; the router remembers which replica each chunk hash, and each
  whole prompt, was last sent to, in a bounded table that forgets the least recently used.

The rule: when the replicas are *imbalanced* — the most loaded exceeds the least loaded by
more than ``imbalance_tokens`` *and* by more than ``imbalance_ratio`` times (SGLang's two
thresholds) — the request goes to the least loaded replica. Otherwise it goes to the replica
that served its longest prefix, or, when no live replica served any, to the least loaded.
Ties rotate. Consequence (proved by the tests for any sequence of arrivals and replica
removals): the most loaded replica never exceeds ``max(least + imbalance_tokens,
imbalance_ratio * least)`` plus the largest single request.

Python's ``hash`` of strings is salted per process, which is harmless here: the table lives
in one process. A hash collision can only send a request to a replica with a colder cache.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import attrs

from twostroke.states.errors import EngineError
from twostroke.states.validators import int_at_least, number_in

__all__ = ["NoLiveReplica", "Router", "RoutingConfig"]

#: A prompt as the router sees it: text, or token ids (chat messages are flattened to text
#: by the caller).
PromptKey = str | Sequence[int]


class NoLiveReplica(EngineError, RuntimeError):
    """Every replica has been removed: there is nowhere to route a request."""


@attrs.frozen(kw_only=True)
class RoutingConfig:
    """When the router balances load and when it follows prefix affinity.

    Args:
        imbalance_tokens: The absolute threshold: outstanding tokens by which the most
            loaded replica must exceed the least loaded for the replicas to be imbalanced.
        imbalance_ratio: The relative threshold: the most loaded must also carry more than
            this many times the least loaded's tokens (>= 1).
        prefix_chunk: Characters (text) or token ids per prefix-affinity chunk.
        prefix_capacity: Chunk hashes remembered; the least recently used are forgotten.

    Raises:
        TypeError, ValueError: a value of the wrong type or out of range.
    """

    imbalance_tokens: int = attrs.field(default=2048, validator=int_at_least(1))
    imbalance_ratio: float = attrs.field(default=1.5, validator=number_in(1))
    prefix_chunk: int = attrs.field(default=32, validator=int_at_least(1))
    prefix_capacity: int = attrs.field(default=65536, validator=int_at_least(1))


@attrs.define
class _Open:
    """The router's view of one open request: where it went and what it still costs."""

    replica: int
    prompt_tokens: int
    remaining_tokens: int
    prefilled: bool = False

    @property
    def load(self) -> int:
        return self.prompt_tokens + self.remaining_tokens


def prefix_hashes(key: PromptKey, chunk: int) -> list[int]:
    """Chained hashes of every full chunk of ``key``, then one of the whole key.

    The i-th hash stands for the first ``(i + 1) * chunk`` units; the last stands for the whole
    prompt (tagged, so that it never equals a chunk hash of a longer prompt).
    """
    text = isinstance(key, str)
    units: Sequence[object] = key if text else tuple(key)
    parent = hash(("twostroke.routing", "text" if text else "ids"))
    hashes = []
    for start in range(0, len(units) - chunk + 1, chunk):
        parent = hash((parent, units[start : start + chunk]))
        hashes.append(parent)
    full = len(units) - len(units) % chunk
    hashes.append(hash((parent, "whole", units[full:])))
    return hashes


class Router:
    """Where each request goes, and the load every live replica carries.

    Args:
        replicas: The replica ids (or how many: ids ``0 .. n - 1``).
        config: The thresholds and the affinity table's size.

    Raises:
        ValueError: no replica, or a replica id given twice.
    """

    def __init__(self, replicas: int | Iterable[int], config: RoutingConfig | None = None) -> None:
        ids = list(range(replicas)) if isinstance(replicas, int) else list(replicas)
        if not ids:
            raise ValueError("a router needs at least one replica, got none")
        if len(set(ids)) != len(ids):
            raise ValueError(f"replica ids must be distinct, got {ids}")
        self.config = config or RoutingConfig()
        self._load: dict[int, int] = dict.fromkeys(sorted(ids), 0)
        self._open: dict[int, _Open] = {}
        self._affinity: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._cursor = 0

    # --- queries ------------------------------------------------------------------------

    @property
    def live_replicas(self) -> tuple[int, ...]:
        return tuple(self._load)

    def load(self, replica: int) -> int:
        """Outstanding tokens of ``replica`` (0 for a removed one)."""
        return self._load.get(replica, 0)

    def replica_of(self, request_id: int) -> int | None:
        """The replica an open request was routed to (``None`` if it is not open)."""
        entry = self._open.get(request_id)
        return None if entry is None else entry.replica

    def open_requests(self, replica: int) -> list[int]:
        """The open requests routed to ``replica``, oldest first."""
        return [rid for rid, entry in self._open.items() if entry.replica == replica]

    def is_imbalanced(self) -> bool:
        """Whether the live replicas' loads differ beyond both thresholds."""
        if not self._load:
            return False
        most = max(self._load.values())
        least = min(self._load.values())
        return (
            most - least > self.config.imbalance_tokens
            and most > self.config.imbalance_ratio * least
        )

    def __len__(self) -> int:
        return len(self._open)

    def __repr__(self) -> str:
        loads = ", ".join(f"{r}: {load}" for r, load in self._load.items())
        return f"<Router {len(self._open)} open, loads {{{loads}}}>"

    # --- routing ------------------------------------------------------------------------

    def route(self, request_id: int, key: PromptKey, prompt_tokens: int, max_tokens: int) -> int:
        """Choose the replica for a new request and count its load there.

        Args:
            request_id: A new id (not open).
            key: The prompt as given (text or token ids), for prefix affinity.
            prompt_tokens: The prompt's length in tokens (an estimate is fine: correct it
                with :meth:`set_prompt_tokens` once known).
            max_tokens: The most tokens the request may generate.

        Returns:
            A live replica id.

        Raises:
            NoLiveReplica: every replica was removed.
            ValueError: the id is open already, or a count is negative.
        """
        if request_id in self._open:
            raise ValueError(f"request {request_id} is open already")
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got prompt_tokens={prompt_tokens} "
                f"and max_tokens={max_tokens}"
            )
        if not self._load:
            raise NoLiveReplica("no live replica is left to route a request to")
        hashes = prefix_hashes(key, self.config.prefix_chunk)
        replica = None if self.is_imbalanced() else self._affine(hashes)
        if replica is None:
            least = min(self._load.values())
            replica = self._rotate([r for r, load in self._load.items() if load == least])
        self._remember(hashes, replica)
        entry = _Open(replica, prompt_tokens, max_tokens)
        self._open[request_id] = entry
        self._load[replica] += entry.load
        return replica

    def _affine(self, hashes: list[int]) -> int | None:
        """The replica that served the longest prefix (the whole prompt first), if any."""
        for digest in reversed(hashes):
            replica = self._affinity.get(digest)
            if replica is not None:
                return replica
        return None

    def _rotate(self, candidates: list[int]) -> int:
        """The first candidate at or after the cursor, cyclically; the cursor moves past it."""
        after = [r for r in candidates if r >= self._cursor]
        chosen = after[0] if after else candidates[0]
        self._cursor = chosen + 1
        return chosen

    def _remember(self, hashes: list[int], replica: int) -> None:
        table = self._affinity
        for digest in hashes:
            table[digest] = replica
            table.move_to_end(digest)
        while len(table) > self.config.prefix_capacity:
            table.popitem(last=False)

    # --- what came back -----------------------------------------------------------------

    def set_prompt_tokens(self, request_id: int, prompt_tokens: int) -> None:
        """Correct an open request's prompt length (the replica tokenized it).

        Ignored once the request has produced tokens (its prompt is prefilled by then).
        """
        entry = self._entry(request_id)
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        if entry.prefilled:
            return
        self._load[entry.replica] += prompt_tokens - entry.prompt_tokens
        entry.prompt_tokens = prompt_tokens

    def progress(self, request_id: int, new_tokens: int) -> None:
        """``new_tokens`` output tokens came back: the prompt is prefilled, fewer remain."""
        entry = self._entry(request_id)
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
        done = min(new_tokens, entry.remaining_tokens)
        self._load[entry.replica] -= entry.prompt_tokens + done
        entry.prompt_tokens = 0
        entry.prefilled = True
        entry.remaining_tokens -= done

    def release(self, request_id: int) -> None:
        """The request ended (finished, failed or cancelled): its load is gone. Idempotent."""
        entry = self._open.pop(request_id, None)
        if entry is not None:
            self._load[entry.replica] -= entry.load

    def remove_replica(self, replica: int) -> list[int]:
        """Stop routing to ``replica`` (it died); release and return its open requests.

        Idempotent: removing a removed replica returns ``[]``.
        """
        if replica not in self._load:
            return []
        del self._load[replica]
        orphans = self.open_requests(replica)
        for request_id in orphans:
            del self._open[request_id]
        stale = [digest for digest, owner in self._affinity.items() if owner == replica]
        for digest in stale:
            del self._affinity[digest]
        return orphans

    def _entry(self, request_id: int) -> _Open:
        entry = self._open.get(request_id)
        if entry is None:
            raise ValueError(f"request {request_id} is not open in the router")
        return entry

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the loads disagree with the open requests."""
        expected = dict.fromkeys(self._load, 0)
        for request_id, entry in self._open.items():
            assert entry.replica in expected, f"request {request_id} is on a removed replica"
            assert entry.prompt_tokens >= 0, entry
            assert entry.remaining_tokens >= 0, entry
            expected[entry.replica] += entry.load
        assert expected == self._load, f"loads {self._load} != open requests' {expected}"
        assert len(self._affinity) <= self.config.prefix_capacity
        for owner in self._affinity.values():
            assert owner in self._load, f"the affinity table names removed replica {owner}"
