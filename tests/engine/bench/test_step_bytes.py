"""The bytes of one step, counted by hand term by term, and the weights a loaded model holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from twostroke.engine.bench.cost import ModelCost, RowShape
from twostroke.engine.models.config import ModelConfig

# 2 layers, hidden 64, 4 query heads and 2 KV heads of 16, MLP 128, vocabulary 256, an output
# projection of its own (transformers' LlamaConfig default): the shape of the loaded model below.
SMALL = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def test_one_decode_step_of_three_rows_by_hand() -> None:
    """Three decode rows at positions 10, 20 and 30, each sampling, in float32 (4 bytes)."""
    step = ModelCost.of(SMALL, dtype="float32").step(
        [RowShape(start=10, num_tokens=1), RowShape(20, 1), RowShape(30, 1)]
    )
    # Weights, once: each layer's q 64x64, k 16*2x64, v 32x64, o 64x64, gate 128x64, up 128x64
    # and down 64x128, and its two norms of 64; then the final norm of 64 and the output
    # projection of 256x64 (the embedding is not streamed: only the rows looked up).
    weights = 4 * (
        2 * (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 128 * 64 + 128 * 64 + 64 * 128 + 2 * 64)
        + 64
        + 256 * 64
    )
    # KV read: each row's history, 10 + 20 + 30 positions of a key and a value of 2 heads of 16
    # in 2 layers.
    kv_read = (10 + 20 + 30) * 2 * 2 * (2 * 16) * 4
    # KV written: one new position per row.
    kv_written = 3 * 2 * 2 * (2 * 16) * 4
    # Activations, per token and layer: the layer's input row read by q/k/v (64) and by
    # gate/up (64), q, k, v written (64 + 32 + 32), o's input read (64) and output written
    # (64), gate and up written (128 + 128), down's input read (128) and output written (64);
    # per sampled row, the final hidden row read (64) and its logits written (256).
    per_layer = 64 + 64 + (64 + 32 + 32) + (64 + 64) + (128 + 128) + (128 + 64)
    activations = 3 * 2 * per_layer * 4 + 3 * (64 + 256) * 4
    # Embedding rows: one of 64 looked up per token.
    embedding_rows = 3 * 64 * 4
    assert weights == 361_728
    assert per_layer == 832
    assert step.bytes == weights + kv_read + kv_written + activations + embedding_rows
    assert step.bytes == 361_728 + 30_720 + 1_536 + (19_968 + 3_840) + 768


@pytest.mark.usefixtures("one_torch_thread")
def test_the_weight_bytes_are_what_a_loaded_model_holds(tmp_path: Path) -> None:
    """A random transformers Llama of the shape above, loaded by twostroke in float32: the
    bytes of its module's parameters and buffers, less the embedding, are the cost model's
    weight bytes. The embedding is the one deliberate difference: a step reads only the rows
    it looks up (``embedding_row_bytes`` a token), never the whole table. The rotary tables
    are no buffers of the module (they are made per step from the positions), so nothing
    else is left out."""
    from tests.engine.models.test_llama import make_tiny_model
    from twostroke.engine.models.loading import open_model

    make_tiny_model("llama", tmp_path, num_hidden_layers=2)
    loaded = open_model(tmp_path, device=torch.device("cpu"), dtype=torch.float32, exact=True)
    assert loaded.config == SMALL
    module = loaded.module
    held = {
        name: tensor.numel() * tensor.element_size()
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    }
    embedding = held.pop("embed_tokens")
    cost = ModelCost.of(loaded.config, dtype="float32")
    assert embedding == 256 * cost.embedding_row_bytes
    assert sum(held.values()) == cost.weight_bytes
