"""Request bodies to typed values and sampling parameters, without a server."""

from __future__ import annotations

import msgspec
import pytest

from twostroke.engine.cli import build_parser
from twostroke.engine.server import ApiError, build_app
from twostroke.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    choice_params,
    completion_prompts,
    decode_body,
    max_tokens_field,
)
from twostroke.states.params import SamplingParams


def completion(**fields: object) -> CompletionRequest:
    return decode_body(msgspec.json.encode({"prompt": "hi"} | fields), CompletionRequest)


def test_choices_get_distinct_reproducible_seeds_derived_from_seed() -> None:
    seeds = [params.seed for params in choice_params(completion(n=4, seed=7, max_tokens=3))]
    again = [params.seed for params in choice_params(completion(n=4, seed=7, max_tokens=3))]
    assert seeds == again
    assert seeds[0] == 7
    assert len(set(seeds)) == 4
    assert all(seed is not None and 0 <= seed < 2**63 for seed in seeds)
    unseeded = choice_params(completion(n=2, max_tokens=3))
    assert [params.seed for params in unseeded] == [None, None]


def test_openai_defaults_and_disabled_top_k() -> None:
    (params,) = choice_params(completion(top_k=-1))
    assert params == SamplingParams()  # max_tokens: SamplingParams' default, as OpenAI's
    assert params.top_k is None
    assert choice_params(completion(max_tokens=5))[0].max_tokens == 5


@pytest.mark.parametrize(
    ("fields", "max_tokens", "field"),
    [
        ({}, None, "max_completion_tokens"),  # as many as the context leaves
        ({"max_completion_tokens": 7}, 7, "max_completion_tokens"),
        ({"max_tokens": 5}, 5, "max_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": 7}, 5, "max_tokens"),
    ],
)
def test_a_chat_takes_either_max_tokens_field_and_leaves_none_to_the_context(
    fields: dict[str, int], max_tokens: int | None, field: str
) -> None:
    body = {"messages": [{"role": "user", "content": "x"}]} | fields
    chat = decode_body(msgspec.json.encode(body), ChatCompletionRequest)
    assert choice_params(chat)[0].max_tokens == max_tokens
    assert max_tokens_field(chat) == field
    assert max_tokens_field(completion()) == "max_tokens"


def test_chat_errors_name_the_chat_fields() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}
    request = decode_body(msgspec.json.encode(body), ChatCompletionRequest)
    with pytest.raises(ApiError) as caught:
        choice_params(request)
    assert caught.value.param == "max_completion_tokens"
    assert caught.value.message == "max_completion_tokens must be >= 1, got 0"
    body |= {"logprobs": True, "max_completion_tokens": 5}
    chat = decode_body(msgspec.json.encode(body), ChatCompletionRequest)
    (params,) = choice_params(chat)
    assert params.logprobs == 0  # the chosen token's only


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", ["text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2], [[1, 2]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_shapes(prompt: object, expected: list[object]) -> None:
    assert completion_prompts(completion(prompt=prompt)) == expected


@pytest.mark.parametrize("prompt", [[], ["a", 1], [[1], []], [True], [1.5]])
def test_bad_prompt_shapes_name_the_prompt(prompt: object) -> None:
    with pytest.raises(ApiError) as caught:
        completion_prompts(completion(prompt=prompt))
    assert (caught.value.status, caught.value.param) == (400, "prompt")


def test_body_errors_are_400s() -> None:
    with pytest.raises(ApiError) as caught:
        decode_body(b'{"prompt":', CompletionRequest)
    assert caught.value.status == 400
    assert "not valid JSON" in caught.value.message
    with pytest.raises(ApiError) as wrong_type:
        decode_body(b'{"prompt": "x", "n": "3"}', CompletionRequest)
    assert wrong_type.value.param == "n"
    ignored = decode_body(b'{"prompt": "x", "frobnicate": 1}', CompletionRequest)
    assert ignored.prompt == "x"


def test_build_app_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="engine must have the engine surface, got object"):
        build_app(object())  # type: ignore[arg-type]


def test_serve_command_line() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "toy", "--port", "0", "--backend", "trio", "--api-key", "k"]
    )
    assert (args.model, args.port, args.backend, args.api_key, args.host) == (
        "toy", 0, "trio", "k", "127.0.0.1"
    )  # fmt: skip
