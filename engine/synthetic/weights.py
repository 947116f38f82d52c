"""A synthetic model's tensors: their transformers names, shapes and how each is drawn.

Every tensor is drawn on its own, from a generator seeded by the model's seed and the
tensor's name, so a writer makes one tensor at a time (a 4 B model never sits in memory)
and both formats of one shape and seed hold the same numbers.

**Scaled like an initializer, so activations stay in range.** A matrix that reads a vector
of unit scale gets std ``1/sqrt(fan_in)`` (its outputs keep unit scale, as a trained model's
do after each norm); the two that write into the residual stream (``o_proj``,
``down_proj``) get that over ``sqrt(2 * layers)`` as well (GPT-2's residual scaling), so the
stream grows to a few units over the depth rather than by ``sqrt`` of it per layer; the
embedding (and an untied ``lm_head``) gets ``1/sqrt(hidden)``, so logits have unit scale.
Norm weights are one: Gemma's norms scale by ``1 + weight``, so theirs are stored as zero
(and llama.cpp's converter stores them plus one, one again).

**A mixture of experts** is one router (``mlp.gate``) and each expert's SwiGLU under its own
names (``mlp.experts.N.gate_proj``, as the released checkpoints have them), each expert
drawn as a dense MLP of its width is. The router reads the normed stream like any matrix
(std ``1/sqrt(hidden)``): its logits have unit scale, so each token's top-k differs from its
neighbours' and every expert gets some tokens, where a larger scale would make each token's
pick a near one-hot and a smaller one a near tie.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import attrs
import torch

from twostroke.engine.synthetic.shapes import SMOLLM2_VOCAB_SIZE, Shape

__all__ = ["TensorSpec", "draw", "tensor_specs"]


@attrs.frozen
class TensorSpec:
    """One tensor of a shape's checkpoint.

    Attributes:
        name: transformers' name (``"model.layers.0.self_attn.q_proj.weight"``).
        shape: Its shape, as transformers stores it (out features first).
        std: The normal distribution's standard deviation; 0 for a constant.
        fill: The constant of a norm weight (``std == 0``).
    """

    name: str
    shape: tuple[int, ...]
    std: float = 0.0
    fill: float = 0.0

    @property
    def numel(self) -> int:
        """How many numbers it holds."""
        return math.prod(self.shape)


def tensor_specs(shape: Shape) -> list[TensorSpec]:
    """Every tensor of ``shape``'s checkpoint, in transformers' names and order of layers.

    Args:
        shape: The shape.

    Returns:
        The embedding, each layer's tensors, the final norm and (untied) ``lm_head``.
    """
    hidden, layers = shape.hidden_size, shape.num_layers
    q_rows = shape.num_heads * shape.head_dim
    kv_rows = shape.num_kv_heads * shape.head_dim
    norm = 0.0 if shape.family == "gemma3" else 1.0
    read = 1 / math.sqrt(hidden)
    residual = 1 / math.sqrt(2 * layers)
    specs = [TensorSpec("model.embed_tokens.weight", (SMOLLM2_VOCAB_SIZE, hidden), read)]
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        specs.append(TensorSpec(f"{prefix}.input_layernorm.weight", (hidden,), fill=norm))
        if shape.family == "phi3":
            specs.append(
                TensorSpec(
                    f"{prefix}.self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, hidden), read
                )
            )
        else:
            specs += [
                TensorSpec(f"{prefix}.self_attn.q_proj.weight", (q_rows, hidden), read),
                TensorSpec(f"{prefix}.self_attn.k_proj.weight", (kv_rows, hidden), read),
                TensorSpec(f"{prefix}.self_attn.v_proj.weight", (kv_rows, hidden), read),
            ]
        if shape.family in ("qwen3", "gemma3", "qwen3moe"):
            specs += [
                TensorSpec(f"{prefix}.self_attn.q_norm.weight", (shape.head_dim,), fill=norm),
                TensorSpec(f"{prefix}.self_attn.k_norm.weight", (shape.head_dim,), fill=norm),
            ]
        elif shape.family == "olmoe":  # over the whole projection, not per head
            specs += [
                TensorSpec(f"{prefix}.self_attn.q_norm.weight", (q_rows,), fill=norm),
                TensorSpec(f"{prefix}.self_attn.k_norm.weight", (kv_rows,), fill=norm),
            ]
        specs.append(
            TensorSpec(
                f"{prefix}.self_attn.o_proj.weight",
                (hidden, q_rows),
                residual / math.sqrt(q_rows),
            )
        )
        specs.append(TensorSpec(f"{prefix}.post_attention_layernorm.weight", (hidden,), fill=norm))
        if shape.family == "gemma3":
            specs += [
                TensorSpec(f"{prefix}.pre_feedforward_layernorm.weight", (hidden,), fill=norm),
                TensorSpec(f"{prefix}.post_feedforward_layernorm.weight", (hidden,), fill=norm),
            ]
        if shape.num_experts:
            specs += _expert_specs(shape, prefix, read, residual)
        else:
            specs += _mlp_specs(shape, prefix, read, residual)
    specs.append(TensorSpec("model.norm.weight", (hidden,), fill=norm))
    if not shape.tied:
        specs.append(TensorSpec("lm_head.weight", (SMOLLM2_VOCAB_SIZE, hidden), read))
    return specs


def _mlp_specs(shape: Shape, prefix: str, read: float, residual: float) -> list[TensorSpec]:
    """One layer's dense SwiGLU (Phi-3's gate and up fused, as its checkpoint has them)."""
    hidden, inner = shape.hidden_size, shape.intermediate_size
    if shape.family == "phi3":
        specs = [TensorSpec(f"{prefix}.mlp.gate_up_proj.weight", (2 * inner, hidden), read)]
    else:
        specs = [
            TensorSpec(f"{prefix}.mlp.gate_proj.weight", (inner, hidden), read),
            TensorSpec(f"{prefix}.mlp.up_proj.weight", (inner, hidden), read),
        ]
    specs.append(
        TensorSpec(f"{prefix}.mlp.down_proj.weight", (hidden, inner), residual / math.sqrt(inner))
    )
    return specs


def _expert_specs(shape: Shape, prefix: str, read: float, residual: float) -> list[TensorSpec]:
    """One layer's mixture: its router, then each expert's gate, up and down."""
    hidden, width = shape.hidden_size, shape.expert_intermediate_size
    specs = [TensorSpec(f"{prefix}.mlp.gate.weight", (shape.num_experts, hidden), read)]
    for expert in range(shape.num_experts):
        stem = f"{prefix}.mlp.experts.{expert}"
        specs += [
            TensorSpec(f"{stem}.gate_proj.weight", (width, hidden), read),
            TensorSpec(f"{stem}.up_proj.weight", (width, hidden), read),
            TensorSpec(f"{stem}.down_proj.weight", (hidden, width), residual / math.sqrt(width)),
        ]
    return specs


def draw(spec: TensorSpec, seed: int) -> torch.Tensor:
    """``spec``'s tensor in float32, the same for the same seed on every machine.

    Args:
        spec: The tensor.
        seed: The model's seed.

    Returns:
        A new float32 tensor of ``spec.shape``.
    """
    if spec.std == 0.0:
        return torch.full(spec.shape, spec.fill, dtype=torch.float32)
    generator = torch.Generator().manual_seed((seed << 32) ^ zlib.crc32(spec.name.encode()))
    tensor = torch.randn(spec.shape, generator=generator, dtype=torch.float32)
    return tensor.mul_(spec.std)


def iter_drawn(shape: Shape, seed: int) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Each of ``shape``'s tensors with its values, one at a time."""
    for spec in tensor_specs(shape):
        yield spec, draw(spec, seed)
