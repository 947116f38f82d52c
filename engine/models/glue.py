"""The compiled glue as the decoder calls it: :class:`CompiledGlue`.

The kernels' library (:class:`~twostroke.engine.kernels.glue.DecoderGlue`) takes tensors
and nothing of the model: a rotary write takes the step's slots and one layer's cache tensor.
The decoder's :class:`~twostroke.engine.models.layers.Glue` takes the step's layout and the
layer's cache; this adapter is where one becomes the other, so that the kernels' floor
never imports the attention's.
"""

from __future__ import annotations

import attrs
import torch

from twostroke.engine.attention.kv_cache import LayerCache
from twostroke.engine.attention.metadata import AttentionMetadata
from twostroke.engine.kernels.glue import DecoderGlue
from twostroke.engine.models.layers import rotate_write

__all__ = ["CompiledGlue"]


@attrs.frozen
class CompiledGlue:
    """:class:`~twostroke.engine.models.layers.Glue` by the compiled library.

    Attributes:
        library: The library built for the model's shape and element types.
    """

    library: DecoderGlue

    @property
    def dtype(self) -> torch.dtype:
        """The activations' element type."""
        return self.library.dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type."""
        return self.library.cache_dtype

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """:meth:`DecoderGlue.add_rms_norm
        <twostroke.engine.kernels.glue.DecoderGlue.add_rms_norm>`."""
        return self.library.add_rms_norm(residual, delta, weight, eps)

    def rotate_write(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
    ) -> None:
        """Rotate queries and keys in place and write keys and values into the step's slots:
        :func:`~twostroke.engine.models.layers.rotate_write`, bit for bit.

        In one call (:meth:`~twostroke.engine.kernels.glue.DecoderGlue.rotate_write_slots`)
        where the cache holds its keys transposed (the CPU's in-place attention kernels'
        layout, the one the library writes); into a cache of the gathering kernels' layout,
        as torch's operators.
        """
        if not metadata.keys_transposed:
            rotate_write(qkv, num_heads, num_kv_heads, cos, signed_sin, metadata, layer)
            return
        self.library.rotate_write_slots(
            qkv, num_heads, num_kv_heads, cos, signed_sin, metadata.slot_mapping, layer.data
        )

    def head_rms_norm(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> None:
        """:meth:`DecoderGlue.head_rms_norm
        <twostroke.engine.kernels.glue.DecoderGlue.head_rms_norm>`."""
        self.library.head_rms_norm(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """:meth:`DecoderGlue.silu_mul <twostroke.engine.kernels.glue.DecoderGlue.silu_mul>`."""
        return self.library.silu_mul(gate_up)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`DecoderGlue.argmax <twostroke.engine.kernels.glue.DecoderGlue.argmax>`."""
        return self.library.argmax(logits)
