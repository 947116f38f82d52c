"""Every error the server answers, read through the ``openai`` client's exception types.

Each answer has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (the
client's ``.body`` is the inner object) and the server keeps serving after each one.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from twostroke.engine import EngineClosed, EngineDead
from twostroke.engine.runners.toy import ToyRunner

from .conftest import OPENAI_STREAMS_ON_TRIO, Served, served

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

CHAT = [{"role": "user", "content": "hello"}]


async def still_serving(server: Served) -> None:
    reply = await server.client.completions.create(model="toy", prompt="ok", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


BAD_COMPLETIONS: list[tuple[dict[str, Any], str, str]] = [
    ({"temperature": -1}, "temperature", "temperature must be >= 0, got -1"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
    ({"max_tokens": "many"}, "max_tokens", "Expected `int | null`, got `str`"),
    ({"n": 0}, "n", "n must be in [1, 128], got 0"),
    ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20] (or None), got 21"),
    ({"seed": -1}, "seed", "seed must be in [0, 2**63), got -1"),
    ({"stop": [""]}, "stop", "stop strings must be non-empty"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2], got 3"),
    ({"logit_bias": {"1": 5}}, "logit_bias", "logit_bias is not supported by this server"),
    ({"echo": True}, "echo", "echo is not supported by this server"),
    ({"best_of": 3}, "best_of", "best_of other than n is not supported by this server"),
    ({"prompt": ""}, "prompt", "prompt must not be empty"),
    ({"prompt": []}, "prompt", "prompt must be a string, a list of strings"),
    ({"prompt": [999]}, "prompt", "prompt token ids must be in [0, 257), got 999 at index 0"),
    ({"extra_body": {"min_tokens": 9}, "max_tokens": 4}, "min_tokens", "min_tokens must be <="),
    ({"extra_body": {"top_k": -5}}, "top_k", "top_k must be >= 1"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "must be > 0"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids", "stop_token_ids must be >= 0"),
]


async def test_bad_completion_parameters_are_400s_naming_the_field() -> None:
    async with served() as server:
        for fields, param, message in BAD_COMPLETIONS:
            kwargs = {"model": "toy", "prompt": "hi", "max_tokens": 4} | fields
            with pytest.raises(openai.BadRequestError) as caught:
                await server.client.completions.create(**kwargs)
            assert caught.value.status_code == 400
            body = caught.value.body
            assert isinstance(body, dict)
            assert (body["type"], body["param"]) == ("invalid_request_error", param), fields
            assert message in body["message"], fields
        await still_serving(server)


BAD_CHATS: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": []}, "messages", "messages must not be empty"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs=true"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1"),
    ({"tool_choice": "required"}, "tools", "tool_choice 'required' needs tools"),
    ({"response_format": {"type": "xml"}}, "response_format", "Invalid enum value 'xml'"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages",
        "only text content parts are supported, got type 'image_url'",
    ),
    ({"messages": [{"content": "no role"}]}, "messages", "Object missing required field `role`"),
]


async def test_bad_chat_parameters_are_400s_naming_the_field() -> None:
    async with served() as server:
        for fields, param, message in BAD_CHATS:
            kwargs = {"model": "toy", "messages": CHAT} | fields
            with pytest.raises(openai.BadRequestError) as caught:
                await server.client.chat.completions.create(**kwargs)
            body = caught.value.body
            assert isinstance(body, dict), fields
            assert body["param"] == param, fields
            assert message in body["message"], fields
        await still_serving(server)


async def test_text_parts_join_into_one_message() -> None:
    async with served() as server:
        parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
        messages: Any = [{"role": "user", "content": parts}]
        reply = await server.client.chat.completions.create(
            model="toy", messages=messages, max_tokens=2
        )
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == len(await server.engine.tokenize(CHAT))


def too_long(limit: int, prompt: int, max_tokens: int, field: str) -> dict[str, Any]:
    """OpenAI's answer to a prompt and max_tokens that pass the context."""
    return {
        "message": f"This model's maximum context length is {limit} tokens. However, you "
        f"requested {prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} for the "
        f"completion). Please reduce the prompt or {field}.",
        "type": "invalid_request_error",
        "param": field,
        "code": "context_length_exceeded",
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_too_long_for_the_context_is_worded_from_the_engines_numbers(
    stream: bool,
) -> None:
    async with served(max_model_len=64) as server:
        with pytest.raises(openai.BadRequestError) as caught:
            await server.client.completions.create(
                model="toy", prompt="a" * 60, max_tokens=8, stream=stream
            )
        assert caught.value.body == too_long(64, 60, 8, "max_tokens")
        # The prompt went to the engine as text, tokenized there once: no round trip.
        assert server.engine.tokenized == []
        messages: Any = [{"role": "user", "content": "b" * 60}]
        prompt = len(await server.engine.tokenize(messages))
        server.engine.tokenized.clear()
        chats: list[tuple[dict[str, Any], int, str]] = [
            ({"max_tokens": 5}, 5, "max_tokens"),
            ({"max_completion_tokens": 6}, 6, "max_completion_tokens"),
            ({}, 1, "max_completion_tokens"),  # what the context leaves, at least 1
        ]
        for fields, max_tokens, field in chats:
            with pytest.raises(openai.BadRequestError) as caught:
                await server.client.chat.completions.create(
                    model="toy", messages=messages, stream=stream, **fields
                )
            assert caught.value.body == too_long(64, prompt, max_tokens, field), fields
        assert server.engine.tokenized == []
        await still_serving(server)


async def test_a_refusal_that_comes_through_the_handle_is_the_same_answer() -> None:
    """Behind a coordinator's process or ray replicas, submit returns at once and the
    replica's refusal comes later, through the handle."""
    async with served(max_model_len=64) as server:
        server.engine.refuse_later = True
        with pytest.raises(openai.BadRequestError) as caught:
            await server.client.completions.create(model="toy", prompt="a" * 60, max_tokens=8)
        assert caught.value.body == too_long(64, 60, 8, "max_tokens")
        with pytest.raises(openai.BadRequestError) as outside:
            await server.client.completions.create(model="toy", prompt=[999], max_tokens=2)
        assert caught.value.status_code == outside.value.status_code == 400
        assert isinstance(outside.value.body, dict)
        assert outside.value.body["param"] == "prompt"
        assert "got 999 at index 0" in outside.value.body["message"]
        # Streamed, the answer has begun: the refusal is the stream's error event.
        stream = await server.client.completions.create(
            model="toy", prompt="a" * 60, max_tokens=8, stream=True
        )
        with pytest.raises(openai.APIError, match="maximum context length is 64 tokens"):
            async for _ in stream:
                pass
        # Refused requests were never served: no prompt tokens, no outcome counted.
        assert await server.metric("twostroke:prompt_tokens_total") == 0
        assert await server.metric("twostroke:request_success_total", finished_reason="length") == 0
        await still_serving(server)


async def test_request_level_errors() -> None:
    async with served(max_model_len=64) as server:
        with pytest.raises(openai.NotFoundError) as unknown:
            await server.client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
        assert isinstance(unknown.value.body, dict)
        assert (unknown.value.body["code"], unknown.value.body["param"]) == (
            "model_not_found", "model"
        )  # fmt: skip

        malformed = await server.http.post(
            "/v1/completions",
            content=b'{"prompt": "hi",',
            headers={"content-type": "application/json"},
        )
        assert malformed.status_code == 400
        assert malformed.json()["error"]["type"] == "invalid_request_error"
        assert "not valid JSON" in malformed.json()["error"]["message"]

        missing = await server.http.post("/v1/completions", json={"max_tokens": 3})
        assert missing.status_code == 400
        assert missing.json()["error"]["message"] == "Object missing required field `prompt`"

        nowhere = await server.http.get("/v1/nowhere")
        assert nowhere.status_code == 404
        assert nowhere.json()["error"]["message"].startswith(
            "Not Found: GET /v1/nowhere; this server's routes are POST /v1/completions, "
            "POST /v1/chat/completions, POST /v1/responses, GET /v1/responses/{response_id}, "
            "DELETE /v1/responses/{response_id}, GET /v1/responses/{response_id}/input_items, "
            "POST /v1/files, GET /v1/files/{file_id}, DELETE /v1/files/{file_id}, "
            "GET /v1/files/{file_id}/content, POST /v1/batches, GET /v1/batches, "
            "GET /v1/batches/{batch_id}, POST /v1/batches/{batch_id}/cancel, POST /v1/messages, "
            "POST /v1/messages/count_tokens, GET /v1/models,"
        )
        wrong_method = await server.http.get("/v1/completions")
        assert wrong_method.status_code == 405
        await still_serving(server)


async def test_api_key() -> None:
    async with served(api_key="sk-right") as server:
        wrong = server.client.with_options(api_key="sk-wrong")
        with pytest.raises(openai.AuthenticationError) as caught:
            await wrong.models.list()
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "invalid_api_key"
        bare = await server.http.post(
            "/tokenize", json={"prompt": "x"}, headers={"authorization": ""}
        )
        assert bare.status_code == 401
        for open_path in ("/health", "/metrics"):
            reply = await server.http.get(open_path, headers={"authorization": ""})
            assert reply.status_code == 200
        await still_serving(server)


async def test_a_failed_step_is_a_500_or_an_error_event_and_serving_goes_on() -> None:
    failing = [False]
    runner = ToyRunner(fail_when=lambda plan: failing[0])
    async with served(runner=runner) as server:
        failing[0] = True
        with pytest.raises(openai.InternalServerError) as caught:
            await server.client.completions.create(model="toy", prompt="hi", max_tokens=4)
        assert caught.value.status_code == 500
        assert caught.value.body == {
            "message": "a step of this request failed",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        failing[0] = False
        await still_serving(server)

        stream = await server.client.completions.create(
            model="toy", prompt="hi", max_tokens=200, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts = []
        with pytest.raises(openai.APIError) as mid_stream:
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
                failing[0] = True
        assert texts
        assert mid_stream.value.message == "a step of this request failed"
        assert isinstance(mid_stream.value.body, dict)
        assert mid_stream.value.body["type"] == "server_error"
        failing[0] = False
        await still_serving(server)
        assert await server.metric("twostroke:request_success_total", finished_reason="error") == 2


@pytest.mark.parametrize(
    ("failure", "status", "code"),
    [
        (EngineDead("the engine died: boom"), 503, "engine_dead"),
        (EngineClosed("the engine is closed"), 503, "engine_closed"),
        (RuntimeError("a secret detail"), 500, None),
    ],
)
async def test_a_dead_or_broken_engine(failure: BaseException, status: int, code: str) -> None:
    async with served() as server:
        server.engine.failure = failure
        with pytest.raises(openai.InternalServerError) as caught:
            await server.client.completions.create(model="toy", prompt="hi", max_tokens=2)
        assert caught.value.status_code == status
        body = caught.value.body
        assert isinstance(body, dict)
        assert (body["type"], body["code"]) == ("server_error", code)
        assert "secret" not in body["message"]
        assert "Traceback" not in body["message"]
        health = await server.http.get("/health")
        assert health.status_code == (503 if status == 503 else 500)
        server.engine.failure = None
        assert (await server.http.get("/health")).status_code == 200
        await still_serving(server)
