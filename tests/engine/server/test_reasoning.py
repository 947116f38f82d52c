"""Thinking models over HTTP: the reasoning apart as ``reasoning_content`` (whole and
streamed), the answer alone as ``content``, tool calls read after ``</think>``, and
``chat_template_kwargs`` reaching the template, driven by the OpenAI SDK against a scripted
toy whose chat template thinks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.text.chat_template import render_chat

from .conftest import OPENAI_STREAMS_ON_TRIO, served
from .scripted import ScriptedRunner
from .test_tools import ASK, CALLING, TOOLS

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

#: Qwen3's habits on the toy's template: ``enable_thinking`` false closes an empty
#: reasoning in the prompt, ``open_thinking`` true opens one (its thinking models'), both
#: before the toy's ``<assistant>``, where the scripted model answers.
THINKING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_thinking is defined and open_thinking %}<think>\n{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
THOUGHT = "<think>\nThe user wants a greeting.\n</think>\n\nHello!"


class ThinkingTokenizer(ByteTokenizer):
    """The toy's bytes through a chat template that mentions ``<think>``."""

    @property
    def chat_template(self) -> str:
        return THINKING_TEMPLATE

    def apply_chat_template(
        self, messages: Any, *, template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        special_tokens = {"bos_token": "", "eos_token": ""}
        rendered = render_chat(
            THINKING_TEMPLATE, list(messages), None, special_tokens, template_kwargs=template_kwargs
        )
        return self.encode(rendered)


def thinker(prompt: str) -> str:
    """Thinks unless the prompt closed the reasoning; writes only the end where it opened it."""
    if prompt.endswith("</think>\n\n<assistant>"):
        return "Hello without thinking."
    if prompt.endswith("<think>\n<assistant>"):
        return "Planning.</think>Hello!"
    return THOUGHT


async def test_the_reasoning_comes_apart_from_the_answer_whole_and_streamed() -> None:
    async with served(runner=ScriptedRunner(thinker), tokenizer=ThinkingTokenizer()) as server:
        whole = await server.client.chat.completions.create(model="toy", messages=ASK)
        message = whole.choices[0].message
        assert message.content == "Hello!"
        assert (message.model_extra or {})["reasoning_content"] == "The user wants a greeting.\n"
        stream = await server.client.chat.completions.create(model="toy", messages=ASK, stream=True)
        reasoning, content = [], []
        async for chunk in stream:
            for choice in chunk.choices:
                reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
                content.append(choice.delta.content or "")
        assert "".join(reasoning) == "The user wants a greeting.\n"
        assert "".join(content) == "Hello!"
        assert sum(1 for piece in reasoning if piece) > 1  # streamed as it came


@pytest.mark.parametrize(
    ("kwargs", "reasoning", "content"),
    [
        ({"enable_thinking": False}, None, "Hello without thinking."),
        # The prompt opened <think>: the output starts inside the reasoning.
        ({"open_thinking": True}, "Planning.", "Hello!"),
    ],
)
async def test_chat_template_kwargs_reach_the_template(
    kwargs: dict[str, Any], reasoning: str | None, content: str
) -> None:
    async with served(runner=ScriptedRunner(thinker), tokenizer=ThinkingTokenizer()) as server:
        for stream in (False, True):
            if stream:
                chunks = await server.client.chat.completions.create(
                    model="toy", messages=ASK, stream=True,
                    extra_body={"chat_template_kwargs": kwargs},
                )  # fmt: skip
                thought, said = "", ""
                async for chunk in chunks:
                    for choice in chunk.choices:
                        extra = choice.delta.model_extra or {}
                        thought += extra.get("reasoning_content") or ""
                        said += choice.delta.content or ""
                assert (thought, said) == (reasoning or "", content)
                continue
            whole = await server.client.chat.completions.create(
                model="toy", messages=ASK, extra_body={"chat_template_kwargs": kwargs}
            )
            message = whole.choices[0].message
            assert (message.model_extra or {})["reasoning_content"] == reasoning
            assert message.content == content


async def test_a_tool_call_is_read_from_the_answer_after_the_thinking() -> None:
    def script(prompt: str) -> str:
        return "<think>I need the weather.</think>" + CALLING

    async with served(runner=ScriptedRunner(script), tokenizer=ThinkingTokenizer()) as server:
        whole = await server.client.chat.completions.create(
            model="toy",
            messages=ASK,
            tools=TOOLS,  # type: ignore[arg-type]
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.model_extra or {})["reasoning_content"] == "I need the weather."
        assert choice.message.content == "Let me check. "
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        async with server.client.chat.completions.stream(
            model="toy",
            messages=ASK,
            tools=TOOLS,  # type: ignore[arg-type]
        ) as stream:
            final = await stream.get_final_completion()
        (streamed,) = final.choices[0].message.tool_calls or []
        assert streamed.function.name == "get_weather"  # type: ignore[union-attr]
        assert final.choices[0].message.content == "Let me check. "


async def test_a_model_whose_template_does_not_think_answers_as_before() -> None:
    async with served(runner=ScriptedRunner(lambda prompt: THOUGHT)) as server:
        whole = await server.client.chat.completions.create(model="toy", messages=ASK)
        message = whole.choices[0].message
        assert message.content == THOUGHT
        assert "reasoning_content" not in (message.model_extra or {})


async def test_the_reasoning_parser_can_be_named_or_turned_off() -> None:
    options = {"reasoning_parser": "none"}
    async with served(runner=ScriptedRunner(thinker), tokenizer=ThinkingTokenizer(),
                      serve_options=options) as server:  # fmt: skip
        whole = await server.client.chat.completions.create(model="toy", messages=ASK)
        assert whole.choices[0].message.content == THOUGHT
    options = {"reasoning_parser": "deepseek_r1"}  # every output starts inside
    async with served(runner=ScriptedRunner(lambda prompt: "plan</think>\nanswer"),
                      serve_options=options) as server:  # fmt: skip
        whole = await server.client.chat.completions.create(model="toy", messages=ASK)
        message = whole.choices[0].message
        assert (message.model_extra or {})["reasoning_content"] == "plan"
        assert message.content == "answer"


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
         "chat_template_kwargs must not set 'messages': the engine sets that template "
         "variable itself"),
        ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs",
         "chat_template_kwargs must not set 'bos_token'"),
        ({"chat_template_kwargs": {f"v{i}": i for i in range(33)}}, "chat_template_kwargs",
         "chat_template_kwargs may hold at most 32 variables, got 33"),
        ({"chat_template_kwargs": {"big": "x" * 20000}}, "chat_template_kwargs",
         "chat_template_kwargs may take at most 16384 characters of JSON, got 20011"),
        ({"chat_template_kwargs": {"not-a-name": 1}}, "chat_template_kwargs",
         "chat_template_kwargs names must be identifiers of at most 64 characters, got "
         "'not-a-name'"),
        ({"response_format": {"type": "json_object"}}, "response_format",
         "response_format cannot be combined with the 'think' reasoning parser"),
    ],
)  # fmt: skip
async def test_bad_requests_name_the_field_and_the_rule(
    fields: dict[str, Any], param: str, message: str
) -> None:
    async with served(runner=ScriptedRunner(thinker), tokenizer=ThinkingTokenizer()) as server:
        answer = await server.http.post("/v1/chat/completions", json={"messages": ASK, **fields})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["param"] == param
        assert message in error["message"]


@pytest.mark.filterwarnings(
    r"ignore:Async generator 'anthropic\..*' was garbage collected:ResourceWarning"
)
async def test_messages_return_the_reasoning_as_a_thinking_block_whole_and_streamed() -> None:
    from .test_messages import client

    ask = [{"role": "user", "content": "Hi"}]
    async with (
        served(runner=ScriptedRunner(thinker), tokenizer=ThinkingTokenizer()) as server,
        client(server.base_url) as claude,
    ):
        whole = await claude.messages.create(model="toy", max_tokens=64, messages=ask)
        async with claude.messages.stream(model="toy", max_tokens=64, messages=ask) as stream:
            kinds = [e.delta.type async for e in stream if e.type == "content_block_delta"]
            streamed = await stream.get_final_message()
    thinking, text = whole.content
    assert (thinking.type, thinking.thinking) == ("thinking", "The user wants a greeting.\n")  # type: ignore[union-attr]
    assert (text.type, text.text) == ("text", "Hello!")  # type: ignore[union-attr]
    assert [
        block.model_dump(include={"type", "thinking", "text"}) for block in streamed.content
    ] == [block.model_dump(include={"type", "thinking", "text"}) for block in whole.content]
    assert kinds.index("text_delta") > kinds.index("thinking_delta")
    assert kinds.count("thinking_delta") > 1  # streamed as it came


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_return_the_reasoning_as_a_reasoning_item(stream: bool) -> None:
    async with served(runner=ScriptedRunner(thinker), tokenizer=ThinkingTokenizer()) as server:
        fields: dict[str, Any] = {"model": "toy", "input": "Hi", "max_output_tokens": 64}
        if stream:
            async with server.client.responses.stream(**fields) as events:
                kinds = [event.type async for event in events]
                response = await events.get_final_response()
            assert "response.reasoning_text.delta" in kinds
            assert kinds.index("response.reasoning_text.done") < kinds.index(
                "response.output_text.delta"
            )
        else:
            response = await server.client.responses.create(**fields)
        reasoning, _ = response.output
        assert reasoning.type == "reasoning"
        assert [part.text for part in reasoning.content or []] == ["The user wants a greeting.\n"]
        assert response.output_text == "Hello!"
        # Sent back as the next turn's input (as agents do), the reasoning is dropped from the
        # conversation, as the chat template drops an earlier turn's thinking.
        items = [item.model_dump(exclude_none=True) for item in response.output]
        items.append({"role": "user", "content": "And?"})
        again = await server.client.responses.create(model="toy", input=items, max_output_tokens=64)
        assert again.output_text == "Hello!"
        (_, _), (prompt, _) = server.engine.submitted[-2:]
        assert "greeting" not in str(prompt)


async def test_a_constraint_on_messages_or_responses_is_refused_while_reasoning_is_read() -> None:
    async with served(runner=ScriptedRunner(thinker), tokenizer=ThinkingTokenizer()) as server:
        fmt = {"type": "json_schema", "name": "w", "schema": {"type": "object"}}
        reply = await server.http.post(
            "/v1/responses", json={"input": "Hi", "text": {"format": fmt}}
        )
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "reasoning_constraint"
        assert reply.json()["error"]["param"] == "text.format.schema"
