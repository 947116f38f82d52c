"""The token masks of one step's constrained rows: filled by bookkeeping, awaited at sampling.

At depth 2 the forward of step N+1 starts before token N is on the host, and the mask of a
constrained row of N+1 depends on token N. So the bookkeeping stroke fills the masks of a
step once every earlier step is applied (its matchers have advanced by every token before),
which is while that step's layers run, and then :meth:`StepMasks.publish` es them. The runner
waits for them only where it samples the constrained rows (:meth:`StepMasks.wait`, on the
device's thread); a step without constrained rows has no masks and never waits.

A step whose masks will never come (the engine died or closed) is :meth:`abandoned
<StepMasks.abandon>`: a waiting runner wakes and fails the step instead of hanging.
"""

from __future__ import annotations

import threading
import time

import torch

from twostroke.engine.errors import EngineError
from twostroke.engine.structured.bitmask import allocate_bitmask

__all__ = ["MasksAbandoned", "StepMasks"]


class MasksAbandoned(EngineError, RuntimeError):
    """The masks of a step will never come: the engine stopped before it filled them."""


class StepMasks:
    """The bitmask rows of the constrained requests that sample in a step.

    A request has one row per position it samples at: one, or with drafts (speculative
    decoding) one more per draft, consecutive from :attr:`rows`' entry.

    Args:
        step_id: The step.
        request_ids: The constrained requests that sample in it, in order.
        vocab_size: How many token ids a row covers (the tokenizer's vocabulary).
        pin_memory: Page-locked rows, for an asynchronous copy to a CUDA device.
        num_samples: Each request's positions (default: one each).
    """

    def __init__(
        self,
        step_id: int,
        request_ids: tuple[int, ...],
        vocab_size: int,
        *,
        pin_memory: bool = False,
        num_samples: tuple[int, ...] | None = None,
    ) -> None:
        self.step_id = step_id
        counts = num_samples if num_samples is not None else (1,) * len(request_ids)
        starts = [sum(counts[:index]) for index in range(len(counts))]
        #: Each request's first row.
        self.rows = dict(zip(request_ids, starts, strict=True))
        #: Each request's rows: its positions in the step.
        self.num_samples = dict(zip(request_ids, counts, strict=True))
        self.vocab_size = vocab_size
        self.bitmask = allocate_bitmask(sum(counts), vocab_size, pin_memory=pin_memory)
        self._ready = threading.Event()
        self._abandoned = False
        self._owner = threading.get_ident()
        #: Seconds the runner waited for the masks (0 when they were there first).
        self.wait_seconds = 0.0
        #: Seconds the bookkeeping stroke took to fill them.
        self.fill_seconds = 0.0

    @property
    def ready(self) -> bool:
        """Whether the masks are filled (or abandoned): :meth:`wait` returns at once."""
        return self._ready.is_set()

    def publish(self) -> None:
        """Hand the filled masks to the runner (idempotent)."""
        self._ready.set()

    def abandon(self) -> None:
        """The masks will never be filled: a waiting runner raises :class:`MasksAbandoned`."""
        if not self._ready.is_set():
            self._abandoned = True
            self._ready.set()

    def wait(self) -> torch.Tensor:
        """Block until the masks are published; return the host bitmask (row per request).

        Called by the runner on the device's thread, never on the event loop's: the
        bookkeeping stroke that fills them runs there.

        Raises:
            MasksAbandoned: the masks will never come.
            RuntimeError: called on the thread that made them (the event loop's), where
                waiting could only deadlock: a runner that launches inline (the fake
                device) must defer its constrained rows instead.
        """
        if not self._ready.is_set():
            if threading.get_ident() == self._owner:
                raise RuntimeError(
                    f"step {self.step_id}'s masks are not filled yet and the launch runs on "
                    "the event loop's thread, which fills them: waiting would deadlock"
                )
            began = time.perf_counter()
            self._ready.wait()
            self.wait_seconds = time.perf_counter() - began
        if self._abandoned:
            raise MasksAbandoned(f"step {self.step_id}'s masks will never come: the engine stopped")
        return self.bitmask

    def __repr__(self) -> str:
        state = "abandoned" if self._abandoned else "ready" if self.ready else "pending"
        return f"<StepMasks step {self.step_id}, {len(self.rows)} rows, {state}>"
