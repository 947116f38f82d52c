"""Tools and history through a chat template's own ``tools`` variable (Qwen2.5-, Llama 3.1-
and Mistral-shaped templates, tests/engine/tools/templates.py), on both of HFTokenizer's
renderers: transformers' and the saved tokenizer's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.text.test_tokenizer import write_model_directory
from tests.engine.tools.templates import LLAMA31_LIKE, MISTRAL_LIKE, QWEN_LIKE
from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.text.saved_tokenizer import SavedTokenizer
from twostroke.engine.text.tokenizer import ChatTemplateError, HFTokenizer
from twostroke.engine.tools import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolCall,
    ToolFormat,
    ToolSpec,
    Turn,
    choose_tool_format,
    native_template,
    parse_output,
    template_messages,
    tool_prompt,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [ToolSpec("get_weather", "The weather in a city", WEATHER)]
TURNS = [
    Turn("system", "Be brief."),
    Turn("user", "Weather in Oslo?"),
    Turn("assistant", "", (ToolCall("call_0123456789abcdef", "get_weather", '{"city": "Oslo"}'),)),
    Turn("tool", "sunny, 21 C", tool_call_id="call_0123456789abcdef"),
]
CASES = [(QWEN_LIKE, HERMES), (LLAMA31_LIKE, LLAMA3_JSON), (MISTRAL_LIKE, MISTRAL)]


def test_the_format_is_chosen_from_what_the_template_writes() -> None:
    assert [choose_tool_format(template) for template, _ in CASES] == [fmt for _, fmt in CASES]
    assert choose_tool_format("{{ bos_token }}<|start_header_id|>{{ m.content }}") is GENERIC
    assert choose_tool_format("<|im_start|>{{ m.role }}") is GENERIC


def _tokenizers(directory: Path, template: str) -> tuple[HFTokenizer, HFTokenizer, SavedTokenizer]:
    write_model_directory(directory, chat_template=template)
    saved = SavedTokenizer.read(directory)
    ours = HFTokenizer(saved, source=str(directory))
    return HFTokenizer.from_pretrained(directory), ours, saved


@pytest.mark.parametrize(("template", "fmt"), CASES, ids=[fmt.name for _, fmt in CASES])
def test_tools_calls_and_results_reach_the_template(
    tmp_path: Path, template: str, fmt: ToolFormat
) -> None:
    """The template shows the tools, the assistant's call in the syntax the model writes
    (so the parser reads it back) and the result; transformers and the saved tokenizer give
    the same ids."""
    theirs, ours, saved = _tokenizers(tmp_path, template)
    assert native_template(fmt, ours) is ours
    ids = tool_prompt(fmt, TURNS, TOOLS, ours)
    assert ids == tool_prompt(fmt, TURNS, TOOLS, theirs)
    text = saved.render_chat(template_messages(fmt, TURNS), [t.shown() for t in TOOLS])
    assert '"description": "The weather in a city"' in text
    assert "sunny, 21 C" in text
    written = text[text.index(fmt.first + '{"name": "get_weather"') :]
    (call,) = parse_output(fmt, written).calls
    assert call.name == "get_weather"
    # Mistral's templates write the call's id after its arguments, as this one does.
    assert call.arguments.removesuffix(
        f', "id": "{fmt.template_call_id(TURNS[2].tool_calls[0].id)}"'
    ) == ('{"city": "Oslo"}')


def test_a_result_gets_its_calls_name_and_mistral_ids_are_nine_characters() -> None:
    qwen = template_messages(HERMES, TURNS)
    assert qwen[2]["tool_calls"] == [{"id": "call_0123456789abcdef", "type": "function",
                                      "function": {"name": "get_weather",
                                                   "arguments": {"city": "Oslo"}}}]  # fmt: skip
    assert qwen[3] == {"role": "tool", "content": "sunny, 21 C",
                       "tool_call_id": "call_0123456789abcdef", "name": "get_weather"}  # fmt: skip
    mistral = template_messages(MISTRAL, TURNS)
    call_id = mistral[2]["tool_calls"][0]["id"]
    assert len(call_id) == 9
    assert call_id.isalnum()
    assert mistral[3]["tool_call_id"] == call_id  # the result names the same call
    assert MISTRAL.template_call_id("abcDEF123") == "abcDEF123"  # a valid id stays
    assert len(MISTRAL.new_call_id()) == 9


def test_a_template_that_refuses_the_conversation_is_a_chat_template_error(
    tmp_path: Path,
) -> None:
    _, ours, _ = _tokenizers(tmp_path, LLAMA31_LIKE)
    two: Any = (ToolCall("a", "get_weather", "{}"), ToolCall("b", "get_weather", "{}"))
    with pytest.raises(ChatTemplateError, match="rejected the messages: one tool call at a time"):
        tool_prompt(LLAMA3_JSON, [Turn("user", "?"), Turn("assistant", "", two)], TOOLS, ours)


def test_without_a_template_that_reads_tools_the_prompt_is_plain_messages(
    tmp_path: Path,
) -> None:
    _, ours, _ = _tokenizers(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert native_template(LLAMA3_JSON, ours) is None  # its template never reads tools
    assert native_template(GENERIC, ours) is None  # a format of no template
    assert native_template(HERMES, ByteTokenizer()) is None  # it cannot render tools
    assert native_template(HERMES, None) is None  # a coordinator's front holds no tokenizer
    plain = tool_prompt(LLAMA3_JSON, TURNS, TOOLS)
    call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert plain[2] == {"role": "assistant", "content": call}
    assert plain[3] == {"role": "tool", "content": "sunny, 21 C"}
