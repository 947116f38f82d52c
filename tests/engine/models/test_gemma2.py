"""Gemma 2 against transformers and llama.cpp: every other layer windowed, four (1 + weight)
norms a layer, a gelu-tanh MLP, embeddings times sqrt(hidden_size), query_pre_attn_scalar,
and soft-capped attention scores and logits (caps small enough to bite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import transformers

from tests.engine.models import parity
from tests.engine.models.test_llama import random_sequences
from twostroke.engine.models.choice import select_kernels
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.loading import LoadedModel, open_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Scores and logits capped low: the tiny model's scores reach past 5 (checked below).
ATTN_CAP, FINAL_CAP = 5.0, 3.0


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, LoadedModel]:
    """Four layers (llama.cpp's rule and transformers' default alike: the odd ones global),
    windows of 6 positions on prompts of up to 40, head_dim as query_pre_attn_scalar (the
    value a GGUF file implies), the output projection tied (llama.cpp's gemma2 has no
    other)."""
    path = tmp_path_factory.mktemp("gemma2")
    reference = parity.make_model(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        path,
        norms=(-0.5, 0.5),
        num_hidden_layers=4,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=6,
        attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        attn_implementation="eager",
    )
    return reference, path, open_model(path, dtype=torch.float32, device=parity.CPU)


def test_the_config_is_read_as_transformers_reads_it(
    gemma2: tuple[Any, Path, LoadedModel],
) -> None:
    reference, _, loaded = gemma2
    config = loaded.config
    assert config.architecture == "Gemma2ForCausalLM"
    assert (config.sliding_window, config.global_layers) == (6, (1, 3))
    assert reference.config.layer_types == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ]
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (5.0, 3.0)
    assert (config.qk_norm, config.norm_placement, config.norm_offset) == ("none", "both", 1.0)
    assert config.attention_scale == 16**-0.5
    assert config.local_rope_theta is None


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_logits_match_transformers(
    gemma2: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = gemma2
    parity.check_logits(reference, loaded, chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_greedy_tokens_match_transformers(
    gemma2: tuple[Any, Path, LoadedModel], chunk_size: int | None
) -> None:
    reference, _, loaded = gemma2
    parity.check_greedy(reference, loaded, chunk_size)


def test_the_score_cap_bites(gemma2: tuple[Any, Path, LoadedModel]) -> None:
    """Without the score cap (each layer's, put back after) the same model's logits are far
    from transformers': the parity above would catch an attention that dropped it."""
    reference, _, loaded = gemma2
    module = loaded.module
    config = module.config
    sequences = random_sequences([40])
    [capped] = module.forward_logits(sequences)
    attentions = [layer.self_attn for layer in module.layers]
    try:
        for attention in attentions:
            attention.softcap = None
        [plain] = module.forward_logits(sequences)
    finally:
        for attention in attentions:
            attention.softcap = config.attn_logit_softcapping
    expected = parity.reference_logits(reference, sequences[0])
    torch.testing.assert_close(capped, expected, atol=1e-4, rtol=0)
    assert (plain - expected).abs().max() > 1e-2


def test_the_plan_attends_with_a_kernel_that_caps_scores(
    gemma2: tuple[Any, Path, LoadedModel],
) -> None:
    _, path, loaded = gemma2
    assert loaded.plan.kernels.attention == "matmul"
    fastest = open_model(path, dtype=torch.bfloat16, device=parity.CPU, exact=False)
    line = fastest.plan.describe()
    assert "attention matmul (the other kernels do not soft-cap attention scores)" in line
    parity.check_plan(path)


@pytest.mark.parametrize("asked", ["bag", "sdpa", "native"])
def test_a_kernel_that_cannot_cap_scores_is_refused(
    gemma2: tuple[Any, Path, LoadedModel], asked: Any
) -> None:
    config = gemma2[2].config
    with pytest.raises(
        ValueError,
        match=r"attention_kernel must be 'matmul' or None for a model whose attention scores "
        rf"are soft-capped \(attn_logit_softcapping=5.0\): only it caps scores, got '{asked}'",
    ):
        select_kernels(config, dtype=torch.float32, device=parity.CPU, exact=True, attention=asked)


def test_the_attention_refuses_to_drop_the_cap(gemma2: tuple[Any, Path, LoadedModel]) -> None:
    """A model made to attend with another kernel than its plan's fails rather than
    answering without the cap."""
    module = gemma2[2].module
    with pytest.raises(
        ValueError,
        match=r"soft-capped scores need the 'matmul' attention kernel \(the others do not "
        r"compute the scores in torch's operators\), got 'bag'",
    ):
        module.forward_logits(random_sequences([5]), kernel="bag")


def test_bfloat16_tracks_float32(gemma2: tuple[Any, Path, LoadedModel]) -> None:
    _, path, loaded = gemma2
    parity.check_bfloat16(path, loaded)


def test_the_gguf_file_reads_as_the_checkpoint(
    gemma2: tuple[Any, Path, LoadedModel], tmp_path: Path
) -> None:
    """The GGUF reading (llama.cpp's gemma2 names and keys) is its config.json's, but for
    the norms' offset (the file stores weight + 1), and computes the same logits."""
    from tests.engine.models.llamacpp_reference import write_gguf

    reference, _, loaded = gemma2
    path = tmp_path / "gemma2.gguf"
    write_gguf(path, reference, "gemma2")
    from_file = open_model(path, dtype=torch.float32, device=parity.CPU)
    ignored = ("bos_token_id", "eos_token_ids", "norm_offset", "rms_norm_eps")
    theirs = {k: v for k, v in from_file.config.to_dict().items() if k not in ignored}
    ours = {k: v for k, v in loaded.config.to_dict().items() if k not in ignored}
    assert theirs == ours
    assert from_file.config.norm_offset == 0.0
    assert from_file.plan.kernels.attention == "matmul"
    sequences = random_sequences([30], seed=3)
    [mine] = from_file.module.forward_logits(sequences, chunk_size=4)
    [expected] = loaded.module.forward_logits(sequences, chunk_size=4)
    torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("matrices", "exact"), [("f32", True), ("q8_0", True), ("q8_0", False)])
def test_logits_match_llamacpp(
    gemma2: tuple[Any, Path, LoadedModel], matrices: str, exact: bool, tmp_path: Path
) -> None:
    reference, _, _ = gemma2
    # ggml's float32 GELU rounds its input to float16 and reads a table, as for Gemma 3.
    parity.check_llamacpp(reference, "gemma2", tmp_path, matrices, exact=exact, f32_bound=3e-3)


GEMMA2_JSON: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "vocab_size": 8,
    "hidden_size": 16,
    "intermediate_size": 8,
    "num_hidden_layers": 5,
    "num_attention_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "sliding_window": 4,
}


def test_gemma2_config_defaults_are_transformers() -> None:
    """Gemma2Config's defaults for what the file leaves out: the odd layers global, scores
    capped at 50 and logits at 30, query_pre_attn_scalar 256, one rotary base."""
    config = ModelConfig.from_hf_config(GEMMA2_JSON)
    assert config.global_layers == (1, 3)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.attention_scale == 256**-0.5
    assert config.embedding_scale == 4.0
    assert (config.rope_theta, config.local_rope_theta) == (1e4, None)
    assert config.tie_word_embeddings
    assert "soft-capped attention scores" in config.departures
    uncapped = ModelConfig.from_hf_config({**GEMMA2_JSON, "attn_logit_softcapping": None})
    assert uncapped.attn_logit_softcapping is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_activation", "gelu", r"hidden_activation must be 'gelu_pytorch_tanh', got 'gelu'"),
        (
            "use_bidirectional_attention",
            True,
            r"use_bidirectional_attention must be false: twostroke decodes causally",
        ),
        (
            "attn_logit_softcapping",
            -1.0,
            r"attn_logit_softcapping must be > 0, got -1.0",
        ),
    ],
)
def test_what_twostroke_does_not_compute_is_refused(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**GEMMA2_JSON, field: value})


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_the_engine_answers_transformers_greedy_tokens(
    tmp_path: Path, anyio_backend: Any
) -> None:
    """Through the whole engine (chunked prompts, batched decodes, the plan's kernels), a
    soft-capped model's greedy answers are transformers' own, prompts past the window."""
    from twostroke.engine import Engine
    from twostroke.engine.synthetic.tokenizer import save_tokenizer
    from twostroke.states.params import SamplingParams

    reference = parity.make_model(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        tmp_path,
        seed=7,
        norms=(-0.5, 0.5),
        vocab_size=49152,  # SmolLM2's tokenizer drives it
        head_dim=16,
        sliding_window=6,
        attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP,
        attn_implementation="eager",
    )
    save_tokenizer(tmp_path)
    prompts = ("Repeat this exactly: the quick brown fox jumps over the lazy dog.", "def f(n):")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs: list[Any] = [None, None]
    async with Engine.open(
        model=str(tmp_path), device="cpu", dtype="float32", max_num_batched_tokens=8
    ) as engine:
        assert engine.plan is not None
        assert engine.plan.kernels.attention == "matmul"

        async def one(index: int) -> None:
            outputs[index] = await engine.generate(prompts[index], params)

        async with anyio.create_task_group() as group:
            for index in range(2):
                group.start_soon(one, index)
    for output in outputs:
        prompt = list(output.prompt_token_ids)
        expected = parity.greedy(reference, prompt, steps=12)[len(prompt) :]
        assert list(output.token_ids) == expected
