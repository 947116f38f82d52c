"""The paged KV cache: every layer's keys and values in fixed-size blocks, in one tensor.

The layout is ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``: keys at
index 0 of the second axis, values at 1. Blocks are stored head-major so one
``index_select`` gathers a batch's history straight into the layout batched matrix products
take; with the CPU's in-place kernels (``"native"`` and ``"bag"``) each block's keys are held
transposed, ``[head_dim, block_size]``, in the same space (see
:mod:`twostroke.engine.attention.ops`). A model whose sliding-window layers keep their KV
apart (:mod:`twostroke.engine.runners.window_kv`) has a second tensor of that layout for
them, with blocks of its own.
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
    """The paged key and value caches of every layer.

    Attributes:
        data: ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``; keys at
            index 0 of the second axis, values at 1: every layer's, or where
            ``windowed_layers`` keep theirs apart, the other layers', in order.
        windowed: The ``windowed_layers``' own ``[len(windowed_layers), 2,
            num_windowed_blocks, num_kv_heads, block_size, head_dim]``, or ``None``.
        windowed_layers: The layers (model indices) whose KV is in ``windowed``.
        layers: Every layer's views, in the model's order, from whichever tensor holds it.
    """

    data: torch.Tensor
    windowed: torch.Tensor | None = None
    windowed_layers: tuple[int, ...] = ()
    layers: tuple[LayerCache, ...] = attrs.field(init=False, repr=False, eq=False)

    @layers.default
    def _views(self) -> tuple[LayerCache, ...]:
        own = iter(self.data)
        apart = iter(() if self.windowed is None else self.windowed)
        count = len(self.data) + len(self.windowed_layers)
        return tuple(
            LayerCache.of(next(apart) if index in self.windowed_layers else next(own))
            for index in range(count)
        )

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
        windowed_layers: tuple[int, ...] = (),
        num_windowed_blocks: int = 0,
    ) -> KVCache:
        """Allocate a cache, zeroed unless ``zeroed`` is false.

        A block must be zeroed before it is first read, because padded reads see slots no
        request wrote: a masked key gets zero weight, but zero times a NaN left in memory
        would still be NaN. Zeroing a large cache up front costs start-up time (0.4 s for
        SmolLM2's default 1 GiB on the CPU) and touches every page, so a runner may allocate
        it unzeroed and :meth:`zero_blocks` each block the first time a step writes it.

        Args:
            num_layers: The model's layers, ``windowed_layers`` included.
            windowed_layers: Layers whose KV goes in a tensor of its own, of
                ``num_windowed_blocks`` blocks, always zeroed.

        Returns:
            The new cache.

        Raises:
            ValueError: ``windowed_layers`` without blocks, or outside the layers.
        """
        if windowed_layers and (
            num_windowed_blocks < 1 or not all(0 <= i < num_layers for i in windowed_layers)
        ):
            raise ValueError(
                f"windowed_layers must be layers of the {num_layers} and have blocks: got "
                f"{windowed_layers} with num_windowed_blocks={num_windowed_blocks}"
            )
        layout = (num_kv_heads, block_size, head_dim)
        shape = (num_layers - len(set(windowed_layers)), 2, num_blocks, *layout)
        allocate = torch.zeros if zeroed else torch.empty
        windowed = None
        if windowed_layers:
            apart = (len(set(windowed_layers)), 2, num_windowed_blocks, *layout)
            windowed = torch.zeros(apart, dtype=dtype, device=device)
        return cls(
            data=allocate(shape, dtype=dtype, device=device),
            windowed=windowed,
            windowed_layers=tuple(sorted(set(windowed_layers))),
        )

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the keys and values of ``block_ids`` in every layer of :attr:`data`."""
        # One strided fill per block: 7x faster than index_fill_ over the block axis for
        # the one or two new blocks of a decode step (measured), and never a host sync.
        for block in block_ids:
            self.data[:, :, block].zero_()

    def zero_windowed_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the keys and values of ``block_ids`` in every layer of :attr:`windowed`."""
        if self.windowed is not None:
            for block in block_ids:
                self.windowed[:, :, block].zero_()

    @property
    def num_windowed_blocks(self) -> int:
        """Blocks of :attr:`windowed` (0 without)."""
        return 0 if self.windowed is None else int(self.windowed.shape[2])

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
        """``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` (a view) of
        :attr:`data`."""
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
