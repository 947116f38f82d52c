"""The torch runner verifies drafts (speculative decoding) on a tiny random Llama.

Greedy and seeded requests give exactly the tokens (and log-probabilities) they give without
drafts, whatever the drafts; unseeded sampling keeps the model's distribution, checked by a
chi-square test of the first token and of the first two tokens against the probabilities the
model itself gives.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.models.test_llama import TINY, random_sequences
from tests.engine.runners.test_torch import generate, tiny_llama
from twostroke.engine.models.loading import LoadedModel, open_model
from twostroke.states.params import SamplingParams
from twostroke.states.speculation import Proposer, SpeculativeConfig, Speculator

pytestmark = pytest.mark.usefixtures("one_torch_thread")

__all__ = ["tiny_llama"]  # the fixture, shared with test_torch

SPEC = SpeculativeConfig(
    method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, adaptive=False
)
VOCAB = TINY["vocab_size"]


def prompts() -> list[list[int]]:
    # A repetitive prompt too, so that prompt lookup finds something to draft.
    return [*random_sequences([5, 12, 30, 3], seed=4), [7, 8, 9, 10, 11] * 5]


def drafts(
    kind: str,
    outputs: dict[int, list[int]],
    prompt_list: list[list[int]],
    seed: int = 5,
    vocab: int = VOCAB,
) -> Proposer:
    """Drafts of one kind: the run's own outputs (all hold), those changed (none holds),
    random ids, or the outputs with one token in three changed."""
    rng = random.Random(seed)

    def propose(request_id: int, known: Sequence[int], wanted: int) -> list[int]:
        done = len(known) - len(prompt_list[request_id])
        right = list(outputs[request_id][done : done + wanted])
        if kind == "perfect":
            return right
        if kind == "wrong":
            return [(token + 1) % vocab for token in right]
        if kind == "random":
            return [rng.randrange(vocab) for _ in range(wanted)]
        return [token if rng.random() < 2 / 3 else (token + 1) % vocab for token in right]

    return propose


@pytest.mark.parametrize("pipeline_depth", [1, 2])
@pytest.mark.parametrize("kind", ["perfect", "wrong", "random", "mixed", "ngram"])
def test_greedy_tokens_and_logprobs_do_not_depend_on_the_drafts(
    tiny_llama: tuple[Any, LoadedModel], kind: str, pipeline_depth: int
) -> None:
    _, loaded = tiny_llama
    prompt_list = prompts()
    params = [SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True)]
    params *= len(prompt_list)
    options: dict[str, Any] = {"pipeline_depth": pipeline_depth, "max_num_batched_tokens": 64}
    plain = generate(loaded, prompt_list, params, **options)
    propose = None if kind == "ngram" else drafts(kind, plain.tokens, prompt_list)
    run = generate(
        loaded, prompt_list, params, speculator=Speculator(SPEC, propose=propose), **options
    )
    assert run.tokens == plain.tokens
    for request_id, entries in run.logprobs.items():
        for got, want in zip(entries, plain.logprobs[request_id], strict=True):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [token for token, _ in got.top] == [token for token, _ in want.top]
    stats = run.statistics
    assert stats.num_spec_decode_drafts > 0
    if kind == "perfect":
        assert stats.num_spec_decode_accepted_tokens == stats.num_spec_decode_draft_tokens
        assert stats.num_steps < plain.statistics.num_steps
    if kind == "wrong":
        assert stats.num_spec_decode_accepted_tokens == 0
    if kind == "ngram":  # the repetitive prompt's continuation is quoted
        assert stats.num_spec_decode_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["perfect", "mixed"])
def test_seeded_sampling_gives_the_same_tokens_with_drafts(
    tiny_llama: tuple[Any, LoadedModel], kind: str
) -> None:
    """A seeded token takes the draw of its place in the output, drafted or not."""
    _, loaded = tiny_llama
    prompt_list = prompts()
    params = [
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=index, ignore_eos=True)
        for index in range(len(prompt_list))
    ]
    plain = generate(loaded, prompt_list, params, max_num_batched_tokens=64)
    speculator = Speculator(SPEC, propose=drafts(kind, plain.tokens, prompt_list))
    run = generate(loaded, prompt_list, params, max_num_batched_tokens=64, speculator=speculator)
    assert run.tokens == plain.tokens
    assert run.statistics.num_spec_decode_accepted_tokens > 0


#: The chance that a correct sampler fails the chi-square test below, for a seed drawn at
#: random (the test's seeds are fixed, so it passes or fails the same way every run).
FALSE_ALARM_RATE = 1e-3


def chi_square_critical(df: int, alpha: float = FALSE_ALARM_RATE) -> float:
    """The chi-square value exceeded with probability ``alpha`` (Wilson-Hilferty)."""
    z = _normal_quantile(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _normal_quantile(p: float) -> float:
    low, high = -10.0, 10.0
    for _ in range(100):
        middle = (low + high) / 2
        if 0.5 * math.erfc(-middle / math.sqrt(2)) < p:
            low = middle
        else:
            high = middle
    return low


def chi_square(observed: collections.Counter[Any], expected: dict[Any, float]) -> tuple[float, int]:
    """The statistic and degrees of freedom, cells of expected count under 5 pooled."""
    total = sum(observed.values())
    assert set(observed) <= set(expected), "a token the model gives no probability"
    small = [cell for cell, p in expected.items() if p * total < 5]
    cells = [[cell] for cell in expected if cell not in small] + ([small] if small else [])
    statistic = 0.0
    for group in cells:
        want = total * sum(expected[cell] for cell in group)
        got = sum(observed[cell] for cell in group)
        statistic += (got - want) ** 2 / want
    return statistic, len(cells) - 1


def top_k_probabilities(logits: torch.Tensor, k: int) -> dict[int, float]:
    values, ids = logits.float().topk(k)
    return dict(zip(ids.tolist(), values.softmax(-1).tolist(), strict=True))


def test_unseeded_sampling_keeps_the_model_distribution(
    tiny_llama: tuple[Any, LoadedModel],
) -> None:
    """1,500 samples of two tokens at top-k 4, with a point-mass draft of the first (the most
    likely token, accepted with its probability) and without drafts: each matches the model's
    first-token distribution and its joint two-token distribution (chi-square, false-alarm
    rate 1e-3 per test)."""
    _, loaded = tiny_llama
    prompt = random_sequences([6], seed=31)[0]
    model = loaded.module
    first = top_k_probabilities(model.forward_logits([prompt])[0][-1], 4)
    joint = {
        (a, b): p * q
        for a, p in first.items()
        for b, q in top_k_probabilities(model.forward_logits([[*prompt, a]])[0][-1], 4).items()
    }
    draft = max(first, key=first.__getitem__)
    count = 1500
    params = [SamplingParams(max_tokens=2, temperature=1.0, top_k=4, ignore_eos=True)] * count
    options: dict[str, Any] = {"max_num_batched_tokens": 256, "num_blocks": 1024, "seed": 9}

    def point_mass(request_id: int, known: Sequence[int], wanted: int) -> list[int]:
        return [draft] if len(known) == len(prompt) else []

    spec = attrs.evolve(SPEC, num_speculative_tokens=1, disable_by_batch_size=None)
    runs = {
        "without drafts": generate(loaded, [prompt] * count, params, **options),
        "with drafts": generate(
            loaded,
            [prompt] * count,
            params,
            speculator=Speculator(spec, propose=point_mass),
            **options,
        ),
    }
    drafted = runs["with drafts"].statistics
    assert drafted.num_spec_decode_drafts == count
    # Both ways through verification: drafts accepted, and drafts rejected.
    assert 0 < drafted.num_spec_decode_accepted_tokens < count
    for name, run in runs.items():
        firsts = collections.Counter(tokens[0] for tokens in run.tokens.values())
        pairs = collections.Counter(tuple(tokens[:2]) for tokens in run.tokens.values())
        for observed, expected in ((firsts, first), (pairs, joint)):
            statistic, df = chi_square(observed, expected)  # type: ignore[arg-type]
            assert statistic < chi_square_critical(df), (name, statistic, df, observed)


@pytest.fixture(scope="module")
def smollm2_plain() -> tuple[LoadedModel, list[list[int]], dict[int, list[int]]]:
    """SmolLM2 as the engine loads it by default, two prompts, and their greedy tokens."""
    from twostroke.engine.text.tokenizer import HFTokenizer

    loaded = open_model("smollm2", device=torch.device("cpu"))
    tokenizer = HFTokenizer.from_pretrained(loaded.source)
    prompt_list = [
        tokenizer.encode("The river flows past the mill, and the mill turns. The river"),
        tokenizer.encode("def square(x):\n    return x * x\n\ndef cube(x):\n"),
    ]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    return loaded, prompt_list, generate(loaded, prompt_list, params).tokens


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(kind=st.sampled_from(["perfect", "wrong", "random", "mixed"]), seed=st.integers(0, 999))
def test_smollm2_greedy_tokens_do_not_depend_on_the_drafts(
    smollm2_plain: tuple[LoadedModel, list[list[int]], dict[int, list[int]]],
    kind: str,
    seed: int,
) -> None:
    """The default model with drafts the test chooses: the same greedy tokens."""
    loaded, prompt_list, plain = smollm2_plain
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    vocab = loaded.module.config.vocab_size
    propose = drafts(kind, plain, prompt_list, seed=seed, vocab=vocab)
    run = generate(loaded, prompt_list, params, speculator=Speculator(SPEC, propose=propose))
    assert run.tokens == plain
    assert run.statistics.num_spec_decode_drafts > 0
