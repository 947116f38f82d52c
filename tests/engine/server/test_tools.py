"""Agents over HTTP: tools shown to the model, tool_choice "auto", streamed tool calls,
response_format with tools (issue 36), driven by the OpenAI SDK against a scripted toy."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import anyio
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState

from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.server import build_app
from twostroke.engine.server.generation import ChatFormat
from twostroke.engine.server.structured import ToolCalls
from twostroke.engine.text.chat_template import render_chat
from twostroke.engine.tools import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolFormat,
    tokenizer_tool_format,
)

from ..tools.templates import LLAMA31_LIKE, MISTRAL_LIKE, QWEN_LIKE
from .conftest import OPENAI_STREAMS_ON_TRIO, served
from .scripted import ScriptedRunner

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
CALLING = f"Let me check. <tool_call>\n{CALL}\n</tool_call>"
ANSWER = "It is sunny in Oslo."


def agent(prompt: str) -> str:
    """The scripted model: calls the weather tool, then answers from its result."""
    if "<tool_response>" in prompt:
        return ANSWER
    return CALLING


async def test_an_agent_loop_finishes_a_call_then_a_text_answer() -> None:
    """The OpenAI SDK's default tool loop: tools without tool_choice ("auto"), the call, the
    tool's result sent back, then the model's text answer."""
    async with served(runner=ScriptedRunner(agent)) as server:
        first = await server.client.chat.completions.create(
            model="toy",
            messages=ASK,
            tools=TOOLS,  # type: ignore[arg-type]
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check. "
        (call,) = choice.message.tool_calls or []
        assert call.type == "function"
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
        assert arguments == {"city": "Oslo", "unit": "celsius"}
        history = [*ASK, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
        second = await server.client.chat.completions.create(
            model="toy",
            messages=history,
            tools=TOOLS,
            tool_choice="auto",  # type: ignore[arg-type]
        )
        assert second.choices[0].finish_reason == "stop"
        assert second.choices[0].message.content == ANSWER
        assert not second.choices[0].message.tool_calls
        # The model saw the tools, its own call and the result, in the format's syntax.
        (first_prompt, params), (second_prompt, _) = server.engine.submitted
        assert params.constraint is not None
        assert first_prompt[0]["role"] == "system"
        assert '"name": "get_weather", "description": "The weather now"' in first_prompt[0][
            "content"]  # fmt: skip
        assert second_prompt[2] == {"role": "assistant", "content": CALLING}
        assert second_prompt[3] == {
            "role": "tool",
            "content": "<tool_response>\nsunny, 21 C\n</tool_response>",
        }
        models = await server.client.models.list()
        assert models.data[0].model_extra == {"max_model_len": 4096, "tool_format": "generic"}


async def test_the_tool_format_is_chosen_by_name_or_from_the_template() -> None:
    async with served(runner=ScriptedRunner(agent), serve_options={"tool_format": "hermes"}) as (
        server
    ):
        models = await server.client.models.list()
        assert models.data[0].model_extra == {"max_model_len": 4096, "tool_format": "hermes"}
        history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1",
                   "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]  # fmt: skip
        await server.client.chat.completions.create(
            model="toy",
            messages=history,
            tools=TOOLS,  # type: ignore[arg-type]
        )
        prompt, _ = server.engine.submitted[-1]
        assert prompt[-1] == {"role": "tool", "content": "12:00"}  # the template wraps it
        with pytest.raises(ValueError, match="tool_format must be one of generic, hermes, llama"):
            build_app(server.engine, tool_format="xml")
    tokenizer = type("T", (), {"chat_template": "{{ '<tool_call>' }}"})()
    assert tokenizer_tool_format(tokenizer) is HERMES
    assert tokenizer_tool_format(ByteTokenizer()) is GENERIC  # a tokenizer without a template
    assert tokenizer_tool_format(None) is GENERIC  # a coordinator's front holds no tokenizer


class TemplateByteTokenizer(ByteTokenizer):
    """The toy's bytes with a chat template that reads ``tools``, rendered as the saved
    tokenizer renders one (its generation prompt made the toy's ``<assistant>``, where the
    scripted model answers)."""

    def __init__(self, template: str) -> None:
        self._template = template + "{% if add_generation_prompt %}<assistant>{% endif %}"

    @property
    def chat_template(self) -> str:
        return self._template

    def apply_tool_template(self, messages: Any, tools: Any) -> list[int]:
        special_tokens = {"bos_token": "", "eos_token": ""}
        rendered = render_chat(self._template, list(messages), tools, special_tokens)
        return self.encode(rendered)


#: The templates, their generation prompts cut (the tokenizer above adds the toy's).
NATIVE = [
    (QWEN_LIKE.removesuffix("{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
     HERMES, "Let me check. "),
    (LLAMA31_LIKE.removesuffix(
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"), LLAMA3_JSON, ""),
    (MISTRAL_LIKE, MISTRAL, "Let me check. "),
]  # fmt: skip


@pytest.mark.parametrize(("template", "fmt", "lead"), NATIVE, ids=[f.name for _, f, _ in NATIVE])
async def test_a_template_that_knows_tools_shows_them_and_the_history(
    template: str, fmt: ToolFormat, lead: str
) -> None:
    """The format comes from the template; "auto" reads a call in the family's syntax,
    streamed and whole alike; the next request's prompt is the template's rendering of the
    tools, the call and the result (its tools variable, tool_calls and tool messages)."""
    assert "<assistant>" not in template  # the cut generation prompt was there to cut
    calling = lead + fmt.call_text("get_weather", {"city": "Oslo", "unit": "celsius"})

    def script(prompt: str) -> str:
        return ANSWER if "sunny, 21 C" in prompt else calling

    tokenizer = TemplateByteTokenizer(template)
    async with served(runner=ScriptedRunner(script), tokenizer=tokenizer) as server:
        models = await server.client.models.list()
        assert models.data[0].model_extra == {"max_model_len": 4096, "tool_format": fmt.name}
        whole = await server.client.chat.completions.create(
            model="toy",
            messages=ASK,
            tools=TOOLS,  # type: ignore[arg-type]
        )
        async with server.client.chat.completions.stream(
            model="toy",
            messages=ASK,
            tools=TOOLS,  # type: ignore[arg-type]
        ) as stream:
            final = await stream.get_final_completion()
        for choice in (whole.choices[0], final.choices[0]):
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == (lead or None)
            (call,) = choice.message.tool_calls or []
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "celsius"}  # type: ignore[union-attr]
        call = (whole.choices[0].message.tool_calls or [])[0]
        if fmt is MISTRAL:
            assert len(call.id) == 9
            assert call.id.isalnum()
        history = [*ASK, whole.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
        second = await server.client.chat.completions.create(
            model="toy",
            messages=history,
            tools=TOOLS,  # type: ignore[arg-type]
        )
        assert (second.choices[0].message.content, second.choices[0].finish_reason) == (
            ANSWER, "stop")  # fmt: skip
        prompt, _ = server.engine.submitted[-1]
        shown = tokenizer.decode(prompt)  # ids: the template rendered the conversation
        assert '"name": "get_weather", "description": "The weather now"' in shown.replace(
            '",\n        "', '", "')  # fmt: skip
        assert fmt.first + '{"name": "get_weather", ' in shown  # the call, as the model wrote it
        assert "sunny, 21 C" in shown
        if fmt is MISTRAL:  # the result names the call by the id the template takes
            assert f'"call_id": "{call.id}"' in shown


async def test_a_streamed_call_reassembles_to_the_complete_answer() -> None:
    """OpenAI's delta sequence (index/id/type/name first, then arguments pieces), no piece of
    the trigger in content deltas, and the SDK's accumulator gives the non-streamed answer."""
    async with served(runner=ScriptedRunner(agent)) as server:
        whole = await server.client.chat.completions.create(
            model="toy",
            messages=ASK,
            tools=TOOLS,  # type: ignore[arg-type]
        )
        async with server.client.chat.completions.stream(
            model="toy",
            messages=ASK,
            tools=TOOLS,  # type: ignore[arg-type]
        ) as stream:
            chunks = [event.chunk async for event in stream if event.type == "chunk"]
            final = await stream.get_final_completion()
        raw = await server.http.post("/v1/chat/completions", json={
            "messages": ASK, "tools": TOOLS, "stream": True})  # fmt: skip
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert content == "Let me check. "
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert calls[0].id is not None
    assert calls[0].type == "function"
    assert calls[0].function is not None
    assert (calls[0].function.name, calls[0].function.arguments) == ("get_weather", "")
    assert all(c.id is None and c.function and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments or "" for c in calls if c.function) == CALL[37:-1]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    expected, got = whole.choices[0], final.choices[0]
    assert got.finish_reason == expected.finish_reason == "tool_calls"
    assert got.message.content == expected.message.content
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == [
        (c.function.name, c.function.arguments)
        for c in expected.message.tool_calls or []  # type: ignore[union-attr]
    ]
    assert "<tool" not in raw.text.split("tool_calls")[0]  # nothing of the trigger as content


async def test_tool_choice_none_required_named_and_a_format() -> None:
    """ "none" shows no tools and constrains nothing; "required" after a tool result still
    calls; a named function calls it; response_format constrains the text branch of "auto"
    and is ignored with "required"."""
    answer = {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy"]}},
              "required": ["sky"], "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}

    def script(prompt: str) -> str:
        if "FORMAT" in prompt:
            return '{"sky": "clear"}'
        if "CALL NOW" in prompt:  # with a format, a call starts at once (no text before it)
            return CALLING.removeprefix("Let me check. ")
        return "plain words" if "NONE" in prompt else CALLING

    async with served(runner=ScriptedRunner(script)) as server:
        body: dict[str, Any] = {"model": "toy", "tools": TOOLS, "max_tokens": 200}
        none = await server.http.post("/v1/chat/completions", json=body | {
            "messages": [{"role": "user", "content": "NONE"}], "tool_choice": "none"})  # fmt: skip
        assert none.json()["choices"][0]["message"] == {"role": "assistant",
                                                         "content": "plain words"}  # fmt: skip
        prompt, params = server.engine.submitted[-1]
        assert params.constraint is None
        assert "# Tools" not in json.dumps(prompt)
        history = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        ]  # fmt: skip
        required = await server.http.post("/v1/chat/completions", json=body | {
            "messages": history, "tool_choice": "required"})  # fmt: skip
        choice = required.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        for call in choice["message"]["tool_calls"]:
            schema = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                schema[call["function"]["name"]])  # fmt: skip
        only_time = {"type": "function", "function": {"name": "get_time"}}
        named = await server.http.post("/v1/chat/completions", json=body | {
            "messages": ASK, "tool_choice": only_time})  # fmt: skip
        (call,) = named.json()["choices"][0]["message"]["tool_calls"]
        assert (call["function"]["name"], call["function"]["arguments"]) == ("get_time", "{}")
        formatted = await server.http.post("/v1/chat/completions", json=body | {
            "messages": [{"role": "user", "content": "FORMAT"}],
            "response_format": response_format})  # fmt: skip
        assert formatted.json()["choices"][0]["message"]["content"] == '{"sky": "clear"}'
        called = await server.http.post("/v1/chat/completions", json=body | {
            "messages": [{"role": "user", "content": "CALL NOW"}],
            "response_format": response_format})  # fmt: skip
        assert called.json()["choices"][0]["finish_reason"] == "tool_calls"  # a call, not JSON
        ignored = await server.http.post("/v1/chat/completions", json=body | {
            "messages": [{"role": "user", "content": "FORMAT"}], "tool_choice": "required",
            "response_format": response_format})  # fmt: skip
        assert ignored.json()["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_call_cut_by_max_tokens_is_dropped_and_a_cancel_mid_call_loses_nothing() -> None:
    async with served(runner=ScriptedRunner(agent)) as server:
        cut = await server.client.chat.completions.create(
            model="toy",
            messages=ASK,
            tools=TOOLS,
            max_tokens=40,  # type: ignore[arg-type]
        )
        assert cut.choices[0].finish_reason == "length"
        assert cut.choices[0].message.content == "Let me check. "  # none of the call's text
        assert not cut.choices[0].message.tool_calls
        async with server.client.chat.completions.stream(
            model="toy",
            messages=ASK,
            tools=TOOLS,  # type: ignore[arg-type]
        ) as stream:
            async for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    break  # leaving the block closes the stream mid-call: a disconnect
        with anyio.fail_after(20):
            await server.engine.wait_idle()
        before = server.engine.statistics().num_masked_rows
        plain = await server.client.chat.completions.create(model="toy", messages=ASK)
        assert plain.choices[0].message.content == CALLING  # unconstrained, unchanged
        assert server.engine.statistics().num_masked_rows == before  # nothing constrained
    # served() checked on leaving: every request ended, every KV block free, books agree


#: Three calls in a row, as a model under "required" writes them until its token limit.
_THREE = [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {}),
          ("get_weather", {"city": "Bergen", "unit": "celsius"})]  # fmt: skip
_CALLS = GENERIC.calls_text(_THREE)
_OPENERS = [found.start() for found in re.finditer("<tool_call>", _CALLS)]
_SAID = "Let me check. "


def _calling(prompt: str) -> str:
    """The scripted model: text, then the three calls; the calls alone when told to call."""
    return _CALLS if "Call now." in prompt else _SAID + _CALLS


async def _whole_and_streamed(server: Any, **body: Any) -> list[tuple[Any, ...]]:
    """The answer to ``body``, whole and streamed (the SDK's own accumulator, which does not
    raise for "length" as its ``stream()`` helper does), each as content, calls, finish."""
    answers = []
    whole = await server.client.chat.completions.create(model="toy", **body)
    chunks = await server.client.chat.completions.create(model="toy", stream=True, **body)
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    async for chunk in chunks:
        state.handle_chunk(chunk)
    for completion in (whole, state.current_completion_snapshot):
        choice = completion.choices[0]
        calls = [(c.function.name, c.function.arguments)  # type: ignore[union-attr]
                 for c in choice.message.tool_calls or []]  # fmt: skip
        answers.append((choice.message.content, calls, choice.finish_reason))
    return answers


async def test_calls_cut_by_max_tokens_keep_every_complete_call() -> None:
    """Calls cut by the token limit (finding 6 of issue 48): every complete call is a tool
    call, the one the limit cut is dropped (none of its markup as content), and the finish
    reason is "tool_calls" when a call is complete, "length" when none is; a stream's
    accumulated answer is the complete one. ``parallel_tool_calls`` false ends the output
    after one call."""
    complete = [(name, json.dumps(arguments)) for name, arguments in _THREE]
    async with served(runner=ScriptedRunner(_calling)) as server:
        for choice in ("auto", "required"):
            lead = _SAID if choice == "auto" else ""  # "required" allows no text
            body: dict[str, Any] = {"tools": TOOLS, "messages": [
                {"role": "user", "content": "Weather?" if lead else "Call now."}]}  # fmt: skip
            inside_third = len((lead + _CALLS[: _OPENERS[2] + 30]).encode())
            answers = await _whole_and_streamed(
                server, **body, tool_choice=choice, max_tokens=inside_third
            )
            assert answers == [(lead or None, complete[:2], "tool_calls")] * 2, choice
            inside_first = len((lead + _CALLS[:30]).encode())
            answers = await _whole_and_streamed(
                server, **body, tool_choice=choice, max_tokens=inside_first
            )
            assert answers == [(lead or None, [], "length")] * 2, choice
            answers = await _whole_and_streamed(
                server, **body, tool_choice=choice, parallel_tool_calls=False, max_tokens=400
            )
            assert answers == [(lead or None, complete[:1], "tool_calls")] * 2, choice
            one = len((lead + GENERIC.calls_text(_THREE[:1])).encode())
            whole = await server.client.chat.completions.create(
                model="toy", **body, tool_choice=choice, parallel_tool_calls=False, max_tokens=400
            )
            assert whole.usage is not None
            assert whole.usage.completion_tokens == one, choice  # the call, then EOS at once


async def test_responses_cut_by_max_output_tokens_keep_every_complete_call() -> None:
    """The same rule on /v1/responses: complete calls are function_call items of a
    "completed" response; with none complete it is "incomplete" (max_output_tokens), and
    no item holds the format's markup. Streamed and whole agree."""
    tools = [{"type": "function", "name": each["function"]["name"],
              "parameters": each["function"]["parameters"]} for each in TOOLS]  # fmt: skip
    async with served(runner=ScriptedRunner(_calling)) as server:
        for cut, status, expected in (
            (_OPENERS[2] + 30, "completed", [(n, json.dumps(a)) for n, a in _THREE[:2]]),
            (30, "incomplete", []),
        ):
            body: dict[str, Any] = {
                "model": "toy", "input": "Call now.", "tools": tools,
                "tool_choice": "required", "max_output_tokens": len(_CALLS[:cut].encode()),
            }  # fmt: skip
            whole = await server.client.responses.create(**body)
            # (the SDK's stream() helper gives a final response only for a "completed" one)
            events = [event async for event in await server.client.responses.create(
                **body, stream=True)]  # fmt: skip
            assert events[-1].type == f"response.{status}"
            streamed = events[-1].response  # type: ignore[union-attr]
            for response in (whole, streamed):
                assert response.status == status
                calls = [(item.name, item.arguments) for item in response.output
                         if item.type == "function_call"]  # fmt: skip
                assert calls == expected
                assert "<tool_call>" not in response.model_dump_json()
                reason = response.incomplete_details and response.incomplete_details.reason
                assert reason == (None if status == "completed" else "max_output_tokens")


# openai-agents runs on asyncio only (its runner makes asyncio tasks): this one is about it.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_openai_agents_chat_completions_model_finishes_its_loop() -> None:
    """openai-agents' ``Runner.run`` on its chat completions model, default settings (tools
    offered, ``tool_choice`` left to the default "auto"): the call, the result, the answer."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    ran: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        ran.append((city, unit))
        return "sunny"

    set_tracing_disabled(True)  # it would post traces to OpenAI otherwise
    async with served(runner=ScriptedRunner(agent)) as server:
        model = OpenAIChatCompletionsModel(model="toy", openai_client=server.client)
        weather = Agent(name="weather", instructions="You help.", tools=[get_weather],
                        model=model)  # fmt: skip
        result = await Runner.run(weather, "Weather in Oslo?")
        assert len(server.engine.submitted) == 2  # the call, then the answer
        second, _ = server.engine.submitted[1]
    assert result.final_output == ANSWER
    assert ran == [("Oslo", "celsius")]
    assert "<tool_response>" in second[-1]["content"]


#: The bodies that each library's default loop sent in scripts/agent_loops.py's run against
#: SmolLM2 (docs/structured-output.md, "Agent libraries"), the model's name and the call ids
#: shortened: the first turn (the call forced) and the turn that carries the tool's result.
_CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
_STRICT = {"properties": {"city": {"description": "The city.", "title": "City", "type": "string"}},
           "required": ["city"], "title": "get_weather_args", "type": "object",
           "additionalProperties": False}  # fmt: skip
_ASKED = {"role": "user", "content": "Use the get_weather tool for Oslo."}
_SYSTEM = {"role": "system", "content": "You answer questions about the weather."}
_RESULT = "Sunny, 21 degrees Celsius in Oslo."


def _weather(parameters: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": "get_weather", "parameters": parameters,
                                "description": "The current weather in a city."}  # fmt: skip
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def _called(arguments: str = '{"city": "Oslo"}', **extra: Any) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return {"role": "assistant", "tool_calls": [call | extra]}


_NAMED = {"type": "function", "function": {"name": "get_weather"}}
LIBRARY_TURNS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "openai-sdk-stream-accumulator": (
        {"stream": True, "messages": [_ASKED], "tools": [_weather(_CITY)], "tool_choice": _NAMED,
         "max_tokens": 96, "temperature": 0},
        {"stream": True, "messages": [_ASKED, _called(index=0),
         {"role": "tool", "tool_call_id": "call_1", "content": _RESULT}],
         "tools": [_weather(_CITY)], "max_tokens": 96, "temperature": 0}),
    "langchain-openai": (
        {"stream": False, "messages": [_ASKED], "max_completion_tokens": 96, "temperature": 0.0,
         "tool_choice": _NAMED, "tools": [_weather(_CITY)]},
        {"stream": False, "messages": [_ASKED, {"content": None} | _called(),
         {"content": _RESULT, "role": "tool", "tool_call_id": "call_1"}],
         "max_completion_tokens": 96, "temperature": 0.0, "tools": [_weather(_CITY)]}),
    "litellm": (
        {"messages": [_ASKED], "temperature": 0, "max_tokens": 96, "tools": [_weather(_CITY)],
         "tool_choice": _NAMED},
        {"messages": [_ASKED, _called(), {"role": "tool", "tool_call_id": "call_1",
         "name": "get_weather", "content": _RESULT}], "temperature": 0, "max_tokens": 96,
         "tools": [_weather(_CITY)]}),
    "pydantic-ai": (
        {"messages": [_SYSTEM, _ASKED], "stream": False, "max_completion_tokens": 96,
         "temperature": 0, "tool_choice": "required",
         "tools": [_weather(_STRICT, strict=True)]},
        {"messages": [_SYSTEM, _ASKED, {"content": None} | _called('{"city":"Oslo"}'),
         {"role": "tool", "tool_call_id": "call_1", "content": _RESULT}], "stream": False,
         "max_completion_tokens": 96, "temperature": 0, "tool_choice": "auto",
         "tools": [_weather(_STRICT, strict=True)]}),
    "openai-agents-chat": (
        {"messages": [_SYSTEM, _ASKED], "max_tokens": 96, "temperature": 0.0,
         "tool_choice": _NAMED, "tools": [_weather(_STRICT, strict=True)]},
        {"messages": [_SYSTEM, _ASKED, {"content": None} | _called(),
         {"role": "tool", "tool_call_id": "call_1", "content": _RESULT}], "max_tokens": 96,
         "temperature": 0.0, "tools": [_weather(_STRICT, strict=True)]}),
}  # fmt: skip


def _answer(reply: Any, stream: bool) -> tuple[str | None, list[Any], str]:
    """A chat answer's content, calls and finish reason, from its JSON or its SSE events."""
    assert reply.status_code == 200, reply.text
    if not stream:
        choice = reply.json()["choices"][0]
        message = choice["message"]
        return message["content"], message.get("tool_calls", []), choice["finish_reason"]
    content, calls, finish = None, [], ""
    for line in reply.text.splitlines():
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line.removeprefix("data: "))["choices"][0]
        if choice["delta"].get("content"):
            content = (content or "") + choice["delta"]["content"]
        calls += choice["delta"].get("tool_calls", [])
        finish = choice["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize("library", list(LIBRARY_TURNS))
async def test_the_bodies_agent_libraries_send_are_answered(library: str) -> None:
    """Each library's two turns as it sent them (null or absent content beside calls, a
    stream accumulator's ``index``, a result's ``name``, strict tools, ``tool_choice``
    "required" or named, ``max_completion_tokens``): the call, then the text answer."""
    first, second = LIBRARY_TURNS[library]
    calling = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

    def script(prompt: str) -> str:
        return ANSWER if _RESULT in prompt else calling

    async with served(runner=ScriptedRunner(script)) as server:
        stream = bool(first.get("stream"))
        reply = await server.http.post("/v1/chat/completions", json={"model": "toy"} | first)
        _, calls, finish = _answer(reply, stream)
        assert finish == "tool_calls"
        assert calls[0]["function"]["name"] == "get_weather"
        reply = await server.http.post("/v1/chat/completions", json={"model": "toy"} | second)
        assert _answer(reply, stream) == (ANSWER, [], "stop")
        prompt, _ = server.engine.submitted[-1]
        assert prompt[-1] == {
            "role": "tool",
            "content": f"<tool_response>\n{_RESULT}\n</tool_response>",
        }


_TEXT = st.text(alphabet='ab <_>{}"\\:,\n', max_size=12)
_ARGS = st.dictionaries(st.sampled_from(["city", "x"]), st.text(alphabet='a"}{\\<', max_size=6),
                        max_size=2)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    text=_TEXT,
    calls=st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]), _ARGS), max_size=3),
    cuts=st.lists(st.integers(0, 400), max_size=10),
    limit=st.none() | st.integers(0, 400),
)
def test_streamed_deltas_concatenate_to_the_complete_answer(
    text: str, calls: list[tuple[str, dict[str, str]]], cuts: list[int], limit: int | None
) -> None:
    """Whatever the text and calls, cut into any deltas, and cut anywhere by the token limit
    (``limit``): the chunks, accumulated as the SDK does, are the complete answer (content,
    each call's name and arguments, finish), and a cut call is in neither."""
    if "<tool_call>" in text:
        return  # the lazy constraint never lets text hold the trigger
    output = text + "\n".join(GENERIC.call_text(name, args) for name, args in calls)
    reason = "stop"
    if limit is not None:
        output, reason = output[: limit % (len(output) + 1)], "length"
    fmt = ChatFormat(None, 0, ToolCalls(GENERIC))  # type: ignore[arg-type]
    whole = fmt.choice(0, output, None, reason, chunk=False)
    bounds = sorted({0, len(output), *(cut % (len(output) + 1) for cut in cuts)})
    chunks = []
    for start, end in itertools.pairwise(bounds):
        last = end == len(output)
        chunks += fmt.chunks(0, output[start:end], None, reason if last else None)
    if len(bounds) == 1:
        chunks += fmt.chunks(0, "", None, reason)
    content, streamed = "", {}
    for chunk in chunks:
        delta = chunk["delta"]
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = streamed.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"]["arguments"]
    message = whole["message"]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    assert whole["finish_reason"] == ("tool_calls" if message.get("tool_calls") else reason)
    assert content == (message["content"] or "")
    assert "<tool_call>" not in content
    expected = [call["function"] for call in message.get("tool_calls", [])]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in expected] == [
        streamed[index] for index in sorted(streamed)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the model's path; both run the toy's
async def test_smollm2_calls_a_tool_then_answers_from_its_result() -> None:
    """SmolLM2-135M (generic format: its ChatML template knows no tools) through the SDK: a
    call (required, one), the tool's result, then a text answer under "auto"."""
    from functools import partial

    from twostroke.engine import Engine
    from twostroke.engine.server import serve

    from .conftest import openai_client

    tools: list[Any] = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                       "maxLength": 40}}, "required": ["city"], "additionalProperties": False},
    }}]  # fmt: skip
    messages: list[Any] = [
        {"role": "system", "content": "Answer the user from the tool's result, in one sentence."},
        {"role": "user", "content": "What is the weather in Oslo?"},
    ]
    async with Engine.open(model="smollm2", device="cpu") as engine:
        async with anyio.create_task_group() as task_group:
            port = await task_group.start(partial(serve, engine, port=0))
            async with openai_client(f"http://127.0.0.1:{port}/v1", api_key="-") as client:
                models = await client.models.list()
                called = await client.chat.completions.create(
                    model="smollm2", messages=messages, tools=tools, tool_choice="required",
                    parallel_tool_calls=False, max_tokens=60, temperature=0,
                )  # fmt: skip
                message = called.choices[0].message
                (call,) = message.tool_calls or []
                messages += [message.model_dump(exclude_none=True), {
                    "role": "tool", "tool_call_id": call.id,
                    "content": "Sunny, 21 degrees Celsius"}]  # fmt: skip
                answered = await client.chat.completions.create(
                    model="smollm2", messages=messages, tools=tools, max_tokens=40,
                    temperature=0,
                )  # fmt: skip
            task_group.cancel_scope.cancel()
    assert models.data[0].model_extra is not None
    assert models.data[0].model_extra["tool_format"] == "generic"
    assert called.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"] == "Oslo"  # type: ignore[union-attr]
    answer = answered.choices[0]
    assert answer.finish_reason == "stop"
    assert not answer.message.tool_calls
    assert "sunny" in (answer.message.content or "").lower()
