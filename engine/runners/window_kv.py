"""The KV of a model's sliding-window layers, kept to the window, apart from its global layers'.

Gemma 2 and 3 interleave layers that attend within a sliding window with layers that see
every position. The global layers' KV lives in the paged pool the scheduler hands out
(:mod:`twostroke.states.blocks`); the windowed layers need only the last ``window`` positions
of each request, so theirs lives here, in a pool of blocks of the same size that the runner
manages itself, as llama.cpp's SWA cache and vLLM's sliding-window group do:

* before a row computes positions ``[start, end)``, the request's blocks wholly behind
  ``start - window + 1`` (the first key its first query sees) go back to the pool, and blocks
  are taken for the positions up to ``end``;
* after the row, the blocks wholly behind ``end - drafts - window + 1`` go back too: the
  request's next row starts at ``end`` less at most its rejected drafts.

So a request holds at most ``blocks_for(window - 1 + n) + 1`` blocks during a row of ``n``
positions and ``blocks_for(window - 1 + drafts) + 1`` between rows, and the pool never runs
out while the scheduler admits against it (:class:`~twostroke.states.windowed.WindowedKV`:
a reservation per running request, one step's rows beside; a pool of
:func:`~twostroke.states.windowed.window_pool_blocks` holds ``max_num_seqs`` requests of any
length). Block 0 is padding: the table's entries for positions behind the window point at
it, and the attention never reads them (each query sees only its window).

The runner learns of the requests from the plans: a request's table is dropped when the plan
lists it finished or preempted (a preempted request is computed again from its first
position). A request this pool does not hold must start at position 0: the windowed KV of
earlier positions is nowhere, so a prefix-cache hit cannot be served (the engine turns
prefix caching off for such a model; ``swa_full=True`` keeps every position instead).
"""

from __future__ import annotations

from collections import deque

import attrs

from twostroke.engine.runners.errors import RunnerError

__all__ = ["WindowKV"]


def _blocks_for(num_positions: int, block_size: int) -> int:
    return -(-num_positions // block_size)


@attrs.define
class _Table:
    """One request's windowed blocks: ``blocks[i]`` holds its logical block ``first + i``."""

    first: int = 0
    blocks: list[int] = attrs.field(factory=list)


class WindowKV:
    """Block tables of the windowed layers, one per request, kept to the window.

    Args:
        num_blocks: Blocks of the windowed layers' cache, block 0 (padding) included (the
            scheduler's :class:`~twostroke.states.windowed.WindowedKV`).
        block_size: Positions per block (the global pool's).
        window: Positions a windowed layer's query sees, its own included.

    Raises:
        ValueError: ``num_blocks`` below 2, or a size below 1.
    """

    def __init__(self, *, num_blocks: int, block_size: int, window: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is padding), got {num_blocks}")
        for name, value in (("block_size", block_size), ("window", window)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self._free: deque[int] = deque(range(1, num_blocks))
        self._tables: dict[int, _Table] = {}

    @property
    def num_free(self) -> int:
        """Blocks no request holds (padding excluded)."""
        return len(self._free)

    def held(self, request_id: int) -> int:
        """Blocks ``request_id`` holds (0 for a request the pool does not know)."""
        table = self._tables.get(request_id)
        return 0 if table is None else len(table.blocks)

    def drop(self, request_id: int) -> None:
        """Give back every block of ``request_id`` (idempotent)."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self._free.extend(table.blocks)

    def table(self, request_id: int, start: int, end: int) -> tuple[tuple[int, ...], list[int]]:
        """The windowed layers' block table for a row computing ``[start, end)``.

        Blocks behind the window of the row's first query go back first; blocks are then
        taken for the positions up to ``end``.

        Returns:
            The table covering ``[0, end)`` (padding, block 0, behind the window) and the
            blocks just taken, which the caller zeroes before the row writes them.

        Raises:
            RunnerError: the request is new to the pool but starts past position 0, or
                starts behind positions already given back, or the pool is out of blocks
                (the scheduler admitted against another pool).
        """
        size = self.block_size
        table = self._tables.get(request_id)
        if table is None:
            if start != 0:
                raise RunnerError(
                    f"request {request_id} starts at position {start}, but the windowed "
                    "layers hold no KV of it: their KV is kept to the window, so a row must "
                    "start at 0 (no prefix-cache hit) the first time"
                )
            table = self._tables[request_id] = _Table()
        elif max(start - self.window + 1, 0) // size < table.first:
            raise RunnerError(
                f"request {request_id} starts at position {start}, behind the windowed KV it "
                f"still holds (from position {table.first * size})"
            )
        self._trim(table, start - self.window + 1)
        needed = _blocks_for(end, size) - table.first - len(table.blocks)
        if needed > len(self._free):
            raise RunnerError(
                f"the windowed layers' KV pool of {self.num_blocks} blocks has {len(self._free)} "
                f"free, and request {request_id} needs {needed} more"
            )
        taken = [self._free.popleft() for _ in range(max(needed, 0))]
        table.blocks.extend(taken)
        padded = (0,) * table.first + tuple(table.blocks)
        return padded, taken

    def settle(self, request_id: int, end: int, num_drafts: int) -> None:
        """After a row ending at ``end`` with ``num_drafts`` drafts, give back what no later
        row reads: the next starts at ``end - num_drafts`` or later."""
        table = self._tables.get(request_id)
        if table is not None:
            self._trim(table, end - num_drafts - self.window + 1)

    def _trim(self, table: _Table, first_position: int) -> None:
        """Give back the blocks wholly before ``first_position``."""
        keep_from = max(first_position, 0) // self.block_size
        if keep_from <= table.first:
            return
        gone = table.blocks[: keep_from - table.first]
        self._free.extend(gone)
        del table.blocks[: len(gone)]
        table.first = keep_from
