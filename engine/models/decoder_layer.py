"""The decoder layer the architectures compose: grouped-query attention over the paged cache,
the SwiGLU MLP, and the layer that adds each to the residual stream (pre-norm as Llama, or
post-norm as OLMo 2; the variations are :class:`~twostroke.engine.models.config.ModelConfig`'s
fields).

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
import torch.nn.functional as F
from torch import nn

from twostroke.engine.attention.kv_cache import LayerCache
from twostroke.engine.attention.metadata import AttentionMetadata
from twostroke.engine.attention.ops import paged_attention
from twostroke.engine.kernels.reference import rotate_
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.experts import SparseMoE
from twostroke.engine.models.layers import Glue, RMSNorm
from twostroke.engine.models.linear import Linear

__all__ = ["MLP", "Attention", "DecoderLayer"]


class Attention(nn.Module):
    """Grouped-query self-attention over the paged cache.

    The architectures' variations are the configuration's: queries and keys normalized
    before rotary (per head, or over the whole projection), a layer that does not rotate
    (``rotates=False``), a score scale of its own, only the leading ``rotary_dim`` of
    each head rotated (Phi-3), scores soft-capped (Gemma 2).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        rotates: bool = True,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.window = window
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        scale = config.attention_scale
        self.scale = config.head_dim**-0.5 if scale is None else scale
        self.softcap = config.attn_logit_softcapping
        self.rotates = rotates
        self.rotary_width = config.rotary_width
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm != "none":
            eps, whole = config.rms_norm_eps, config.qk_norm == "full"
            q_width = config.num_heads * config.head_dim if whole else config.head_dim
            k_width = config.num_kv_heads * config.head_dim if whole else config.head_dim
            offset = config.norm_offset
            self.q_norm = RMSNorm(q_width, eps, dtype=dtype, device=device, offset=offset)
            self.k_norm = RMSNorm(k_width, eps, dtype=dtype, device=device, offset=offset)
        #: Each head normed with Llama's norm (Qwen3's): the glue's (and the stack's) to
        #: compute; over the whole projection (OLMo 2) or offset (Gemma 3), torch's operators.
        self.head_norms = config.qk_norm == "head" and config.norm_offset is None
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
        if self.window is not None:
            # Its masks, and where its KV is kept apart (window_kv) its own layout, which
            # the write below goes through too; the attention asks again and gets the same.
            metadata = metadata.windowed(self.window)
        qkv = self.qkv_proj(x)
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm is not None and k_norm is not None:
            if self.head_norms:
                glue.head_rms_norm(qkv, heads, kv_heads, q_norm.weight, k_norm.weight, q_norm.eps)
            else:
                self._norm_queries_keys(qkv, q_norm, k_norm)
        if self.rotates and self.rotary_width != dim:
            # Partial rotary pairs each rotated dimension with the one half the *rotated
            # part* away, where the glue (and the stack) pair the halves of the whole head:
            # the leading part rotates here, in place, as transformers' arithmetic.
            query_key = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, -1, dim)
            rotate_(query_key[..., : self.rotary_width], cos, signed_sin)
        if not self.rotates or self.rotary_width != dim:
            # Then (and in a NoPE layer) the glue rotates by angle zero, which leaves every
            # value as it is (x * 1 + y * 0): its one rotate-and-write call writes the cache.
            cos = cos.new_ones((num_tokens, 1, dim))
            signed_sin = cos.new_zeros((num_tokens, 1, dim))
        # Queries and keys rotate in place in the projection's output, which then holds
        # them and the values side by side: the attention reads views of it, no copy.
        glue.rotate_write(qkv, heads, kv_heads, cos, signed_sin, metadata, layer)
        query = qkv[:, : heads * dim].view(num_tokens, heads, dim)
        key_value = qkv[:, heads * dim :].view(num_tokens, 2, kv_heads, dim)
        out = paged_attention(
            query,
            key_value,
            layer,
            metadata,
            scale=self.scale,
            window=self.window,
            softcap=self.softcap,
        )
        projected: torch.Tensor = self.o_proj(out)
        return projected

    def _norm_queries_keys(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        """RMSNorm of the queries and of the keys in place in the projection's output, each
        head's (``head_dim`` weights, Gemma 3's offset norm) or the whole projection's, as
        transformers' Gemma 3 and OLMo 2 norm them before rotary."""
        tokens, dim = qkv.shape[0], self.head_dim
        q_width, k_width = self.num_heads * dim, self.num_kv_heads * dim
        for norm, part, heads in (
            (q_norm, qkv[:, :q_width], self.num_heads),
            (k_norm, qkv[:, q_width : q_width + k_width], self.num_kv_heads),
        ):
            rows = part if norm.weight.shape[0] == part.shape[1] else part.view(tokens, heads, dim)
            part.copy_(norm(rows).view(tokens, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; or GeGLU, ``gelu_tanh`` in place of
    ``silu`` (Gemma's ``hidden_activation``), as torch's operator: the glue computes
    SiLU only."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gelu = config.hidden_activation == "gelu_tanh"
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
        if self.gelu:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            mixed = F.gelu(gate, approximate="tanh").mul_(up)
        else:
            mixed = glue.silu_mul(self.gate_up_proj(x))
        down: torch.Tensor = self.down_proj(mixed)
        return down


class DecoderLayer(nn.Module):
    """Attention and MLP blocks, each added to the residual stream: normalized before
    (``norm_placement="pre"``, Llama: ``input_layernorm``, ``post_attention_layernorm``) or
    their outputs normalized after (``"post"``, OLMo 2: ``post_attention_layernorm``,
    ``post_feedforward_layernorm``) or both (``"both"``, Gemma 3: ``input_layernorm`` and
    ``pre_feedforward_layernorm`` before, ``post_attention_layernorm`` and
    ``post_feedforward_layernorm`` after), each output multiplied by ``residual_scale``
    (Granite) where that is not 1.

    Args:
        config: The model's shape.
        dtype: The weights' dtype.
        device: Where they live.
        index: The layer's place in the stack (``config.nope_layers`` name the layers that
            do not rotate).
    """

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device, index: int = 0
    ) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.pre_norm = config.norm_placement == "pre"
        self.sandwich = config.norm_placement == "both"
        self.residual_scale = config.residual_scale

        def norm() -> RMSNorm:
            return RMSNorm(hidden, eps, dtype=dtype, device=device, offset=config.norm_offset)

        if self.pre_norm or self.sandwich:
            self.input_layernorm = norm()
        rotates = index not in config.nope_layers
        self.self_attn = Attention(
            config, dtype=dtype, device=device, rotates=rotates, window=config.window_of(index)
        )
        self.post_attention_layernorm = norm()
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
        if not self.pre_norm:
            self.post_feedforward_layernorm = norm()
        # A mixture of experts where the configuration says (it computes as MLP does:
        # mlp(x, glue)); its checkpoint names are its own (CausalLM._experts_target).
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, dtype=dtype, device=device)
            if config.sparse(index)
            else MLP(config, dtype=dtype, device=device)
        )

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
        if self.sandwich:
            return self._sandwich(residual, delta, cos, signed_sin, metadata, layer, glue)
        if not self.pre_norm:
            return self._post_norm(residual, delta, cos, signed_sin, metadata, layer, glue)
        first, second = self.input_layernorm, self.post_attention_layernorm
        normed = glue.add_rms_norm(residual, delta, first.weight, first.eps)
        attended: torch.Tensor = self.self_attn(normed, cos, signed_sin, metadata, layer, glue)
        if self.residual_scale != 1.0:
            attended.mul_(self.residual_scale)  # transformers' residual + out * multiplier
        normed = glue.add_rms_norm(residual, attended, second.weight, second.eps)
        mixed: torch.Tensor = self.mlp(normed, glue)
        if self.residual_scale != 1.0:
            mixed.mul_(self.residual_scale)
        return mixed

    def _post_norm(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
        glue: Glue,
    ) -> torch.Tensor:
        """OLMo 2's layer: each block reads the stream as it is, and its output is
        normalized before it is added (``add_rms_norm`` without a delta is the norm alone);
        returns the MLP's normalized output, which the next layer adds."""
        if delta is not None:
            residual.add_(delta)
        first, second = self.post_attention_layernorm, self.post_feedforward_layernorm
        attended: torch.Tensor = self.self_attn(residual, cos, signed_sin, metadata, layer, glue)
        residual.add_(glue.add_rms_norm(attended, None, first.weight, first.eps))
        mixed: torch.Tensor = self.mlp(residual, glue)
        return glue.add_rms_norm(mixed, None, second.weight, second.eps)

    def _sandwich(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
        glue: Glue,
    ) -> torch.Tensor:
        """Gemma 3's layer: each block's input normalized and its output normalized before
        it is added; returns the MLP's normalized output, which the next layer adds. Its
        norms say how they compute (:meth:`RMSNorm.add_norm
        <twostroke.engine.models.layers.RMSNorm.add_norm>`)."""
        normed = self.input_layernorm.add_norm(residual, delta, glue)
        attended: torch.Tensor = self.self_attn(normed, cos, signed_sin, metadata, layer, glue)
        attended = self.post_attention_layernorm(attended)
        normed = self.pre_feedforward_layernorm.add_norm(residual, attended, glue)
        mixed: torch.Tensor = self.post_feedforward_layernorm(self.mlp(normed, glue))
        return mixed
