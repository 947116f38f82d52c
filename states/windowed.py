"""The windowed layers' own KV pool, as the scheduler admits requests against it.

A model whose sliding-window layers sit beside global ones (Gemma 2 and 3) keeps the
windowed layers' KV apart, only as far back as their window: the runner hands out its blocks
as rows compute and takes them back as the window passes
(``twostroke.engine.runners.window_kv``). The scheduler never sees those blocks; it only
makes sure the runner never runs out, by reserving each running request the most it can
hold (:meth:`WindowedKV.reservation`) and admitting no request whose reservation the pool
cannot take beside the running ones' and one step's (:meth:`WindowedKV.step_reserve`).

Why that suffices: before a row computes ``[start, end)`` the runner keeps a request's blocks
from ``start - window + 1`` on, and after it from ``end - drafts - window + 1``; a request so
holds at most ``blocks_for(window - 1 + drafts) + 1`` blocks between its rows and
``blocks_for(window - 1 + n) + 1 <= blocks_for(window - 1 + drafts) + 1 + blocks_for(n)``
during a row of ``n`` positions, and never more than its whole table, ``blocks_for(total - 1
+ drafts)``. The rows of one step hold together at most ``blocks_for(max_num_batched_tokens)``
beyond the between-rows counts (the step's token budget bounds them, rounding included in
the reservation's extra block), and block 0 is padding.
"""

from __future__ import annotations

import attrs

from twostroke.states.blocks import blocks_for
from twostroke.states.validators import int_at_least

__all__ = ["WindowedKV", "window_pool_blocks"]


@attrs.frozen
class WindowedKV:
    """The windowed layers' pool a scheduler admits against.

    Args:
        window: Positions a windowed layer's query sees, its own included.
        num_blocks: Blocks of the pool, padding included.
    """

    window: int = attrs.field(validator=int_at_least(1))
    num_blocks: int = attrs.field(validator=int_at_least(2))

    def reservation(self, num_positions: int, *, block_size: int, max_drafts: int) -> int:
        """The most blocks a request of ``num_positions`` (prompt and output) holds between
        its rows, and the rounding of one of its rows: its window's, or its whole table's
        where that is fewer."""
        window = blocks_for(self.window - 1 + max_drafts, block_size) + 2
        return min(window, blocks_for(num_positions - 1 + max_drafts, block_size) + 1)

    def step_reserve(self, *, block_size: int, max_num_batched_tokens: int) -> int:
        """Blocks no reservation may take: the padding block, and one step's rows."""
        return 1 + blocks_for(max_num_batched_tokens, block_size)


def window_pool_blocks(
    *,
    window: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_drafts: int = 0,
) -> int:
    """Blocks a windowed pool needs so that ``max_num_seqs`` requests of any length run at
    once: the step's reserve and that many windows' reservations.

    Raises:
        ValueError: a size below 1 (``max_drafts`` below 0).
    """
    for name, value in (
        ("window", window),
        ("block_size", block_size),
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if max_drafts < 0:
        raise ValueError(f"max_drafts must be >= 0, got {max_drafts}")
    per_request = blocks_for(window - 1 + max_drafts, block_size) + 2
    return 1 + max_num_seqs * per_request + blocks_for(max_num_batched_tokens, block_size)
