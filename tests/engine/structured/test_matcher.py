"""GuidanceMatcher: the Matcher protocol over llguidance, against the reference and Python's re."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import jsonschema
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.structured.conftest import TextVocabulary
from tests.states.testing.test_constraints import oracle, walk_and_check
from twostroke.engine.errors import MatcherError
from twostroke.engine.runners.toy import EOS_TOKEN_ID, ByteTokenizer
from twostroke.engine.structured import (
    CompilerConfig,
    GrammarCompiler,
    GuidanceMatcher,
    Vocabulary,
    allocate_bitmask,
    bitmask_row,
    bitmask_rows,
    fill_bitmasks,
)
from twostroke.states.constraints import (
    AnyJsonObject,
    Choice,
    JsonSchema,
    Matcher,
    Regex,
    read_bitmask,
)
from twostroke.states.errors import ConstraintRejected
from twostroke.states.testing import ReferenceMatcher, choices, regexes, token_vocabularies

EOS = frozenset({EOS_TOKEN_ID})


def byte_text(tokens: Sequence[int]) -> str:
    return ByteTokenizer().decode(tokens)


def strict_byte_text(tokens: Sequence[int]) -> str | None:
    """The text of byte tokens, or None while they end inside a character."""
    try:
        return bytes(token for token in tokens if token != EOS_TOKEN_ID).decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_a_guidance_matcher_is_a_matcher(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.compile_now(Regex("a")).matcher()
    assert isinstance(matcher, Matcher)
    assert matcher.vocab_size == 257


@settings(max_examples=40)
@given(st.one_of(regexes(), choices()), token_vocabularies(), st.data())
def test_it_allows_what_the_reference_allows_in_canonical_spelling(
    constraint: Choice | Regex, texts: list[str], data: st.DataObject
) -> None:
    """Every token it allows, the reference allows; it is stuck exactly where the reference is.

    llguidance allows fewer: where the grammar forces a text, only the tokenizer's own
    spelling of it ("00" as one token, not "0" then "0").
    """
    vocabulary = TextVocabulary(tuple(texts))
    guided = GrammarCompiler(Vocabulary.from_tokenizer(vocabulary)).compile_now(constraint)
    matcher = guided.matcher()
    reference = ReferenceMatcher(constraint, texts, vocabulary.eos_token_ids)
    for _ in range(10):
        allowed = matcher.allowed_token_ids()
        expected = reference.allowed_token_ids()
        assert allowed <= expected, (reference, sorted(allowed), sorted(expected))
        assert bool(allowed) == bool(expected), reference
        assert (matcher.accepting, matcher.terminated) == (
            reference.accepting,
            reference.terminated,
        ), reference
        if not allowed:
            break
        token = data.draw(st.sampled_from(sorted(allowed)))
        assert matcher.advance(token)
        assert reference.advance(token)


@settings(max_examples=40)
@given(st.one_of(regexes(), choices()), token_vocabularies(), st.data())
def test_every_walk_it_allows_satisfies_the_constraint_and_rolls_back(
    constraint: Choice | Regex, texts: list[str], data: st.DataObject
) -> None:
    vocabulary = TextVocabulary(tuple(texts))
    compiled = GrammarCompiler(Vocabulary.from_tokenizer(vocabulary)).compile_now(constraint)
    walk_and_check(
        compiled.matcher(),
        data,
        decode=vocabulary.decode,
        satisfied=oracle(constraint),
        eos_token_ids=vocabulary.eos_token_ids,
    )


@settings(max_examples=40)
@given(st.one_of(regexes(), choices()), st.data())
def test_byte_walks_satisfy_the_constraint(
    byte_compiler: GrammarCompiler, constraint: Choice | Regex, data: st.DataObject
) -> None:
    """Over bytes: a two-byte character is two tokens, and the text between them is no match."""
    walk_and_check(
        byte_compiler.compile_now(constraint).matcher(),
        data,
        decode=strict_byte_text,
        satisfied=oracle(constraint),
        eos_token_ids=EOS,
        max_tokens=16,
    )


# --- JSON ---------------------------------------------------------------------------------------


def _leaf_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Schemas of finitely many values (every walk ends)."""
    words = st.text(alphabet='ab é"\\', min_size=1, max_size=3)
    return st.one_of(
        st.lists(words, min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        words.map(lambda word: {"const": word}),
        st.tuples(st.integers(-5, 5), st.integers(0, 20)).map(
            lambda pair: {"type": "integer", "minimum": pair[0], "maximum": pair[0] + pair[1]}
        ),
    )


def _objects(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    properties = st.dictionaries(st.sampled_from(["a", "b", "c d", "é"]), inner, max_size=3)
    return properties.map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": sorted(props),
            "additionalProperties": False,
        }
    )


def bounded_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Objects (nested at most twice) of enums, consts, booleans, nulls and bounded integers."""
    return _objects(st.recursive(_leaf_schemas(), _objects, max_leaves=4))


@settings(max_examples=25)
@given(bounded_schemas(), st.data())
def test_every_completed_json_output_parses_and_validates(
    byte_compiler: GrammarCompiler, schema: dict[str, Any], data: st.DataObject
) -> None:
    matcher = byte_compiler.compile_now(JsonSchema(schema)).matcher()
    tokens: list[int] = []
    while not matcher.terminated and len(tokens) < 400:
        allowed = matcher.allowed_token_ids()
        token = data.draw(st.sampled_from(sorted(allowed)))
        assert matcher.advance(token)
        tokens.append(token)
    assert matcher.terminated, byte_text(tokens)
    assert matcher.accepting, byte_text(tokens)
    value = json.loads(byte_text(tokens))
    jsonschema.validate(value, schema)
    # the one fixed format: json.dumps's separators, no other whitespace. The grammar also
    # writes integer zero as -0 (valid JSON, the value 0), which json.dumps does not.
    text = re.sub(r"-0(?![.\d])", "0", byte_text(tokens))
    assert text == json.dumps(value, ensure_ascii=False)


def test_any_json_object_takes_nested_json(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.compile_now(AnyJsonObject()).matcher()
    text = '{"a": [1, 2.5, {"b": null}], "c": "d\\"e", "f": true}'
    assert all(matcher.advance(byte) for byte in text.encode())
    assert matcher.accepting
    assert matcher.advance(EOS_TOKEN_ID)
    assert not byte_compiler.compile_now(AnyJsonObject()).matcher().advance(ord("["))


# --- EOS and dead ends -------------------------------------------------------------------------


def test_eos_after_the_end_is_taken_and_changes_nothing(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.compile_now(Choice(["ab"])).matcher()
    assert matcher.advance(ord("a"))
    assert not matcher.advance(EOS_TOKEN_ID)  # "a" is no choice
    assert matcher.advance(ord("b"))
    # nothing can follow "ab": llguidance has stopped, EOS is all that is allowed
    assert (matcher.accepting, matcher.terminated) == (True, True)
    assert matcher.allowed_token_ids() == EOS
    assert matcher.advance(EOS_TOKEN_ID)
    assert matcher.advance(EOS_TOKEN_ID)  # EOS again, after the end, is counted and nothing else
    assert matcher.num_tokens == 4
    assert (matcher.accepting, matcher.terminated) == (True, True)
    assert matcher.allowed_token_ids() == EOS
    assert repr(matcher) == "<GuidanceMatcher 4 tokens, terminated>"


def test_eos_ends_an_output_that_could_go_on(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.compile_now(Regex("a+")).matcher()
    assert matcher.advance(ord("a"))
    assert matcher.allowed_token_ids() == {ord("a"), EOS_TOKEN_ID}
    assert repr(matcher) == "<GuidanceMatcher 1 tokens, accepting>"
    assert not matcher.terminated
    assert matcher.advance(EOS_TOKEN_ID)
    assert matcher.terminated
    assert matcher.allowed_token_ids() == EOS
    assert matcher.advance(EOS_TOKEN_ID)
    assert (matcher.num_tokens, matcher.terminated) == (3, True)
    assert not matcher.advance(ord("a"))


def test_a_dead_end_allows_nothing_not_even_eos() -> None:
    """llguidance allows EOS where no token continues; the protocol does not (not complete)."""
    vocabulary = TextVocabulary(("a", "b", "<eos>"))
    compiler = GrammarCompiler(Vocabulary.from_tokenizer(vocabulary))
    matcher = compiler.compile_now(Regex("ax")).matcher()
    assert matcher.advance(0)
    assert matcher.allowed_token_ids() == frozenset()
    row = bytearray(4)
    matcher.fill_bitmask(memoryview(row))
    assert row == bytearray(4)
    assert not matcher.advance(2)
    assert not matcher.accepting
    assert matcher.terminated
    assert repr(matcher) == "<GuidanceMatcher 1 tokens, dead end>"
    # a constraint that is a dead end from the start is refused when compiled
    with pytest.raises(
        ConstraintRejected,
        match=r"^constraint.pattern: no token of the vocabulary can continue the output "
        r"\(a dead end\)$",
    ):
        compiler.compile_now(Regex("x"))


def test_refused_tokens_change_nothing(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.compile_now(Regex("ab")).matcher()
    for token in (ord("b"), -1, 257, 10**9, EOS_TOKEN_ID):
        assert not matcher.advance(token)
    assert matcher.num_tokens == 0
    assert matcher.allowed_token_ids() == {ord("a")}
    assert matcher.advance(ord("a"))


def test_a_limit_hit_mid_output_is_a_matcher_error(byte_vocabulary: Vocabulary) -> None:
    """The first mask fits the lexer's fuel per step (it compiled); a later one does not."""
    compiler = GrammarCompiler(byte_vocabulary, CompilerConfig(step_lexer_fuel=10))
    matcher = compiler.compile_now(Regex("(a|b)*a(a|b){8}")).matcher()
    with pytest.raises(MatcherError, match=r"^lexer error: too many expressions constructed"):
        matcher.advance(ord("a"))
        matcher.allowed_token_ids()
    assert repr(matcher).endswith(", error>")
    with pytest.raises(MatcherError):
        matcher.fill_bitmask(memoryview(bytearray(4 * 9)))


# --- bitmask rows -------------------------------------------------------------------------------


def test_fill_bitmask_writes_int32_rows(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.compile_now(Regex("[a-c]x?")).matcher()
    bitmask = allocate_bitmask(2, 257)
    assert tuple(bitmask.shape) == (2, 9)
    matcher.fill_bitmask(bitmask_row(bitmask, 1))
    assert read_bitmask(bitmask_row(bitmask, 1)) == {97, 98, 99}
    assert read_bitmask(bitmask_row(bitmask, 0)) == frozenset()
    assert bitmask[1, 3].item() == 0b1110  # bits 97, 98, 99 of word 3


def test_fill_bitmask_checks_its_row(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.compile_now(Regex("a")).matcher()
    with pytest.raises(ValueError, match=r"^a bitmask row must be 36 bytes, got 32$"):
        matcher.fill_bitmask(memoryview(bytearray(32)))
    with pytest.raises(ValueError, match=r"^a bitmask row must be writable$"):
        matcher.fill_bitmask(memoryview(bytes(36)))
    with pytest.raises(ValueError, match=r"^a bitmask row must be contiguous$"):
        matcher.fill_bitmask(memoryview(bytearray(72))[::2])


def test_fill_bitmasks_fills_many_rows_at_once(byte_compiler: GrammarCompiler) -> None:
    executor = llguidance.LLExecutor(1)
    first = byte_compiler.compile_now(Choice(["yes", "no"])).matcher()
    second = byte_compiler.compile_now(Regex("ab")).matcher()
    second.advance(ord("a"))
    done = byte_compiler.compile_now(Regex("a")).matcher()
    done.advance(ord("a"))
    pairs: list[tuple[GuidanceMatcher, int]] = [(first, 3), (second, 0), (done, 1)]
    bitmask = allocate_bitmask(4, 257)
    bitmask.fill_(-1)
    fill_bitmasks(pairs, bitmask_rows(bitmask), executor)
    rows = [read_bitmask(bitmask_row(bitmask, i)) for i in range(4)]
    # row 2 has no matcher: untouched; "a" done: EOS only; "yes" or "no": y or n
    assert rows == [{ord("b")}, EOS, set(range(9 * 32)), {ord("n"), ord("y")}]
    fill_bitmasks([], bitmask_rows(bitmask), executor)
    assert read_bitmask(bitmask_row(bitmask, 2)) == set(range(9 * 32))


def test_fill_bitmasks_checks_its_arguments(
    byte_compiler: GrammarCompiler, byte_vocabulary: Vocabulary
) -> None:
    executor = llguidance.LLExecutor(1)
    matcher = byte_compiler.compile_now(Regex("a")).matcher()
    bitmask = allocate_bitmask(2, 257)
    with pytest.raises(ValueError, match=r"^row 2 is outside a bitmask of 2 rows$"):
        fill_bitmasks([(matcher, 2)], bitmask_rows(bitmask), executor)
    with pytest.raises(ValueError, match=r"^a bitmask must be whole rows of 36 bytes, got 40$"):
        fill_bitmasks([(matcher, 0)], memoryview(bytearray(40)), executor)
    # llguidance's own "RuntimeError: Already borrowed" killed the engine (issue 48).
    message = r"^each matcher fills one row of a call, got one matcher for rows 0 and 1 \("
    with pytest.raises(ValueError, match=message):
        fill_bitmasks([(matcher, 0), (matcher, 1)], bitmask_rows(bitmask), executor)
    other = TextVocabulary(("a", "<eos>"))
    small = GrammarCompiler(Vocabulary.from_tokenizer(other)).compile_now(Regex("a")).matcher()
    with pytest.raises(
        ValueError, match=r"^the matchers of one bitmask must share one vocabulary size$"
    ):
        fill_bitmasks([(matcher, 0), (small, 1)], bitmask_rows(bitmask), executor)
    starved = GrammarCompiler(byte_vocabulary, CompilerConfig(step_lexer_fuel=10))
    failing = starved.compile_now(Regex("(a|b)*a(a|b){8}")).matcher()
    failing.advance(ord("a"))
    with pytest.raises(MatcherError, match=r"^lexer error"):
        fill_bitmasks([(failing, 0)], bitmask_rows(bitmask), executor)
    # With failures to take them, the others' rows are filled and nothing is raised.
    failures: list[tuple[int, Exception]] = []
    fill_bitmasks([(failing, 1), (matcher, 0)], bitmask_rows(bitmask), executor, failures=failures)
    assert [(row, type(error)) for row, error in failures] == [(1, MatcherError)]
    assert read_bitmask(bitmask_row(bitmask, 0)) == {ord("a")}


def test_choices_with_quotes_backslashes_and_newlines(byte_compiler: GrammarCompiler) -> None:
    strings = ['say "hi"', "C:\\dir", "two\nlines", "tab\there", "😀", "\u0000nul"]
    compiled = byte_compiler.compile_now(Choice(strings))
    for string in strings:
        matcher = compiled.matcher()
        assert all(matcher.advance(byte) for byte in string.encode()), string
        assert matcher.accepting, string
    assert re.fullmatch("a", "a")
