"""The official ``openai`` client against a real server: asyncio+uvicorn and trio+Hypercorn."""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import anyio
import pytest

from twostroke.engine.config import ServerConfig
from twostroke.engine.runners.toy import ToyRunner

from .conftest import OPENAI_STREAMS_ON_TRIO, openai_client, served

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

CHAT = [{"role": "user", "content": "Tell me about engines."}]


async def test_completion_matches_its_stream_and_counts_usage() -> None:
    async with served() as server:
        full = await server.client.completions.create(
            model="toy", prompt="Once upon a time", max_tokens=12, extra_body={"ignore_eos": True}
        )  # fmt: skip
        choice = full.choices[0]
        assert full.object == "text_completion"
        assert full.model == "toy"
        assert full.id.startswith("cmpl-")
        assert choice.index == 0
        assert choice.finish_reason == "length"
        assert choice.text
        assert full.usage is not None
        assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (16, 12)
        assert full.usage.total_tokens == 28

        stream = await server.client.completions.create(
            model="toy", prompt="Once upon a time", max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    *choice_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in choice_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in choice_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert all(c.usage is None for c in choice_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage == full.usage


async def test_chat_matches_its_stream_and_starts_with_the_role() -> None:
    async with served() as server:
        full = await server.client.chat.completions.create(
            model="toy",
            messages=CHAT,
            max_tokens=20,
            temperature=0,  # type: ignore[arg-type]
        )
        message = full.choices[0].message
        assert full.object == "chat.completion"
        assert message.role == "assistant"
        assert full.choices[0].finish_reason in ("stop", "length")
        prompt_ids = await server.engine.tokenize(CHAT)
        assert full.usage is not None
        assert full.usage.prompt_tokens == len(prompt_ids)
        assert full.usage.completion_tokens >= 1

        stream = await server.client.chat.completions.create(
            model="toy", messages=CHAT, max_tokens=20, stream=True,  # type: ignore[arg-type]
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


async def test_max_completion_tokens_and_default_chat_length() -> None:
    async with served(max_model_len=128) as server:
        capped = await server.client.chat.completions.create(
            model="toy", messages=CHAT, max_completion_tokens=5,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert capped.usage is not None
        assert capped.usage.completion_tokens == 5
        room = await server.client.chat.completions.create(
            model="toy",
            messages=CHAT,
            extra_body={"ignore_eos": True},  # type: ignore[arg-type]
        )
        assert room.usage is not None
        assert room.usage.total_tokens == 128
        assert room.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_are_indexed_and_counted(stream: bool) -> None:
    async with served() as server:
        kwargs: dict[str, Any] = {
            "model": "toy",
            "prompt": "abc",
            "n": 3,
            "max_tokens": 7,
            "seed": 11,
            "extra_body": {"ignore_eos": True},
        }
        if not stream:
            reply = await server.client.completions.create(**kwargs)
            texts = {choice.index: choice.text for choice in reply.choices}
            assert reply.usage is not None
            assert reply.usage.completion_tokens == 21
            assert reply.usage.prompt_tokens == 3  # the prompt counts once
        else:
            texts = {}
            async for chunk in await server.client.completions.create(**kwargs, stream=True):
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert sorted(texts) == [0, 1, 2]
        assert all(texts.values())
        seeds = [params.seed for _, params in server.engine.submitted]
        assert seeds[0] == 11
        assert len(set(seeds)) == 3


async def test_several_prompts_as_text_and_token_ids() -> None:
    async with served() as server:
        reply = await server.client.completions.create(
            model="toy", prompt=["ab", "cde"], n=2, max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == 5
        by_ids = await server.client.completions.create(
            model="toy", prompt=[[97, 98], [99, 100, 101]], max_tokens=3,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.text for c in by_ids.choices] == [reply.choices[0].text, reply.choices[2].text]
        single = await server.client.completions.create(
            model="toy", prompt=[97, 98], max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert single.choices[0].text == reply.choices[0].text


async def test_logprobs_for_completions_and_chat() -> None:
    async with served() as server:
        reply = await server.client.completions.create(
            model="toy", prompt="abc", max_tokens=6, logprobs=1, extra_body={"ignore_eos": True}
        )
        logprobs = reply.choices[0].logprobs
        assert logprobs is not None
        assert logprobs.tokens is not None
        assert "".join(logprobs.tokens) == reply.choices[0].text
        assert logprobs.token_logprobs == [0.0] * 6  # the toy model is certain
        offsets = [sum(map(len, logprobs.tokens[:i])) for i in range(6)]
        assert len(logprobs.tokens) == 6
        assert logprobs.text_offset == offsets
        assert logprobs.top_logprobs == [{token: 0.0} for token in logprobs.tokens]

        chat = await server.client.chat.completions.create(
            model="toy", messages=CHAT, max_tokens=4, logprobs=True,  # type: ignore[arg-type]
            top_logprobs=1, extra_body={"ignore_eos": True},
        )  # fmt: skip
        content = chat.choices[0].logprobs and chat.choices[0].logprobs.content
        assert content is not None
        assert len(content) == 4
        assert "".join(entry.token for entry in content) == chat.choices[0].message.content
        assert all(entry.bytes == list(entry.token.encode()) for entry in content)
        assert all([top.token for top in entry.top_logprobs] == [entry.token] for entry in content)

        stream = await server.client.completions.create(
            model="toy", prompt="abc", max_tokens=6, logprobs=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokens: list[str] = []
        async for chunk in stream:
            chunk_logprobs = chunk.choices[0].logprobs
            if chunk_logprobs is not None and chunk_logprobs.tokens:
                assert chunk_logprobs.text_offset is not None
                assert chunk_logprobs.text_offset[0] == len("".join(tokens))
                assert chunk_logprobs.top_logprobs == [{}] * len(chunk_logprobs.tokens)
                tokens += chunk_logprobs.tokens
        assert "".join(tokens) == reply.choices[0].text


async def test_stop_strings_end_the_text() -> None:
    async with served() as server:
        free = await server.client.completions.create(
            model="toy", prompt="xyz", max_tokens=30, extra_body={"ignore_eos": True}
        )
        text = free.choices[0].text
        stop = text[10:12]
        expected = text[: text.index(stop)]
        for stream in (False, True):
            if stream:
                chunks = await server.client.completions.create(
                    model="toy", prompt="xyz", max_tokens=30, stop=[stop, "\x00"], stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                parts = [c.choices[0] async for c in chunks]
                got, reason = "".join(p.text for p in parts), parts[-1].finish_reason
            else:
                stopped = await server.client.completions.create(
                    model="toy", prompt="xyz", max_tokens=30, stop=stop,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                got, reason = stopped.choices[0].text, stopped.choices[0].finish_reason
            assert (got, reason) == (expected, "stop")


async def test_same_seed_same_answer_and_extras_reach_the_engine() -> None:
    async with served() as server:
        kwargs: dict[str, Any] = {
            "model": "toy", "prompt": "seeded", "max_tokens": 8, "temperature": 0.8,
            "top_p": 0.9, "seed": 5, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "user": "someone",
            "extra_body": {"top_k": 20, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2,
                           "stop_token_ids": [7], "ignore_eos": True},
        }  # fmt: skip
        first = await server.client.completions.create(**kwargs)
        second = await server.client.completions.create(**kwargs)
        assert first.choices[0].text == second.choices[0].text
        _, params = server.engine.submitted[0]
        assert (params.temperature, params.top_p, params.top_k, params.min_p) == (
            0.8, 0.9, 20, 0.1
        )  # fmt: skip
        assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
        assert (params.repetition_penalty, params.min_tokens) == (1.2, 2)
        assert (params.stop_token_ids, params.ignore_eos, params.seed) == ((7,), True, 5)


async def test_priority_reaches_the_engine_from_completions_and_chat() -> None:
    import openai

    async with served() as server:
        client = server.client
        await client.completions.create(
            model="toy", prompt="p", max_tokens=2, extra_body={"priority": -3}
        )
        await client.chat.completions.create(
            model="toy", messages=CHAT, max_tokens=2, extra_body={"priority": 7}
        )
        await client.completions.create(model="toy", prompt="p", max_tokens=2)
        assert [params.priority for _, params in server.engine.submitted] == [-3, 7, 0]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="toy", messages=CHAT, max_tokens=2, extra_body={"priority": 1001}
            )
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["param"] == "priority"
        assert error["message"] == "priority must be in [-1000, 1000], got 1001"
        assert len(server.engine.submitted) == 3


async def test_models_tokenize_detokenize_health() -> None:
    async with served() as server:
        models = await server.client.models.list()
        assert [model.id for model in models.data] == ["toy"]
        tokens = await server.http.post("/tokenize", json={"prompt": "hi!"})
        assert tokens.json() == {"count": 3, "max_model_len": 4096, "tokens": [104, 105, 33]}
        chat = await server.http.post("/tokenize", json={"messages": CHAT})
        assert chat.json()["tokens"] == await server.engine.tokenize(CHAT)
        text = await server.http.post("/detokenize", json={"tokens": [104, 105, 33]})
        assert text.json() == {"prompt": "hi!"}
        health = await server.http.get("/health", headers={"authorization": ""})
        assert health.status_code == 200


async def test_metrics_count_requests_tokens_and_latencies() -> None:
    async with served() as server:
        await server.client.completions.create(
            model="toy", prompt="abcd", max_tokens=5, extra_body={"ignore_eos": True}
        )
        stream = await server.client.completions.create(
            model="toy", prompt="ab", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
        async for _ in stream:
            pass
        await server.engine.wait_idle()
        metric = server.metric
        assert await metric("twostroke:request_success_total", finished_reason="length") == 2
        assert await metric("twostroke:prompt_tokens_total") == 6
        assert await metric("twostroke:generation_tokens_total") == 9
        assert await metric("twostroke:e2e_request_latency_seconds_count") == 2
        assert await metric("twostroke:time_to_first_token_seconds_count") == 2
        assert await metric("twostroke:request_time_per_output_token_seconds_count") == 2
        assert await metric("twostroke:request_queue_time_seconds_count") == 2
        assert await metric("twostroke:inter_token_latency_seconds_count") >= 1
        assert await metric("twostroke:num_requests_running") == 0
        assert await metric("twostroke:num_requests_waiting") == 0
        assert await metric("twostroke:kv_cache_usage_perc") == 0
        assert await metric("twostroke:num_preemptions_total") == 0


class GatedToyRunner(ToyRunner):
    """A toy runner whose steps wait (in the engine's worker thread) until the gate opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def execute(self, plan: Any) -> Any:
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return super().execute(plan)


async def test_an_idle_stream_gets_keep_alive_comments() -> None:
    runner = GatedToyRunner()
    async with served(runner=runner, server_config=ServerConfig(keepalive=0.001)) as server:
        body = {"prompt": "slow", "max_tokens": 3, "stream": True, "ignore_eos": True}
        raw = b""
        async with server.http.stream("POST", "/v1/completions", json=body) as reply:
            async for chunk in reply.aiter_bytes():
                raw += chunk
                if b": keep-alive\n\n" in raw:
                    runner.gate.set()  # nothing was generated yet: the stream was idle
    assert raw.startswith(b": keep-alive\n\n")
    assert raw.endswith(b"data: [DONE]\n\n")
    assert raw.count(b"data: {") == 3


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the model's path; both run the toy's
async def test_smollm2_names_the_capital_of_france() -> None:
    from twostroke.engine import Engine
    from twostroke.engine.server import serve

    async with Engine.open(model="smollm2", device="cpu") as engine:
        async with anyio.create_task_group() as task_group:
            port = await task_group.start(partial(serve, engine, port=0))
            async with openai_client(f"http://127.0.0.1:{port}/v1", api_key="unused") as client:
                reply = await client.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": "What is the capital of France?"}],
                    max_tokens=40,
                    temperature=0,
                )
                sampled = []
                for _ in range(2):
                    completion = await client.completions.create(
                        model="smollm2", prompt="My favourite city is", max_tokens=8,
                        temperature=1.0, seed=1234, n=2,
                    )  # fmt: skip
                    sampled.append(completion)
            task_group.cancel_scope.cancel()
    assert "Paris" in (reply.choices[0].message.content or "")
    texts = [[choice.text for choice in completion.choices] for completion in sampled]
    assert texts[0] == texts[1]  # the same seed gives the same choices


async def test_a_repeated_prompt_reports_its_cached_tokens_in_usage_and_metrics() -> None:
    prompt = "A prompt long enough to fill two blocks of sixteen."  # 51 bytes
    async with served() as server:
        first = await server.client.completions.create(model="toy", prompt=prompt, max_tokens=4)
        second = await server.client.completions.create(
            model="toy", prompt=prompt, max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        *_, usage_chunk = [chunk async for chunk in second]
        hits = await server.metric("twostroke:prefix_cache_hits_total")
        queries = await server.metric("twostroke:prefix_cache_queries_total")
    assert first.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens_details is not None
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 48  # three full blocks
    assert (hits, queries) == (48, 2 * 51)


async def test_the_clients_parse_helpers_read_a_schema_answer_and_a_tool_call() -> None:
    """``response_format`` from a pydantic model, and a strict function tool, parsed back."""
    from typing import Literal

    import openai
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=8)  # the toy writes random bytes where it may
        unit: Literal["celsius", "fahrenheit"]

    async with served() as server:
        with anyio.fail_after(30):
            answer = await server.client.chat.completions.parse(
                model="toy", messages=CHAT, max_tokens=64, response_format=Weather
            )
            called = await server.client.chat.completions.parse(
                model="toy",
                messages=CHAT,
                max_tokens=160,  # the call's tags, name and arguments
                tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
    parsed = answer.choices[0].message.parsed
    assert isinstance(parsed, Weather)
    assert answer.choices[0].finish_reason == "stop"
    (call,) = called.choices[0].message.tool_calls or []
    assert called.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert isinstance(call.function.parsed_arguments, Weather)
