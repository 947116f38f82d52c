"""Prefix caching on a real model: a request whose first chunk starts past a cached prefix
(position ``start > 0`` with earlier positions already in the KV cache) computes the same
greedy tokens as one that computes everything."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.models.test_llama import make_tiny_model, random_sequences
from tests.engine.runners.test_torch import CPU, generate, transformers_greedy
from twostroke.engine.models.loading import open_model
from twostroke.engine.text.tokenizer import HFTokenizer
from twostroke.states.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny llama, and prompts that share a 26-token prefix (6 blocks of 4 and a half)."""
    path = tmp_path_factory.mktemp("llama")
    reference = make_tiny_model("llama", path, seed=31)
    prefix, *suffixes = random_sequences([26, 3, 1, 7, 5], seed=32)
    prompts = [prefix + suffix for suffix in suffixes] + [prefix[:13]]
    return reference, open_model(path, dtype=torch.float32, device=CPU), prompts


@pytest.mark.parametrize("pipeline_depth", [2, 1])
def test_hits_give_the_tokens_of_a_full_computation(shared: Any, pipeline_depth: int) -> None:
    reference, loaded, prompts = shared
    arrivals = [0, 3, 3, 6, 9]  # the first request's blocks are cached before the others come
    options = {"arrivals": arrivals, "pipeline_depth": pipeline_depth, "block_size": 4}
    params = [GREEDY] * len(prompts)
    cached = generate(loaded, prompts, params, **options)
    plain = generate(loaded, prompts, params, enable_prefix_caching=False, **options)
    assert cached.tokens == plain.tokens
    stats = cached.statistics
    # Requests 1 to 3 each skip the 24 tokens of the six full shared blocks, request 4 the
    # 12 of its three.
    assert stats.num_prefix_cache_hits == 3 * 24 + 12
    assert stats.num_tokens_scheduled < plain.statistics.num_tokens_scheduled
    for index, prompt in enumerate(prompts):
        assert cached.tokens[index] == transformers_greedy(reference, prompt)[:12]


def test_a_preempted_request_resumes_from_its_cached_blocks(shared: Any) -> None:
    _, loaded, prompts = shared
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    options = {"num_blocks": 14, "block_size": 4, "max_num_batched_tokens": 16}
    cached = generate(loaded, prompts, params, **options)
    plain = generate(loaded, prompts, params, enable_prefix_caching=False, **options)
    assert cached.statistics.num_preemptions > 0
    assert cached.statistics.num_prefix_cache_hits > 0
    assert cached.tokens == plain.tokens


SYSTEM = (
    "You are a meticulous assistant for a maritime museum. Answer in one short paragraph, "
    "name sources where you can, never invent dates, and keep a friendly, plain tone. "
    "Visitors are often children, so avoid jargon and explain any term you must use. "
    "If a question is about opening hours or tickets, point them to the front desk instead."
)
QUESTIONS = [
    "What is a lighthouse for?",
    "Why do ships have round windows?",
    "How did sailors find their way before GPS?",
    "What is the capital of France?",
]


@pytest.mark.slow
def test_smollm2_fp32_greedy_tokens_are_the_same_with_a_shared_system_prompt() -> None:
    """SmolLM2 in fp32 at depth 2: a long system prompt is computed once, the tokens do not
    change.

    The prompts come from the engine's own tokenizer (tests/engine/text/test_tokenizer.py
    holds its chat template and decoding equal to transformers'): transformers'
    ``AutoTokenizer`` parsed the whole GGUF again for its configuration (this test took
    26.2 s with it, 17.2 s without, 2 AVX2 cores, load average 1.4-2.3).
    """
    pytest.importorskip("transformers")
    loaded = open_model("smollm2", dtype=torch.float32, device=CPU)
    tokenizer = HFTokenizer.from_pretrained(loaded.source)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        )
        for question in QUESTIONS
    ]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    options = {
        "arrivals": [0, 2, 2, 4],
        "block_size": 16,
        "num_blocks": 64,
        "max_num_batched_tokens": 64,
        "pipeline_depth": 2,
    }
    cached = generate(loaded, prompts, params, **options)
    plain = generate(loaded, prompts, params, enable_prefix_caching=False, **options)
    assert cached.tokens == plain.tokens
    stats = cached.statistics
    shared = min(
        next(i for i, (a, b) in enumerate(zip(prompts[0], p, strict=False)) if a != b)
        for p in prompts[1:]
    )
    assert shared > 64  # the system prompt is long
    assert stats.num_prefix_cache_hits >= 3 * (shared // 16) * 16
    assert "Paris" in tokenizer.decode(cached.tokens[3])
