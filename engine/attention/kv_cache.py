"""The paged KV cache: every layer's keys and values in fixed-size blocks, in one tensor.

The layout is ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``: keys at
index 0 of the second axis, values at 1. Blocks are stored head-major so one
``index_select`` gathers a batch's history straight into the layout batched matrix products
take; with the CPU's in-place kernels (``"native"`` and ``"bag"``) each block's keys are held
transposed, ``[head_dim, block_size]``, in the same space (see
:mod:`twostroke.engine.attention.ops`).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

__all__ = ["KVCache", "LayerCache"]


@attrs.frozen
class LayerCache:
    """One layer's keys and values, with the views the attention kernels index, made once.

    A view costs a call into torch (and a hand-off of the GIL) each time it is made; a step
    would otherwise make a handful per layer, about 200 for SmolLM2's 30 layers.

    Attributes:
        data: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``; keys at index 0.
        flat: ``data`` as one dimension (element-wise writes).
        rows: ``data`` as ``[-1, head_dim]`` rows (row-wise writes).
        blocks: ``data`` as ``[-1, block_size, head_dim]``, a block and head per row (gathers).
        key_rows: The keys as ``[-1, block_size]`` rows (a transposed key tile's rows).
        value_rows: The values as ``[-1, head_dim]`` rows.
    """

    data: torch.Tensor
    flat: torch.Tensor
    rows: torch.Tensor
    blocks: torch.Tensor
    key_rows: torch.Tensor
    value_rows: torch.Tensor

    @classmethod
    def of(cls, data: torch.Tensor) -> LayerCache:
        """The views of ``data``, one layer ``[2, num_blocks, heads, block_size, head_dim]``."""
        block_size, head_dim = data.shape[3], data.shape[4]
        return cls(
            data=data,
            flat=data.view(-1),
            rows=data.view(-1, head_dim),
            blocks=data.view(-1, block_size, head_dim),
            key_rows=data[0].view(-1, block_size),
            value_rows=data[1].view(-1, head_dim),
        )


@attrs.frozen
class KVCache:
    """The paged key and value caches of every layer, in one tensor.

    Attributes:
        data: ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``; keys at
            index 0 of the second axis, values at 1.
    """

    data: torch.Tensor
    layers: tuple[LayerCache, ...] = attrs.field(init=False, repr=False, eq=False)

    @layers.default
    def _views(self) -> tuple[LayerCache, ...]:
        return tuple(LayerCache.of(layer) for layer in self.data)

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: bool = True,
    ) -> KVCache:
        """Allocate a cache, zeroed unless ``zeroed`` is false.

        A block must be zeroed before it is first read, because padded reads see slots no
        request wrote: a masked key gets zero weight, but zero times a NaN left in memory
        would still be NaN. Zeroing a large cache up front costs start-up time (0.4 s for
        SmolLM2's default 1 GiB on the CPU) and touches every page, so a runner may allocate
        it unzeroed and :meth:`zero_blocks` each block the first time a step writes it.

        Returns:
            The new cache.
        """
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
        allocate = torch.zeros if zeroed else torch.empty
        return cls(data=allocate(shape, dtype=dtype, device=device))

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the keys and values of ``block_ids`` in every layer."""
        # One strided fill per block: 7x faster than index_fill_ over the block axis for
        # the one or two new blocks of a decode step (measured), and never a host sync.
        for block in block_ids:
            self.data[:, :, block].zero_()

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes, keys and values of every layer."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    def layer(self, index: int) -> LayerCache:
        """Layer ``index``'s ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` and views."""
        return self.layers[index]

    @property
    def key(self) -> torch.Tensor:
        """``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` (a view)."""
        return self.data[:, 0]

    @property
    def value(self) -> torch.Tensor:
        """Same as :attr:`key`, for values."""
        return self.data[:, 1]

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[4])
