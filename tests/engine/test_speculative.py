"""Speculative decoding through the engine: the same outputs, seen on both backends.

The toy model here repeats its input with a period of five bytes, so prompt lookup and the
suffix tries draft its continuation and most drafts hold: several tokens arrive per step,
and everything a caller sees (text, ids, logprobs, stop strings, finish reasons, usage)
must be what the same requests give without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tests.engine.server.conftest import served
from twostroke.engine import Engine
from twostroke.engine.runners.toy import EOS_TOKEN_ID, ByteTokenizer, ToyRunner
from twostroke.states.params import SamplingParams

pytestmark = pytest.mark.anyio

PERIOD = 5


def repeating(token_ids: Sequence[int]) -> int:
    """The model: the byte five places back (EOS after 60 tokens of a short prompt)."""
    if len(token_ids) >= 64:
        return EOS_TOKEN_ID
    return token_ids[-PERIOD] if len(token_ids) >= PERIOD else ord("x")


PARAMS = [
    SamplingParams(max_tokens=30, temperature=0.0),
    SamplingParams(max_tokens=40, temperature=0.0, stop=["dea"]),
    SamplingParams(max_tokens=40, temperature=0.0, stop=["e"], include_stop_str_in_output=True),
    SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[ord("c")], min_tokens=4),
    SamplingParams(max_tokens=80, temperature=0.0, logprobs=1),
    SamplingParams(max_tokens=17, temperature=0.7, seed=3),
]


def repeating_engine(spec: dict[str, Any] | None, depth: int, **runner: Any) -> Any:
    """An engine over the repeating toy model (``runner``: more of ``ToyRunner``'s options)."""
    return Engine.open(
        runner=ToyRunner(next_token=repeating, **runner),
        tokenizer=ByteTokenizer(),
        device="cpu",
        speculative_config=spec,
        pipeline_depth=depth,
    )


async def outputs(spec: dict[str, Any] | None, depth: int) -> tuple[list[Any], Any]:
    async with repeating_engine(spec, depth) as engine:
        results = []
        for index, params in enumerate(PARAMS):
            output = await engine.generate(f"{index}abcde", params)
            results.append(
                (
                    output.text,
                    output.token_ids,
                    output.finish_reason,
                    output.usage,
                    None if output.logprobs is None else [e.token_id for e in output.logprobs],
                )
            )
        # Deltas delivered in one pass of the bookkeeping stroke reach the handle merged
        # (several tokens per step), so a stream is compared whole.
        text, ids = "", []
        async with engine.stream("zabcde", PARAMS[1]) as deltas:
            async for delta in deltas:
                text += delta.text
                ids.extend(delta.token_ids)
        results.append((text, ids))
        return results, engine.statistics()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
async def test_what_a_caller_sees_does_not_change(method: str, depth: int) -> None:
    plain, _ = await outputs(None, depth)
    spec = {"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    speculated, stats = await outputs(spec, depth)
    assert speculated == plain
    assert stats.num_spec_decode_accepted_tokens > 0
    assert stats.num_spec_decode_drafts > 0
    assert stats.spec_decode_mean_acceptance_length > 1.5
    assert sum(stats.spec_decode_accepted_tokens_per_pos) == stats.num_spec_decode_accepted_tokens
    assert stats.num_steps < sum(len(result[1]) for result in plain[:-1])


def repeating_within(token_ids: Sequence[int], allowed: frozenset[int]) -> int:
    """The repeating model under a constraint: its token where allowed."""
    token = repeating(token_ids)
    return token if token in allowed else min(allowed)


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_constrained_request_drafts_within_its_constraint(depth: int) -> None:
    """A regex the model's repetition follows for a while, then leaves: drafts are cut where
    the constraint refuses them, drafted positions sample under their own masks, and the
    output is the one without speculation."""
    from twostroke.engine import Regex

    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=Regex("(abcde){3}[0-9]{4}"))
    results = []
    for spec in (None, {"method": "ngram", "prompt_lookup_min": 1}):
        async with repeating_engine(spec, depth, choose=repeating_within) as engine:
            output = await engine.generate("abcde", params)
            results.append((output.text, output.token_ids, output.finish_reason))
            stats = engine.statistics()
    assert results[1] == results[0]
    assert results[0][0].startswith("abcdeabcdeabcde")
    assert stats.num_spec_decode_accepted_tokens > 0


async def test_a_bad_speculative_config_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="method must be one of 'ngram', 'suffix', got 'eagle'"):
        async with Engine.open(model="toy", speculative_config={"method": "eagle"}):
            pass
    with pytest.raises(TypeError, match="speculative_config has no field 'k'"):
        async with Engine.open(model="toy", speculative_config={"method": "ngram", "k": 2}):
            pass


async def test_the_server_exports_vllms_speculation_counters() -> None:
    runner = ToyRunner(next_token=repeating)
    async with served(
        runner=runner, speculative_config={"method": "ngram", "prompt_lookup_min": 1}
    ) as server:
        await server.client.completions.create(model="toy", prompt="abcdeabcde", max_tokens=30)
        drafts = await server.metric("twostroke:spec_decode_num_drafts_total")
        tokens = await server.metric("twostroke:spec_decode_num_draft_tokens_total")
        accepted = await server.metric("twostroke:spec_decode_num_accepted_tokens_total")
        first = await server.metric(
            "twostroke:spec_decode_num_accepted_tokens_per_pos_total", position="0"
        )
    assert 0 < drafts <= first <= accepted <= tokens
