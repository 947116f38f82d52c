"""Tool calling's pure parts: formats, the prompt, the lazy grammar, the parser."""

from __future__ import annotations

import json
from typing import Any

import attrs
import jsonschema
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from twostroke.engine.runners.toy import EOS_TOKEN_ID, ByteTokenizer
from twostroke.engine.structured import GrammarCompiler, Vocabulary
from twostroke.engine.tools import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ArgumentsDelta,
    CallStarted,
    TextDelta,
    ToolCall,
    ToolCallParser,
    ToolFormat,
    ToolSpec,
    Turn,
    choose_tool_format,
    parse_output,
    render_prompt,
    tool_constraint,
    tool_format,
)
from twostroke.states.constraints import JsonSchema
from twostroke.states.errors import ConstraintRejected

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    ToolSpec("get_weather", "The weather in a city", WEATHER),
    ToolSpec("now", None, {"type": "object", "properties": {}, "additionalProperties": False}),
]
SCHEMAS = {tool.name: tool.parameters for tool in TOOLS}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(Vocabulary.from_tokenizer(ByteTokenizer()))


def _accepts(compiler: GrammarCompiler, grammar: Any, text: str) -> bool:
    matcher = compiler.compile_now(grammar).matcher()
    for byte in text.encode():
        if byte not in matcher.allowed_token_ids():
            return False
        matcher.advance(byte)
    return EOS_TOKEN_ID in matcher.allowed_token_ids()


def test_formats_are_chosen_from_the_template_or_by_name() -> None:
    assert choose_tool_format("{% for m in messages %}<tool_call>{% endfor %}") is HERMES
    assert choose_tool_format("<|im_start|>{{ m.role }}") is GENERIC
    assert choose_tool_format(None) is GENERIC
    assert tool_format("hermes") is HERMES
    with pytest.raises(
        ValueError,
        match="tool_format must be one of generic, hermes, llama3_json, mistral, got 'x'",
    ):
        tool_format("x")
    with pytest.raises(ValueError, match="1 to 64 letters, digits, underscores or dashes"):
        ToolSpec("a b")


def test_every_reader_of_a_function_name_uses_the_one_rule() -> None:
    """The parser, the grammar's error reader and ToolSpec read names by FUNCTION_NAME, so a
    name one of them takes is one all of them take."""
    from twostroke.engine.structured import grammars
    from twostroke.engine.tools.formats import FUNCTION_NAME, FUNCTION_NAME_RULE
    from twostroke.engine.tools.parser import _header

    assert FUNCTION_NAME_RULE == "1 to 64 letters, digits, underscores or dashes"
    for fmt in (HERMES, GENERIC):
        assert f'"name": "({FUNCTION_NAME.pattern})", ' in _header(fmt).pattern
    assert rf'\\"({FUNCTION_NAME.pattern})\\"' in grammars._TOOL_CALL.format(0)
    longest = "a" * 64
    ToolSpec(longest)
    assert _header(HERMES).match(f'{{"name": "{longest}", "arguments": ')
    with pytest.raises(ValueError, match=f"name must be {FUNCTION_NAME_RULE}, got 'a{{65}}'"):
        ToolSpec(longest + "a")


def test_the_prompt_shows_tools_calls_and_results_in_the_formats_syntax() -> None:
    turns = [
        Turn("system", "Be brief."),
        Turn("user", "Weather in Oslo?"),
        Turn("assistant", "", (ToolCall("c1", "get_weather", '{"city": "Oslo"}'),)),
        Turn("tool", "sunny", tool_call_id="c1", name="get_weather"),
        Turn("tool", "12 C", tool_call_id="c2"),
    ]
    system, user, assistant, sunny, warm = render_prompt(GENERIC, turns, TOOLS)
    assert system["role"] == "system"
    assert system["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather", "description": "The weather in a city"' in system["content"]
    assert user == {"role": "user", "content": "Weather in Oslo?"}
    assert assistant == {"role": "assistant", "content": CALL}
    assert sunny == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert warm == {"role": "tool", "content": "<tool_response>\n12 C\n</tool_response>"}
    # A format for templates that take no other roles: results in one user turn.
    as_user = attrs.evolve(GENERIC, name="as_user", result_role="user")
    *_, results = render_prompt(as_user, turns)
    assert results == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12 C\n"
        "</tool_response>",
    }
    hermes = render_prompt(HERMES, turns[1:])  # no tools: no block; results as they are
    assert [m["role"] for m in hermes] == ["user", "assistant", "tool", "tool"]
    assert hermes[2]["content"] == "sunny"
    assert render_prompt(GENERIC, turns[:2]) == [{"role": t.role, "content": t.content}
                                                 for t in turns[:2]]  # fmt: skip


def test_auto_is_free_text_until_the_trigger_then_a_call(compiler: GrammarCompiler) -> None:
    auto = tool_constraint(GENERIC, TOOLS)
    assert _accepts(compiler, auto, "Just text, even <tool_ca and </tool_call>.")
    assert _accepts(compiler, auto, "Let me look. " + CALL)
    assert _accepts(compiler, auto, CALL + "\n" + CALL)
    assert not _accepts(compiler, auto, CALL + " and more text")
    assert not _accepts(compiler, auto, '<tool_call>\n{"name": "nope"')
    assert not _accepts(compiler, auto, CALL.replace('"Oslo"', "7"))
    single = tool_constraint(GENERIC, TOOLS, parallel=False)
    assert not _accepts(compiler, single, CALL + "\n" + CALL)
    required = tool_constraint(GENERIC, TOOLS, "required")
    assert not _accepts(compiler, required, "text")
    assert _accepts(compiler, required, CALL)
    named = tool_constraint(GENERIC, TOOLS, function="now")
    assert not _accepts(compiler, named, CALL)
    assert _accepts(compiler, named, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    with pytest.raises(ValueError, match="function 'x' is not one of the tools"):
        tool_constraint(GENERIC, TOOLS, function="x")


def test_a_format_constrains_the_text_branch_of_auto_only(compiler: GrammarCompiler) -> None:
    answer = JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"], "additionalProperties": False})  # fmt: skip
    auto = tool_constraint(GENERIC, TOOLS, text=answer)
    assert _accepts(compiler, auto, '{"a": 1}')
    assert _accepts(compiler, auto, CALL)
    assert not _accepts(compiler, auto, "free text")
    assert _accepts(compiler, tool_constraint(GENERIC, TOOLS, "required", text=answer), CALL)


def test_the_parser_holds_back_a_possible_trigger_and_reads_calls() -> None:
    parser = ToolCallParser(GENERIC, make_id=lambda: "call_1")
    assert parser.feed("Hi <tool") == [TextDelta("Hi ")]
    assert parser.feed("_ca") == []
    events = parser.feed('ll>\n{"name": "get_weather", "arguments": {"city": "}{\\""}}\n')
    assert events == [CallStarted(0, "call_1", "get_weather"),
                      ArgumentsDelta(0, '{"city": "}{\\""}')]  # fmt: skip
    assert not parser.result().complete  # the closing tag is still to come
    assert parser.feed("</tool_call>") == []
    assert parser.finish() == []
    result = parser.result()
    assert result.complete
    assert result.content == "Hi "
    assert result.calls == (ToolCall("call_1", "get_weather", '{"city": "}{\\""}'),)
    text = parse_output(GENERIC, "a <tool_c b")
    assert (text.content, text.calls, text.complete) == ("a <tool_c b", (), True)
    cut = parse_output(GENERIC, 'x <tool_call>\n{"name": "now", "arguments": {"a')
    assert not cut.complete
    assert cut.calls == ()
    # Cut inside the separator of a next call (hypothesis found it, the walk's 100 tokens
    # ending there): a call was begun, so the output is not complete.
    one = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert parse_output(GENERIC, one).complete
    for begun in ("\n", "\n<tool", "\n<tool_call>", "\n<tool_call>\n"):
        assert not parse_output(GENERIC, one + begun).complete, begun


def test_a_calls_events_wait_for_its_json_to_close() -> None:
    """A call reaches the events only once its JSON is closed, so a stream cut inside a
    call (by ``max_tokens``) has sent nothing of it, as the whole answer drops it: the calls
    before it are kept, none of its markup is content (finding 6 of issue 48)."""
    parser = ToolCallParser(GENERIC, make_id=lambda: "call_1")
    assert parser.feed('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "O') == [
        TextDelta("Hi ")]  # fmt: skip
    assert parser.feed('slo"}') == []
    assert parser.feed("}") == [CallStarted(0, "call_1", "get_weather"),
                                ArgumentsDelta(0, '{"city": "Oslo"}')]  # fmt: skip
    assert parser.feed('\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {') == []
    assert parser.finish() == []
    cut = parser.result()
    assert (cut.content, cut.complete) == ("Hi ", False)
    assert cut.calls == (ToolCall("call_1", "get_weather", '{"city": "Oslo"}'),)
    for fmt in (GENERIC, MISTRAL, LLAMA3_JSON):  # cut anywhere: the calls complete there
        written = ["{}", '{"a": 1}'] if fmt.separator is not None else ["{}"]
        two = fmt.calls_text([("now", json.loads(arguments)) for arguments in written])
        for end in range(len(two) + 1):
            parsed = parse_output(fmt, two[:end])
            assert [call.arguments for call in parsed.calls] == [  # those whose "}" is in
                arguments
                for arguments in written
                if two.index(arguments + "}") + len(arguments) < end
            ], (fmt, two[:end])
            # (a beginning of the trigger at the very end may be text, and is read so)
            assert parsed.content == (two[:end] if end < len(fmt.trigger) else "")


def _events_text(events: list[Any]) -> tuple[str, dict[int, str], dict[int, str]]:
    content, names, arguments = "", {}, {}
    for item in events:
        if isinstance(item, TextDelta):
            content += item.text
        elif isinstance(item, CallStarted):
            names[item.index] = item.name
            arguments[item.index] = ""
        else:
            arguments[item.index] += item.text
    return content, names, arguments


#: The bytes a walk prefers where they are allowed: JSON's, the tags' and a few letters.
_STEER = frozenset(b'{}[]",: \n<>/_acdeghilmnorstuwyACLOST0123456789')


@settings(max_examples=45, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), parallel=st.booleans(), fmt=st.sampled_from([GENERIC, LLAMA3_JSON, MISTRAL]))
def test_any_output_the_lazy_constraint_allows_parses_to_valid_calls(
    compiler: GrammarCompiler, data: st.DataObject, parallel: bool, fmt: ToolFormat
) -> None:
    """Walk the constraint with bytes drawn among the allowed ones (a drawn lead, then the
    trigger more often than not, so that most walks call); whatever comes out, its calls
    validate against their tools' schemas, and reading it in any pieces gives the same. In
    each format: Hermes' tags, Llama 3's bare JSON at the start, Mistral's list."""
    matcher = compiler.compile_now(tool_constraint(fmt, TOOLS, parallel=parallel)).matcher()
    lead = data.draw(st.text(alphabet="ab <[{", max_size=4), label="lead")
    if data.draw(st.booleans(), label="call"):
        lead = ("" if fmt.at_start else lead) + fmt.first + ('{"name": "' if fmt.at_start else "")
    out = bytearray()
    for byte in lead.encode():
        if byte not in matcher.allowed_token_ids():
            break
        matcher.advance(byte)
        out.append(byte)
    for _ in range(100):
        allowed = matcher.allowed_token_ids()
        pool = sorted(allowed & _STEER) or sorted(allowed)
        if EOS_TOKEN_ID in allowed:
            pool.append(EOS_TOKEN_ID)
        token = data.draw(st.sampled_from(pool), label="token")
        if token == EOS_TOKEN_ID:
            break
        matcher.advance(token)
        out.append(token)
    text = out.decode("utf-8", errors="replace")
    whole = parse_output(fmt, text)
    event(f"{fmt.name}: {len(whole.calls)} calls, {'complete' if whole.complete else 'cut'}")
    if whole.complete:
        for call in whole.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if whole.calls:  # the calls read back are the text: nothing lost, nothing added
            # (as the model wrote them: the arguments' text, escapes and all)
            calls = [(call.name, 0) for call in whole.calls]
            written = fmt.calls_text(calls)
            key = fmt.arguments_key
            for call in whole.calls:
                head = f'"{call.name}", "{key}": '
                written = written.replace(f"{head}0}}", f"{head}\x00}}", 1)
            for call in whole.calls:
                written = written.replace("\x00", call.arguments, 1)
            assert whole.content + written == text
    if fmt.at_start:
        assert not whole.content.startswith(fmt.trigger)
    else:
        assert fmt.trigger not in whole.content
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8), label="cuts"))
    parser = ToolCallParser(fmt)
    events = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += parser.feed(text[start:end])
    events += parser.finish()
    content, names, arguments = _events_text(events)
    assert content == whole.content
    # Only complete calls reach the events: a stream sends what the whole answer holds.
    assert [names[i] for i in sorted(names)] == [c.name for c in whole.calls]
    assert len(arguments) == len(whole.calls)
    for index, call in enumerate(whole.calls):
        assert arguments[index] == call.arguments


def test_a_tools_parameters_are_rewritten_as_a_schemas_are(compiler: GrammarCompiler) -> None:
    """What a JSON schema constraint rewrites with the same valid instances compiles inside
    the tools' grammar too; what it leaves to a check of the output is refused there."""
    rewritten = ToolSpec("tag", None, {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array", "uniqueItems": False}},
        "dependentRequired": {"a": ["b"]},
    })  # fmt: skip
    grammar = tool_constraint(GENERIC, [rewritten], "required")
    assert _accepts(compiler, grammar, '<tool_call>\n{"name": "tag", "arguments": '
                    '{"a": 1, "b": [1, 1]}}\n</tool_call>')  # fmt: skip
    assert not _accepts(compiler, grammar, '<tool_call>\n{"name": "tag", "arguments": {"a": 1}}')
    unique = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    checked = ToolSpec("pick", None, unique)
    with pytest.raises(ConstraintRejected, match="uniqueItems"):
        compiler.compile_now(tool_constraint(GENERIC, [checked]))


class _StraddlingTokenizer:
    """Bytes, plus tokens that cross the trigger's edges (as a BPE vocabulary may)."""

    EXTRA = (b"Hi <tool", b"_call>\n{", b"ll>", b"\n</tool_call>", b"}}\n</tool")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({256})

    def token_bytes(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)] + [b"<eos>", *self.EXTRA]

    def special_token_ids(self) -> frozenset[int]:
        return frozenset({256})


def test_a_trigger_split_across_tokens_or_inside_one_is_seen() -> None:
    """The lexer reads bytes: a token that ends inside the trigger, one that spans its end
    and the call's start, and one that closes the call are allowed exactly where the text
    they spell is."""
    compiler = GrammarCompiler(Vocabulary.from_tokenizer(_StraddlingTokenizer()))
    matcher = compiler.compile_now(tool_constraint(GENERIC, TOOLS)).matcher()
    ids = {text: 257 + index for index, text in enumerate(_StraddlingTokenizer.EXTRA)}
    assert ids[b"Hi <tool"] in matcher.allowed_token_ids()
    matcher.advance(ids[b"Hi <tool"])
    assert ids[b"_call>\n{"] in matcher.allowed_token_ids()
    assert ids[b"\n</tool_call>"] in matcher.allowed_token_ids()  # still text: no call yet
    matcher.advance(ids[b"_call>\n{"])
    assert ids[b"\n</tool_call>"] not in matcher.allowed_token_ids()  # a call has begun
    for byte in b'"name": "now", "arguments": {':
        matcher.advance(byte)
    assert ids[b"}}\n</tool"] in matcher.allowed_token_ids()
    matcher.advance(ids[b"}}\n</tool"])
    for byte in b"_call>":
        matcher.advance(byte)
    assert 256 in matcher.allowed_token_ids()  # the call is complete: the output may end
    parsed = parse_output(GENERIC, 'Hi <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert (parsed.content, [call.name for call in parsed.calls]) == ("Hi ", ["now"])
