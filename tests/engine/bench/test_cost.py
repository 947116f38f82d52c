"""The cost model: bytes and FLOPs of a step, counted by hand on small shapes."""

from __future__ import annotations

import attrs
import pytest

from twostroke.engine.bench.cost import ModelCost, RowShape, StepCost
from twostroke.engine.models.config import ModelConfig

# hidden 4, MLP 6, 2 layers, 2 query heads and 1 KV head of width 2, vocabulary 10.
TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=10,
    hidden_size=4,
    intermediate_size=6,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)

# One layer's projections, (out, in): q 4x4, k 2x4, v 2x4, o 4x4, gate 6x4, up 6x4, down 4x6.
LAYER_PARAMS = 4 * 4 + 2 * 4 + 2 * 4 + 4 * 4 + 6 * 4 + 6 * 4 + 4 * 6
OUTPUT_PARAMS = 10 * 4


def test_the_model_constants_in_float32() -> None:
    cost = ModelCost.of(TINY)
    assert LAYER_PARAMS == 120
    assert cost.layer_params == 2 * LAYER_PARAMS
    assert cost.output_params == OUTPUT_PARAMS
    # Per layer: projections and two norms of 4; then the final norm and the output projection.
    assert cost.weight_bytes == 4 * (2 * (LAYER_PARAMS + 2 * 4) + 4 + OUTPUT_PARAMS)
    assert cost.embedding_row_bytes == 4 * 4
    # Keys and values, 2 layers, 1 KV head of 2.
    assert cost.kv_bytes_per_token == 2 * 2 * 1 * 2 * 4
    # QK^T and PV, two FLOPs per multiply-add each, 2 layers, 2 heads of 2.
    assert cost.attention_flops_per_key == 2 * 2 * 2 * (2 * 2)


def test_a_mixed_step_by_hand() -> None:
    cost = ModelCost.of(TINY)
    decode = RowShape(start=5, num_tokens=1)  # reads 5 positions, attends to 6 keys
    prefill = RowShape(start=0, num_tokens=3)  # attends to 1 + 2 + 3 keys
    chunk = RowShape(start=4, num_tokens=2, sample=False)  # attends to 5 + 6 keys, no logits
    step = cost.step([decode, prefill, chunk])
    kv, row, per_key = 32, 16, 32
    # A token's rows through both layers: 4 hidden + 2 q + 2 kv + 3 inner, in float32; a
    # sampled row's final hidden row and logits: hidden + vocab.
    act, head = 2 * 4 * (4 * 4 + 2 * 4 + 2 * 2 + 3 * 6), 4 * (4 + 10)
    assert (cost.activation_bytes_per_token, cost.head_activation_bytes) == (act, head)
    assert step.bytes == (
        cost.weight_bytes
        + ((5 + 1) * kv + 1 * (row + act) + head)
        + (3 * kv + 3 * (row + act) + head)
        + ((4 + 2) * kv + 2 * (row + act))
    )
    assert step.flops == (
        (2 * (2 * LAYER_PARAMS) * 1 + per_key * 6 + 2 * OUTPUT_PARAMS)
        + (2 * (2 * LAYER_PARAMS) * 3 + per_key * (1 + 2 + 3) + 2 * OUTPUT_PARAMS)
        + (2 * (2 * LAYER_PARAMS) * 2 + per_key * (5 + 6))
    )
    assert cost.step([decode]) + cost.step([prefill]) == StepCost(
        2 * cost.weight_bytes + (6 + 3) * kv + 4 * (row + act) + 2 * head,
        cost.step([decode]).flops + cost.step([prefill]).flops,
    )


def test_reduced_precision_weights_and_dtypes() -> None:
    float32 = ModelCost.of(TINY)
    bf16 = ModelCost.of(TINY, dtype="bfloat16")
    assert bf16.weight_bytes * 2 == float32.weight_bytes
    assert bf16.kv_bytes_per_token * 2 == float32.kv_bytes_per_token
    assert bf16.layer_params == float32.layer_params  # FLOPs do not change with bytes
    int8 = ModelCost.of(TINY, quantization="int8")
    # Projections at one byte each plus a float32 scale per output channel; the rest float32.
    outputs = 4 + 2 + 2 + 4 + 6 + 6 + 4
    assert int8.weight_bytes == 2 * (LAYER_PARAMS + 4 * outputs + 4 * 2 * 4) + 4 * (4 + 40)
    fp16 = ModelCost.of(TINY, quantization="fp16")
    assert fp16.weight_bytes == 2 * (2 * LAYER_PARAMS + 4 * 2 * 4) + 4 * (4 + 40)
    # Projections quantized into GGUF blocks at load: a block of 32 weights per row of each
    # (every row here is shorter than a block), 34 bytes in Q8_0 and 18 in Q4_0.
    q8_0 = ModelCost.of(TINY, quantization="q8_0")
    assert q8_0.weight_bytes == 2 * (34 * outputs + 4 * 2 * 4) + 4 * (4 + 40)
    q4_0 = ModelCost.of(TINY, quantization="q4_0")
    assert q4_0.weight_bytes == 2 * (18 * outputs + 4 * 2 * 4) + 4 * (4 + 40)


def test_weights_as_a_file_stores_them() -> None:
    """A model computing a GGUF file's blocks as stored reads their stored bytes: every
    weight once a step, the tied head from the embedding's blocks, and an embedding row its
    share of them; the FLOPs and the KV cache are the dtype's as before."""
    stored = {"model.embed_tokens.weight": 10 * 136, "model.norm.weight": 16}
    for layer in range(2):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            stored[f"model.layers.{layer}.self_attn.{name}.weight"] = 20
        stored[f"model.layers.{layer}.input_layernorm.weight"] = 16
    cost = ModelCost.of(TINY, stored=stored)
    assert cost.weight_bytes == 2 * (7 * 20 + 16) + 16 + 10 * 136  # the head: the embedding
    assert cost.embedding_row_bytes == 136
    plain = ModelCost.of(TINY)
    assert (cost.layer_params, cost.output_params) == (plain.layer_params, plain.output_params)
    assert cost.kv_bytes_per_token == plain.kv_bytes_per_token
    untied = ModelCost.of(
        attrs.evolve(TINY, tie_word_embeddings=False), stored={**stored, "lm_head.weight": 99}
    )
    assert untied.weight_bytes == cost.weight_bytes - 10 * 136 + 99
    with pytest.raises(ValueError, match=r"^the stored weights have no 'lm_head\.weight'$"):
        ModelCost.of(attrs.evolve(TINY, tie_word_embeddings=False), stored=stored)


def test_biases_are_weights_too() -> None:
    import attrs

    biased = attrs.evolve(TINY, qkv_bias=True, o_bias=True, mlp_bias=True)
    # q, k, v: 4 + 2 + 2; o: 4; gate, up: 6 + 6, down: 4; per layer, float32.
    extra = 2 * 4 * ((4 + 2 + 2) + 4 + (6 + 6 + 4))
    assert ModelCost.of(biased).weight_bytes == ModelCost.of(TINY).weight_bytes + extra


def test_smollm2_matches_the_published_sizes() -> None:
    # SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 9 heads and 3 KV heads of 64, 49152 ids.
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    cost = ModelCost.of(config)
    layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576
    assert cost.layer_params == 30 * layer == 106_168_320
    assert cost.output_params == 28_311_552
    assert cost.weight_bytes == 4 * (30 * (layer + 2 * 576) + 576 + 49152 * 576)
    assert cost.attention_flops_per_key == 69_120


def test_bad_arguments() -> None:
    with pytest.raises(
        ValueError, match="dtype must be one of float32, bfloat16, float16, got 'int4'"
    ):
        ModelCost.of(TINY, dtype="int4")
    with pytest.raises(
        ValueError, match="quantization must be None or one of fp16, int8, q8_0, q4_0, got 'q4'"
    ):
        ModelCost.of(TINY, quantization="q4")
    with pytest.raises(ValueError, match="a step must compute at least one row, got none"):
        ModelCost.of(TINY).step([])
    with pytest.raises(ValueError, match="num_tokens must be >= 1, got 0"):
        RowShape(start=0, num_tokens=0)
