"""``POST /v1/responses`` through the official client: text, formats, function tools, streams,
the refusals and the 404 that names the routes (stored responses: test_response_store.py)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import anyio
import attrs
import jsonschema
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from twostroke.engine.config import ServerConfig
from twostroke.engine.runners.toy import ToyRunner
from twostroke.engine.server.answer_events import (
    AnswerEvent,
    ArgumentsDelta,
    CallStarted,
    Finished,
    TextDelta,
    Usage,
)
from twostroke.engine.server.response_events import ResponseDraft
from twostroke.engine.server.responses import MAX_CALL_ID_LENGTH, MAX_INPUT_ITEMS

from .conftest import OPENAI_STREAMS_ON_TRIO, served
from .scripted import ScriptedRunner
from .test_disconnect import wait_for_aborted

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

#: Short, closed arguments, so that every call of the toy completes within its tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Bergen"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "The weather",
     "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}},
]  # fmt: skip
SCHEMAS = {tool["name"]: tool["parameters"] for tool in TOOLS}
ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def _check_calls(output: list[Any]) -> list[Any]:
    """Every output item is a complete function call whose arguments validate."""
    assert output
    for item in output:
        assert item.type == "function_call", output
        assert item.call_id.startswith("call_")
        assert item.id.startswith("fc_")
        assert item.status == "completed"
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
    return output


async def test_text_is_the_chat_answer_as_output_items_with_usage() -> None:
    async with served(runner=ToyRunner(eos_rate=0.1)) as server:
        response = await server.client.responses.create(
            model="toy", input="Tell me about engines.", instructions="Answer briefly.",
            max_output_tokens=200, temperature=0.5, top_p=0.9,
        )  # fmt: skip
        chat = await server.client.chat.completions.create(
            model="toy", max_tokens=200, temperature=0.5, top_p=0.9,
            messages=[{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": "Tell me about engines."}],
        )  # fmt: skip
        cut = await server.client.responses.create(model="toy", input="Hi", max_output_tokens=1)
        (submitted, params), *_ = server.engine.submitted
    assert submitted == [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "Tell me about engines."}]  # fmt: skip
    assert (params.max_tokens, params.temperature, params.top_p) == (200, 0.5, 0.9)
    assert response.object == "response"
    assert response.id.startswith("resp_")
    assert response.model == "toy"
    assert response.status == "completed"
    assert response.instructions == "Answer briefly."
    (message,) = response.output
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.status == "completed"
    assert message.id.startswith("msg_")
    assert response.output_text == chat.choices[0].message.content
    assert response.output_text  # the toy says something
    assert response.usage is not None
    assert chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"
    assert cut.usage is not None
    assert cut.usage.output_tokens == 1


async def test_a_stream_is_the_answer_in_events_with_sequence_numbers() -> None:
    async with served(runner=ToyRunner(eos_rate=0.1)) as server:
        whole = await server.client.responses.create(
            model="toy", input="Hello", max_output_tokens=200
        )
        stream = await server.client.responses.create(
            model="toy", input="Hello", max_output_tokens=200, stream=True
        )
        events = [event async for event in stream]
        async with server.client.responses.stream(
            model="toy", input="Hello", max_output_tokens=200
        ) as accumulated:
            final = await accumulated.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds == sorted(kinds, key=ORDER.index)  # the order, each delta in its place
    assert set(kinds) == set(ORDER)
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert "".join(event.delta for event in deltas) == whole.output_text
    created, completed = events[0], events[-1]
    assert created.type == "response.created"
    assert completed.type == "response.completed"
    assert created.response.status == "in_progress"
    assert created.response.output == []
    assert completed.response.id == created.response.id
    assert completed.response.output_text == whole.output_text
    usage, whole_usage = completed.response.usage, whole.usage
    assert usage is not None
    assert whole_usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        whole_usage.input_tokens,
        whole_usage.output_tokens,
        whole_usage.total_tokens,
    )  # (cached_tokens: the first request left the prompt in the prefix cache)
    assert final.output_text == whole.output_text
    assert final.status == "completed"


async def test_text_format_json_schema_constrains_the_output() -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    async with served() as server:
        whole = await server.client.responses.create(
            model="toy", input="Weather in Oslo?", text={"format": fmt},  # type: ignore[typeddict-item]
            max_output_tokens=64,
        )  # fmt: skip
        async with server.client.responses.stream(
            model="toy",
            input="Weather in Oslo?",
            text={"format": fmt},  # type: ignore[typeddict-item]
            max_output_tokens=64,
        ) as stream:
            final = await stream.get_final_response()
        anything = await server.client.responses.create(
            model="toy", input="Weather in Oslo?", text={"format": {"type": "json_object"}},
            max_output_tokens=64,
        )  # fmt: skip
    jsonschema.validate(json.loads(whole.output_text), WEATHER)
    assert final.output_text == whole.output_text
    assert whole.text is not None
    assert whole.text.format is not None
    assert whole.text.format.type == "json_schema"
    assert anything.status == "incomplete" or isinstance(json.loads(anything.output_text), dict)


async def test_a_format_and_tools_constrain_as_the_chat_requests_do() -> None:
    """The same constraint as chat's (strict schemas included): a schema without
    ``additionalProperties``, and tools with it."""
    loose = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}
    fmt = {"type": "json_schema", "name": "w", "schema": loose}
    chat_fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": loose}}
    ask = [{"role": "user", "content": "Weather?"}]
    async with served() as server:
        for chat_fields, fields in [
            ({"response_format": chat_fmt}, {"text": {"format": fmt}}),
            ({"response_format": chat_fmt, "tools": _chat_tools(TOOLS)},
             {"text": {"format": fmt}, "tools": TOOLS}),
            ({"tools": _chat_tools(TOOLS), "tool_choice": "required"},
             {"tools": TOOLS, "tool_choice": "required"}),
        ]:  # fmt: skip
            chat = await server.http.post(
                "/v1/chat/completions", json={"messages": ask, "max_tokens": 64} | chat_fields
            )
            reply = await server.http.post(
                "/v1/responses", json={"input": ask, "max_output_tokens": 64} | fields
            )
            assert (chat.status_code, reply.status_code) == (200, 200), (chat.text, reply.text)
        submitted = server.engine.submitted
    assert len(submitted) == 6
    for (chat_prompt, chat_params), (prompt, params) in zip(
        submitted[::2], submitted[1::2], strict=True
    ):
        assert params.constraint is not None
        # A stored response's conversation stays pinned for its next turn; nothing else differs.
        assert params.cache_ttl == ServerConfig().responses_cache_ttl
        assert (prompt, attrs.evolve(params, cache_ttl=0.0)) == (chat_prompt, chat_params)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}])
async def test_function_tools_answer_function_call_items(tool_choice: Any) -> None:
    async with served() as server:
        whole = await server.client.responses.create(
            model="toy", input="Weather in Oslo?", tools=TOOLS, tool_choice=tool_choice,
            max_output_tokens=256, parallel_tool_calls=False,
        )  # fmt: skip
        async with server.client.responses.stream(
            model="toy",
            input="Weather in Oslo?",
            tools=TOOLS,
            tool_choice=tool_choice,
            max_output_tokens=256,
            parallel_tool_calls=False,
        ) as accumulated:
            events = [event async for event in accumulated]
            final = await accumulated.get_final_response()
    (call,) = _check_calls(whole.output)
    if isinstance(tool_choice, dict):
        assert call.name == "get_time"
    assert whole.status == "completed"
    (streamed,) = _check_calls(final.output)
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == ["response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
ANSWER = "It is mild in Oslo."


def agent(prompt: str) -> str:
    """The scripted model: a sentence and a call of the weather tool (the generic format),
    then, once the tool's result is in the prompt, the answer."""
    if "12 degrees" in prompt:
        return ANSWER
    return f"Let me check. <tool_call>\n{CALL}\n</tool_call>"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_agent_loop_finishes_through_the_responses_api(stream: bool) -> None:
    """openai-agents' loop over the Responses API: tools with the default tool_choice, the
    call's items and its output sent back as input, then the text answer."""

    async def create(client: Any, items: list[Any]) -> Any:
        if not stream:
            return await client.responses.create(model="toy", input=items, tools=TOOLS)
        async with client.responses.stream(model="toy", input=items, tools=TOOLS) as events:
            return await events.get_final_response()

    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    async with served(runner=ScriptedRunner(agent)) as server:
        first = await create(server.client, ask)
        message, call = first.output
        assert first.status == "completed"
        assert message.type == "message"
        assert message.content[0].text == "Let me check. "
        assert call.type == "function_call"
        assert call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Oslo", "unit": "celsius"}
        items = [*ask, *(item.model_dump(exclude_none=True) for item in first.output),
                 {"type": "function_call_output", "call_id": call.call_id,
                  "output": "12 degrees"}]  # fmt: skip
        second = await create(server.client, items)
        (first_prompt, _), (second_prompt, _) = server.engine.submitted
    assert second.status == "completed"
    assert second.output_text == ANSWER
    assert [item.type for item in second.output] == ["message"]
    assert '"name": "get_weather"' in first_prompt[0]["content"]  # the tools, shown
    assert "12 degrees" in second_prompt[-1]["content"]  # the result, as the chat path has it
    # The answer's text and its call are one assistant turn, as the chat loop sends them.
    assert [message["role"] for message in second_prompt].count("assistant") == 1


# openai-agents runs on asyncio only (its runner makes asyncio tasks): this one is about it.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_openai_agents_runner_finishes_its_default_loop() -> None:
    """openai-agents' ``Runner.run`` (and ``run_streamed``) with a function tool and default
    settings, which speak the Responses API: the call, the tool's result, the answer."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    ran: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        ran.append((city, unit))
        return "12 degrees"

    set_tracing_disabled(True)  # it would post traces to OpenAI otherwise
    async with served(runner=ScriptedRunner(agent)) as server:
        model = OpenAIResponsesModel(model="toy", openai_client=server.client)
        weather = Agent(name="weather", instructions="You help.", tools=[get_weather],
                        model=model)  # fmt: skip
        result = await Runner.run(weather, "Weather in Oslo?")
        assert result.final_output == ANSWER
        streamed = Runner.run_streamed(weather, "Weather in Oslo?")
        kinds = {event.type async for event in streamed.stream_events()}
        assert "raw_response_event" in kinds
        assert streamed.final_output == ANSWER
    assert ran == [("Oslo", "celsius")] * 2


def _chat_tools(tools: list[Any]) -> list[Any]:
    """Responses' flat function tools in chat's shape."""
    return [{"type": "function", "function": {key: value for key, value in tool.items()
                                              if key != "type"}} for tool in tools]  # fmt: skip


@pytest.mark.parametrize("tool_choice", ["none", "auto"])
async def test_a_tool_loop_round_trip_is_the_chat_requests_prompt(tool_choice: str) -> None:
    """The history of a tool loop reaches the engine as the same chat request's does: the
    call as the assistant's ``tool_calls``, its output as a ``tool`` message."""
    arguments = json.dumps({"city": "Oslo", "unit": "celsius"})
    history: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": arguments,
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "12 degrees"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "It is mild.", "annotations": []}],
        },
        {"role": "developer", "content": "Be brief."},
    ]
    messages = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "12 degrees"},
        {"role": "assistant", "content": "It is mild."},
        {"role": "system", "content": "Be brief."},
    ]  # fmt: skip
    async with served() as server:
        chat = await server.http.post("/v1/chat/completions", json={
            "messages": messages, "tools": _chat_tools(TOOLS), "tool_choice": tool_choice,
            "max_tokens": 8, "temperature": 0.5})  # fmt: skip
        response = await server.client.responses.create(
            model="toy", instructions="You help.", input=history, tools=TOOLS,
            tool_choice=tool_choice,  # type: ignore[arg-type]
            max_output_tokens=8, temperature=0.5, store=False, metadata={"run": "1"},
            extra_body={"unknown_field": 1},
        )  # fmt: skip
        (chat_prompt, chat_params), (prompt, params) = server.engine.submitted
    assert chat.status_code == 200, chat.text
    assert response.output
    assert prompt == chat_prompt
    assert params == chat_params


@pytest.mark.parametrize("tool_choice", ["auto", None])
async def test_tool_choice_auto_is_answered_as_the_chat_path_answers_it(
    tool_choice: str | None,
) -> None:
    """Whatever ``/v1/chat/completions`` does with tools and "auto", so does this."""
    choice = {} if tool_choice is None else {"tool_choice": tool_choice}
    async with served() as server:
        chat = await server.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Weather?"}], "tools": _chat_tools(TOOLS),
            "max_tokens": 128} | choice)  # fmt: skip
        reply = await server.http.post("/v1/responses", json={
            "input": "Weather?", "tools": TOOLS, "max_output_tokens": 128} | choice)  # fmt: skip
        submitted = server.engine.submitted
    assert reply.status_code == chat.status_code, (reply.text, chat.text)
    if chat.status_code != 200:
        error, chat_error = reply.json()["error"], chat.json()["error"]
        assert (error["param"], error["message"]) == (chat_error["param"], chat_error["message"])
        return
    (chat_prompt, chat_params), (prompt, params) = submitted
    assert (prompt, attrs.evolve(params, cache_ttl=0.0)) == (chat_prompt, chat_params)
    message = chat.json()["choices"][0]["message"]
    calls = [item for item in reply.json()["output"] if item["type"] == "function_call"]
    assert [(call["name"], call["arguments"]) for call in calls] == [
        (call["function"]["name"], call["function"]["arguments"])
        for call in message.get("tool_calls") or []
    ]
    texts = [item for item in reply.json()["output"] if item["type"] == "message"]
    assert [text["content"][0]["text"] for text in texts] == (
        [message["content"]] if message["content"] or not calls else []
    )


async def test_a_step_that_fails_mid_stream_is_an_error_event_and_response_failed() -> None:
    failing = [False]
    async with served(runner=ToyRunner(fail_when=lambda plan: failing[0], eos_rate=0)) as server:
        stream = await server.client.responses.create(
            model="toy", input="Hello", max_output_tokens=200, stream=True
        )
        events = []
        async for event in stream:
            events.append(event)
            failing[0] = event.type == "response.output_text.delta"
        failing[0] = False
        whole = await server.client.responses.create(model="toy", input="Hi", max_output_tokens=2)
    *_, error, failed = events
    assert error.type == "error"
    assert error.message == "a step of this request failed"
    assert failed.type == "response.failed"
    assert failed.response.status == "failed"
    assert failed.response.error is not None
    assert failed.response.error.message == "a step of this request failed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert whole.status == "incomplete"  # and it serves on


async def test_closing_a_stream_mid_way_cancels_its_request() -> None:
    async with served(runner=ToyRunner(eos_rate=0)) as server:
        stream = await server.client.responses.create(
            model="toy", input="long", max_output_tokens=3000, stream=True
        )
        async for event in stream:
            if event.type == "response.output_text.delta":
                break
        await stream.close()
        with anyio.fail_after(10):
            await server.engine.wait_idle()
            await wait_for_aborted(server, 1)
        assert server.engine.statistics().num_tokens_generated < 3000


#: (body fields, param, message, code)
REFUSALS: list[tuple[dict[str, Any], str, str, str | None]] = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "previous_response_id must "
     "be 'resp_' and 32 lowercase hex digits, as this server's response ids are, got 'resp_1'",
     "invalid_value"),
    ({"previous_response_id": "resp_" + "0" * 32}, "previous_response_id",
     f"Previous response with id 'resp_{'0' * 32}' not found.", "previous_response_not_found"),
    ({"background": True}, "background", "background (true) is not supported: this server "
     "stores responses (previous_response_id), not conversations, prompts or background runs",
     "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "not conversations", "unsupported_parameter"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "not conversations, prompts",
     "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input",
     "input[0]: item_reference is not supported: this server stores responses",
     "unsupported_parameter"),
    ({"input": []}, "input", "input must not be empty", None),
    ({"input": [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)}, "input",
     f"input must hold <= {MAX_INPUT_ITEMS} items, got {MAX_INPUT_ITEMS + 1}", None),
    ({"input": [{"role": "tool", "content": "x"}]}, "input",
     "input[0].role must be one of user, assistant, system, developer, got 'tool'", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input[0].content[0]: only text parts (input_text, output_text) are supported, "
     "got type 'input_image'", None),
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input", "input[0].type must be "
     "message, function_call, function_call_output or reasoning, got 'computer_call'", None),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, "input",
     "input[0]: no function_call with call_id 'call_9' comes before this function_call_output",
     None),
    ({"input": [{"type": "function_call", "call_id": "c" * (MAX_CALL_ID_LENGTH + 1),
                 "name": "f", "arguments": "{}"}]}, "input",
     f"input[0].call_id must be a string of 1 to {MAX_CALL_ID_LENGTH} characters, got "
     f"{MAX_CALL_ID_LENGTH + 1} characters", None),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input",
     "input[0]: a function_call item needs name and arguments", None),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c",
                 "name": "f", "arguments": "{"}]}, "input",
     "input[1].arguments must be JSON text, got '{'", None),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f g", "arguments": "{}"}]},
     "input", "input[0].name must be 1 to 64 letters, digits, underscores or dashes, got 'f g'",
     None),
    # The chat path's error about its messages[2].tool_calls names the Responses items: the
    # instructions are chat message 0, input[0] is message 1, input[1..129] are message 2.
    ({"instructions": "Be brief.", "input": [{"role": "user", "content": "x"}, *[
        {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
        for i in range(129)]]}, "input", "input[1] to input[129] (the function_call items of "
     "one turn) must hold <= 128 calls, got 129", None),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be >= 1, got 0", None),
    ({"temperature": 3.0}, "temperature", "temperature must be in [0, 2.0], got 3.0", None),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1]", None),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools[0].type",
     "tools[0].type must be 'function' (the only tools this server runs), got 'web_search'",
     None),
    ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice",
     "got type 'file_search'", None),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice",
     "tool_choice of type 'function' needs name", None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "tool_choice names function 'nope', which is not one of tools", None),
    ({"tools": [{"type": "function", "name": "a b"}], "tool_choice": "required"},
     "tools[0].name", "tools[0].name must be 1 to 64", None),
    ({"text": {"format": {"type": "json_schema", "name": "bad name", "schema": WEATHER}}},
     "text.format.name", "text.format.name must be 1 to 64 letters, digits, underscores or "
     "dashes, got 'bad name'", None),
    ({"text": {"format": {"type": "json_schema", "name": "w"}}}, "text.format",
     "text.format of type json_schema needs schema", None),
    ({"text": {"format": {"type": "json_schema", "name": "w", "schema": {
        "type": "object", "x-guidance": {}}}}}, "text.format.schema",
     "text.format.schema: schema must not hold x-guidance", "constraint_rejected"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning is not supported", None),
    ({"include": ["message.output_text.logprobs"]}, "include", "include is not supported",
     None),
    ({"truncation": "auto"}, "truncation", "only 'disabled' is, got 'auto'", None),
    ({"max_tool_calls": 2}, "max_tool_calls", "max_tool_calls is not supported", None),
    ({"model": "gpt-5"}, "model", "The model `gpt-5` does not exist", "model_not_found"),
    ({"input": 7}, "input", "Expected `str | array`, got `int`", None),
]  # fmt: skip


async def test_refusals_are_400s_naming_the_field_and_the_rule() -> None:
    async with served() as server:
        for fields, param, message, code in REFUSALS:
            body = {"model": "toy", "input": "Hi", "max_output_tokens": 4} | fields
            reply = await server.http.post("/v1/responses", json=body)
            assert reply.status_code == (404 if param == "model" else 400), (fields, reply.text)
            error = reply.json()["error"]
            assert error["param"] == param, (fields, error)
            assert message in error["message"], (fields, error)
            assert error["code"] == code, (fields, error)
            assert error["type"] == "invalid_request_error"
        assert server.engine.submitted == []  # all refused from the body alone
        for stream in (False, True):  # refused by the engine, once it tokenized the input
            too_long = await server.http.post("/v1/responses", json={
                "input": "Hi", "max_output_tokens": 10**6, "stream": stream})  # fmt: skip
            assert too_long.status_code == 400
            error = too_long.json()["error"]
            assert (error["param"], error["code"]) == ("max_output_tokens",
                                                       "context_length_exceeded")  # fmt: skip
            assert error["message"].endswith("Please reduce the prompt or max_output_tokens.")
        with pytest.raises(openai.BadRequestError, match="Previous response with id 'resp_"):
            await server.client.responses.create(
                model="toy", input="Hi", previous_response_id="resp_" + "f" * 32
            )


@pytest.mark.parametrize("stream", [False, True])
async def test_a_schema_the_backend_refuses_is_a_400_naming_the_responses_field(
    stream: bool,
) -> None:
    unsatisfiable = {"type": "integer", "minimum": 5, "maximum": 1}
    async with served() as server:
        reply = await server.http.post(
            "/v1/responses",
            json={
                "input": "Hi",
                "stream": stream,
                "text": {"format": {"type": "json_schema", "name": "n", "schema": unsatisfiable}},
            },
        )
        called = await server.http.post(
            "/v1/responses",
            json={
                "input": "Hi",
                "stream": stream,
                "tool_choice": {"type": "function", "name": "f"},
                "tools": [{"type": "function", "name": "f", "parameters": unsatisfiable}],
            },
        )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "text.format.schema"
    assert reply.json()["error"]["message"].startswith("text.format.schema: ")
    assert called.status_code == 400, called.text
    assert called.json()["error"]["param"] == "tools[0].parameters"
    assert called.json()["error"]["message"].startswith("tools[0].parameters: ")


async def test_an_unknown_route_is_a_json_404_that_names_the_routes() -> None:
    async with served() as server:
        reply = await server.http.post("/v1/conversations", json={})
        wrong_method = await server.http.get("/v1/responses")
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("Not Found: POST /v1/conversations; this server's routes")
    for route in ["POST /v1/responses", "POST /v1/chat/completions", "GET /v1/models",
                  "GET /health", "POST /tokenize"]:  # fmt: skip
        assert route in error["message"]
    assert "HEAD" not in error["message"]
    assert wrong_method.status_code == 405
    assert "POST /v1/responses" in wrong_method.json()["error"]["message"]


def test_streamed_tool_call_deltas_become_events_the_sdk_reassembles() -> None:
    """A stream's answer events (text, then each call's start and its arguments' pieces)
    give the items a whole answer's events give, as the SDK accumulates them."""
    first = '{"city": "Oslo", "unit": "celsius"}'
    streamed_events = [
        TextDelta("Let me "), TextDelta("check."),
        CallStarted(0, "call_a", "get_weather"),
        ArgumentsDelta(0, first[:9]), ArgumentsDelta(0, first[9:]),
        CallStarted(1, "call_b", "get_time"),
        ArgumentsDelta(1, '{"zone": '), ArgumentsDelta(1, '"UTC"}'),
        Finished("tool_calls"), Usage(5, 9),
    ]  # fmt: skip
    draft = ResponseDraft("toy", {"parallel_tool_calls": True, "tool_choice": "auto",
                                  "tools": []})  # fmt: skip
    events = draft.begin()
    for event in streamed_events:
        events += draft.apply([event])
    events += draft.end()
    state: ResponseStreamState[Any] = ResponseStreamState(
        input_tools=TOOLS, text_format=openai.omit
    )
    for event in events:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event))  # type: ignore[arg-type]
    final = state._completed_response
    assert final is not None
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    message, weather, time = final.output
    assert message.type == "message"
    assert final.output_text == "Let me check."
    assert weather.type == "function_call"
    assert time.type == "function_call"
    assert (weather.call_id, weather.name, weather.arguments) == ("call_a", "get_weather", first)
    assert (time.call_id, time.name, time.arguments) == ("call_b", "get_time", '{"zone": "UTC"}')
    assert final.usage is not None
    assert final.usage.total_tokens == 14

    whole = ResponseDraft("toy", {})
    whole.apply([TextDelta("Let me check."), CallStarted(0, "call_a", "get_weather"),
                 ArgumentsDelta(0, first), CallStarted(1, "call_b", "get_time"),
                 ArgumentsDelta(1, '{"zone": "UTC"}'), Finished("tool_calls")])  # fmt: skip
    whole.end()  # fmt: skip
    items = whole.response()["output"]
    assert [item["type"] for item in items] == ["message", "function_call", "function_call"]
    assert [item.get("arguments") for item in items[1:]] == [first, '{"zone": "UTC"}']


def _pieces(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at ``cuts`` (positions, any order, repeats allowed)."""
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


def _without_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: value for key, value in item.items() if key != "id"} for item in output]


@given(
    content=st.text(max_size=20),
    calls=st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]),
                             st.text(max_size=20)), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    reason=st.sampled_from(["stop", "tool_calls", "length"]),
)  # fmt: skip
def test_any_chunking_of_an_answer_gives_the_whole_answers_response(
    content: str, calls: list[tuple[str, str]], cuts: list[int], reason: str
) -> None:
    """The property behind streaming: however the chat service cuts an answer into events,
    the streamed Response (and what the SDK accumulates from its events) is the whole one's."""
    ids = [f"call_{index}" for index in range(len(calls))]
    pieces: list[AnswerEvent] = [TextDelta(piece) for piece in _pieces(content, cuts)]
    for index, ((name, arguments), call_id) in enumerate(zip(calls, ids, strict=True)):
        pieces.append(CallStarted(index, call_id, name))
        pieces += [ArgumentsDelta(index, piece) for piece in _pieces(arguments, cuts)]
    pieces.append(Finished(reason))
    streamed = ResponseDraft("toy", {})
    events = streamed.begin()
    for event in pieces:
        events += streamed.apply([event])
    events += streamed.end()
    whole_events: list[AnswerEvent] = [TextDelta(content)]
    for index, ((name, arguments), call_id) in enumerate(zip(calls, ids, strict=True)):
        whole_events += [CallStarted(index, call_id, name), ArgumentsDelta(index, arguments)]
    whole = ResponseDraft("toy", {})
    whole.apply([*whole_events, Finished(reason)])
    whole.end()
    assert _without_ids(streamed.response()["output"]) == _without_ids(whole.response()["output"])
    assert streamed.status == whole.status == ("incomplete" if reason == "length" else "completed")
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[], text_format=openai.omit)
    for event in events:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event))  # type: ignore[arg-type]
    done = state._completed_output  # the items of the output_item.done events, as parsed
    assert [done[index].to_dict() for index in sorted(done)] == streamed.response()["output"]


@pytest.mark.parametrize("digits", [5_000, 20])
async def test_a_name_like_a_chat_field_with_a_huge_index_is_a_400(digits: int) -> None:
    """The chat path's error names the function as given; renaming its ``messages[k]`` for
    the Responses request must not parse 5,000 digits (``int()`` refuses past 4,300)."""
    name = "messages[" + "9" * digits + "]"
    async with served() as server:
        with pytest.raises(openai.BadRequestError) as caught:
            await server.client.responses.create(
                model="toy", input="Hi", max_output_tokens=4, tools=TOOLS,
                tool_choice={"type": "function", "name": name},
            )  # fmt: skip
        assert server.engine.submitted == []
    assert caught.value.status_code == 400
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "tool_choice"
    assert "which is not one of tools (get_weather, get_time)" in error["message"]
