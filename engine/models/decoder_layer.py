"""The decoder layer the architectures compose: grouped-query attention over the paged cache,
the SwiGLU MLP, and the pre-norm layer that adds each to the residual stream.

The arithmetic follows transformers' ``modeling_llama`` operation for operation (RMSNorm in
float32, rotary tables in float32 cast to the model dtype, the same residual order), so
float32 logits match it to rounding. q/k/v are one fused projection and so are gate/up (the
architecture's names table says which checkpoint tensors fill which slice:
:class:`~twostroke.engine.models.decoder.CheckpointNames`); queries and keys are rotated
together. Element-wise work goes through the chosen
:class:`~twostroke.engine.models.layers.Glue`.
"""

from __future__ import annotations

import torch
from torch import nn

from twostroke.engine.attention.kv_cache import LayerCache
from twostroke.engine.attention.metadata import AttentionMetadata
from twostroke.engine.attention.ops import paged_attention
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.layers import Glue, RMSNorm
from twostroke.engine.models.linear import Linear

__all__ = ["MLP", "Attention", "DecoderLayer"]


class Attention(nn.Module):
    """Grouped-query self-attention over the paged cache."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, width, bias=config.qkv_bias, dtype=dtype, device=device
        )
        self.o_proj = Linear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            bias=config.o_bias,
            dtype=dtype,
            device=device,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
        glue: Glue,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        # Queries and keys rotate in place in the projection's output, which then holds
        # them and the values side by side: the attention reads views of it, no copy.
        glue.rotate_write(qkv, heads, kv_heads, cos, signed_sin, metadata, layer)
        query = qkv[:, : heads * dim].view(num_tokens, heads, dim)
        key_value = qkv[:, heads * dim :].view(num_tokens, 2, kv_heads, dim)
        out = paged_attention(query, key_value, layer, metadata, scale=self.scale)
        projected: torch.Tensor = self.o_proj(out)
        return projected


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size,
            2 * config.intermediate_size,
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )
        self.down_proj = Linear(
            config.intermediate_size,
            config.hidden_size,
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor, glue: Glue) -> torch.Tensor:
        mixed = glue.silu_mul(self.gate_up_proj(x))
        down: torch.Tensor = self.down_proj(mixed)
        return down


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each added to the residual stream."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = MLP(config, dtype=dtype, device=device)

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
        glue: Glue,
    ) -> torch.Tensor:
        """One layer, its element-wise work through ``glue``: each residual add with the
        norm after it, the rotary embeddings with the cache write, and SiLU times up.

        Args:
            residual: ``[tokens, hidden]`` contiguous: the stream before the previous
                layer's MLP output is added (the embeddings, for the first layer); both of
                this layer's adds happen in place in it.
            delta: The previous layer's MLP output (``None`` for the first layer).
            cos: ``[tokens, 1, head_dim]``, from
                :func:`~twostroke.engine.models.layers.rotary_tables`.
            signed_sin: The same shape, ``sin`` with its first half negated.
            metadata: The step's layout.
            layer: This layer's cache.
            glue: The chosen glue.

        Returns:
            This layer's MLP output, which the next layer (or the final norm) adds.
        """
        first, second = self.input_layernorm, self.post_attention_layernorm
        normed = glue.add_rms_norm(residual, delta, first.weight, first.eps)
        attended: torch.Tensor = self.self_attn(normed, cos, signed_sin, metadata, layer, glue)
        normed = glue.add_rms_norm(residual, attended, second.weight, second.eps)
        mixed: torch.Tensor = self.mlp(normed, glue)
        return mixed
