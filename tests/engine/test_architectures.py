"""Every architecture through the whole engine, as a user opens it: a model folder of
transformers' own class (tiny, random, SmolLM2's tokenizer), ``Engine.open(model=folder)``
with the fast plan, and one answer per request whatever runs beside it (docs/models.md,
"One answer per request"): the same tokens and logprobs alone and among other requests, in
a small step budget that chunks prompts, with prefix-cache hits, a pool small enough to
preempt, drafts by prompt lookup, and either pipeline depth.

The per-architecture arithmetic is proven against transformers and llama.cpp in
tests/engine/models/test_<arch>.py; this is about the paths around it. A mixture of experts
answers so with deterministic=True (each row multiplied by its experts alone).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import transformers

from tests.engine.models import parity
from twostroke.engine import Engine
from twostroke.engine.synthetic.tokenizer import save_tokenizer
from twostroke.states.errors import RequestRejected
from twostroke.states.params import SamplingParams

# One backend: the engine's backends are the toy tests' subject; each case opens several
# engines over a real (tiny) model.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.anyio,
    pytest.mark.parametrize("anyio_backend", ["asyncio"]),
]

#: Each architecture's transformers classes and the fields that switch its features on.
ARCHITECTURES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
    "granite": (
        transformers.GraniteConfig,
        transformers.GraniteForCausalLM,
        {
            "embedding_multiplier": 3.0,
            "attention_multiplier": 0.2,
            "residual_multiplier": 0.5,
            "logits_scaling": 4.0,
        },
    ),
    "smollm3": (
        transformers.SmolLM3Config,
        transformers.SmolLM3ForCausalLM,
        {"num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 1]},
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {"head_dim": 16, "sliding_window": 12, "layer_types": None, "sliding_window_pattern": 2},
    ),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"partial_rotary_factor": 0.5}),
    # Mixtures of experts: deterministic=True multiplies each row by its experts alone.
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # A window shorter than the prompts: the windowed attention on every path.
    "mistral-window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": 12},
    ),
}

#: SmolLM2's vocabulary, so its tokenizer drives the model.
VOCABULARY = 49152

PROMPTS = (
    "Repeat this exactly: the quick brown fox jumps over the lazy dog, the quick brown fox.",
    "Repeat this exactly: the quick brown fox sleeps.",
    "def fibonacci(n):",
)
KINDS = {
    "greedy": SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=10, temperature=0.9, seed=5, logprobs=2, ignore_eos=True),
}
#: (engine options, crowd of (prompt, tokens) requests beside the targets).
SITUATIONS: dict[str, tuple[dict[str, Any], list[tuple[int, int]]]] = {
    "chunked-cached-drafted": (
        {
            "max_num_batched_tokens": 8,
            "enable_prefix_caching": True,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
        },
        [(0, 12), (1, 7), (2, 9)],
    ),
    "preempted-serial": (
        # Blocks of 16: each target takes 2-3, so six requests contend for 8.
        {"num_blocks": 8, "pipeline_depth": 1, "enable_prefix_caching": False},
        [(2, 14), (0, 6), (1, 11)],
    ),
}

Answer = tuple[tuple[int, ...], tuple[Any, ...]]


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    config_class, model_class, fields = ARCHITECTURES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    parity.make_model(config_class, model_class, path, seed=7, vocab_size=VOCABULARY, **fields)
    save_tokenizer(path)
    return str(path)


def answer_of(output: Any) -> Answer:
    return output.token_ids, tuple(attrs.astuple(entry) for entry in output.logprobs)


async def answers(
    folder: str, targets: list[tuple[int, str]], crowd: list[tuple[int, int]], **options: Any
) -> list[Answer]:
    """The targets' answers, submitted at once beside the crowd's requests; with no crowd,
    one at a time, each alone in the engine."""
    found: dict[int, Answer] = {}
    async with Engine.open(model=folder, device="cpu", deterministic=True, **options) as engine:
        assert engine.deterministic

        async def target(index: int) -> None:
            prompt, kind = targets[index]
            found[index] = answer_of(await engine.generate(PROMPTS[prompt], KINDS[kind]))

        async def other(prompt: int, tokens: int) -> None:
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            await engine.generate(PROMPTS[prompt], params)

        if not crowd:
            for index in range(len(targets)):
                await target(index)
            return [found[index] for index in range(len(targets))]
        async with anyio.create_task_group() as group:
            for prompt, tokens in crowd:
                group.start_soon(other, prompt, tokens)
            for index in range(len(targets)):
                group.start_soon(target, index)
    return [found[index] for index in range(len(targets))]


@pytest.mark.timeout(300)
async def test_an_answer_is_the_same_whatever_runs_beside_it(model_folder: str) -> None:
    targets = [(0, "greedy"), (1, "seeded"), (2, "greedy")]
    expected = await answers(model_folder, targets, [], enable_prefix_caching=False)
    assert all(len(tokens) == 10 for tokens, _ in expected)
    for name, (options, crowd) in SITUATIONS.items():
        got = await answers(model_folder, targets, crowd, **options)
        for index, (answer, wanted) in enumerate(zip(got, expected, strict=True)):
            assert answer == wanted, f"{Path(model_folder).name}, {name}: target {index}"


async def _two_at_once(folder: str) -> tuple[list[Any], int]:
    """Two greedy requests of 44 positions each (11 blocks of 4) at once, in a pool of 12:
    their outputs, and the preemptions it took."""
    outputs: list[Any] = [None, None]
    options = {"block_size": 4, "num_blocks": 12, "max_num_batched_tokens": 8}
    async with Engine.open(
        model=folder, device="cpu", dtype="float32", enable_prefix_caching=False, **options
    ) as engine:

        async def one(index: int) -> None:
            steps = 44 - len(engine.tokenizer.encode(PROMPTS[index]))
            params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
            outputs[index] = await engine.generate(PROMPTS[index], params)

        async with anyio.create_task_group() as group:
            for index in range(2):
                group.start_soon(one, index)
        return outputs, engine.statistics().num_preemptions


def _mistral(tmp_path: Path, window: int | None) -> tuple[Path, Any]:
    """A tiny Mistral folder (SmolLM2's tokenizer) with that window, and transformers' model."""
    folder = tmp_path / f"window-{window}"
    reference = parity.make_model(
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        folder,
        seed=7,
        vocab_size=VOCABULARY,
        sliding_window=window,
    )
    save_tokenizer(folder)
    return folder, reference


@pytest.mark.timeout(300)
async def test_a_windowed_model_gives_back_its_blocks_and_keeps_transformers_tokens(
    tmp_path: Path,
) -> None:
    """Mistral with a window of 8: each request holds only its window's blocks (and its
    chunk's), so two that need 11 blocks of 4 each whole share a pool of 12 without a
    preemption, where the same model without a window preempts; and each answer is
    transformers' greedy one, the positions behind the window padded in its tables."""
    found = {}
    for window in (8, None):
        folder, reference = _mistral(tmp_path, window)
        outputs, preemptions = await _two_at_once(str(folder))
        found[window] = preemptions
        for output in outputs:
            prompt = list(output.prompt_token_ids)
            steps = len(output.token_ids)
            assert len(prompt) + steps == 44
            expected = parity.greedy(reference, prompt, steps=steps)[len(prompt) :]
            assert list(output.token_ids) == expected
    assert found[8] == 0
    assert found[None] > 0


@pytest.mark.timeout(300)
async def test_a_windowed_request_longer_than_the_pool_is_served(tmp_path: Path) -> None:
    """Mistral with a window of 8 and steps of 8 tokens: a request of 44 positions (11
    blocks of 4 whole) holds at most blocks_for(7 + 8) + 1 = 5 at once, so a pool of 5 takes
    it and gives transformers' greedy tokens; without the window it is refused."""
    for window in (8, None):
        folder, reference = _mistral(tmp_path, window)
        options = {"block_size": 4, "num_blocks": 5, "max_num_batched_tokens": 8}
        async with Engine.open(
            model=str(folder), device="cpu", dtype="float32", **options
        ) as engine:
            steps = 44 - len(engine.tokenizer.encode(PROMPTS[0]))
            params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
            if window is None:
                with pytest.raises(RequestRejected, match="needs 11 KV blocks of 4"):
                    await engine.generate(PROMPTS[0], params)
                continue
            output = await engine.generate(PROMPTS[0], params)
        prompt = list(output.prompt_token_ids)
        assert (
            list(output.token_ids) == parity.greedy(reference, prompt, steps=steps)[len(prompt) :]
        )


@pytest.mark.timeout(300)
async def test_gemma3s_windowed_layers_keep_their_window_apart_unless_swa_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """By default the engine keeps the windowed layers' KV to their window, apart, and runs
    without prefix caching (it says so once); swa_full=True keeps every position and the
    cache. The tokens are transformers' greedy ones either way, two requests at once."""
    folder = tmp_path / "gemma3"
    reference = parity.make_model(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        folder,
        seed=7,
        vocab_size=VOCABULARY,
        head_dim=16,
        sliding_window=8,
        layer_types=None,
        sliding_window_pattern=2,
    )
    save_tokenizer(folder)
    caplog.set_level(logging.INFO, logger="twostroke.engine.engine")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    found: dict[bool, list[list[int]]] = {}
    for swa_full in (False, True):
        outputs: list[Any] = [None, None]
        async with Engine.open(
            model=str(folder),
            device="cpu",
            dtype="float32",
            block_size=4,
            max_num_batched_tokens=8,
            swa_full=swa_full,
        ) as engine:
            assert engine.config.enable_prefix_caching is swa_full

            async def one(index: int, into: list[Any]) -> None:
                into[index] = await engine.generate(PROMPTS[index], params)

            async with anyio.create_task_group() as group:
                for index in range(2):
                    group.start_soon(one, index, outputs)
        found[swa_full] = [list(output.token_ids) for output in outputs]
        for output in outputs:
            prompt = list(output.prompt_token_ids)
            expected = parity.greedy(reference, prompt, steps=24)[len(prompt) :]
            assert list(output.token_ids) == expected
    assert found[False] == found[True]
    said = [r.getMessage() for r in caplog.records if "keep only their window" in r.getMessage()]
    assert len(said) == 1
    assert "prefix caching off (swa_full=True keeps it)" in said[0]
