"""The reference matcher: its regex engine against Python's ``re``, its walks, its copies.

``walk_and_check`` is the property every :class:`~twostroke.states.constraints.Matcher` must
have, written once: the engine's tests run it on the real backend too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.states.constraints import Choice, JsonSchema, Matcher, Regex, read_bitmask
from twostroke.states.testing import (
    CONSTRAINT_ALPHABET,
    EOS_TEXT,
    ReferenceMatcher,
    choices,
    parse_regex,
    regex_matches,
    regexes,
    token_vocabularies,
)

#: Whether a whole output's text satisfies the constraint (Python's ``re`` for a regex).
Oracle = Callable[[str], bool]


def oracle(constraint: Choice | Regex) -> Oracle:
    if isinstance(constraint, Choice):
        return lambda text: text in constraint.choices
    # By derivatives, not Python's re: a walk over a real vocabulary spells long texts, and
    # re backtracks exponentially on a drawn pattern such as ((a|ab)*)* (in C, holding the
    # GIL, where no per-test timeout reaches it). The derivatives agree with re on short
    # texts (the test below).
    pattern = constraint.pattern
    return lambda text: regex_matches(pattern, text)


def snapshot(matcher: Matcher) -> tuple[object, ...]:
    return (
        matcher.num_tokens,
        matcher.allowed_token_ids(),
        matcher.accepting,
        matcher.terminated,
    )


def walk_and_check(
    matcher: Matcher,
    data: st.DataObject,
    *,
    decode: Callable[[Sequence[int]], str | None],
    satisfied: Oracle,
    eos_token_ids: frozenset[int],
    max_tokens: int = 12,
) -> list[int]:
    """Follow drawn allowed tokens; check the matcher at every step; return the tokens.

    ``decode`` gives the text of the tokens, or ``None`` where they are not text yet (bytes
    that end inside a UTF-8 character): no constraint is satisfied there.

    At every step: ``accepting`` says whether the text so far satisfies the constraint; EOS
    is allowed exactly then; a drawn token that is not allowed is refused and changes
    nothing, or (a backend that masks all but the tokenizer's own spelling of a forced text)
    is taken, and the walk goes on from it. The walk ends at EOS (the text must satisfy the
    constraint), at a dead end, or after ``max_tokens``.
    """
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        allowed = matcher.allowed_token_ids()
        text = decode(tokens)
        complete = text is not None and satisfied(text)
        assert matcher.accepting == complete, (text, matcher)
        assert (eos_token_ids <= allowed) == matcher.accepting, (text, sorted(allowed))
        assert matcher.num_tokens == len(tokens)
        if not allowed:  # a dead end: the vocabulary cannot spell a continuation
            assert matcher.terminated
            assert not matcher.accepting
            break
        other = data.draw(st.integers(-1, matcher.vocab_size + 2), label="other")
        if other not in allowed:
            before = snapshot(matcher)
            if matcher.advance(other):  # taken: another spelling of a valid text
                assert other not in eos_token_ids
                assert 0 <= other < matcher.vocab_size
                tokens.append(other)
                continue
            assert snapshot(matcher) == before  # refused, and nothing changed
        token = data.draw(st.sampled_from(sorted(allowed)), label="token")
        assert matcher.advance(token)
        tokens.append(token)
        if token in eos_token_ids:
            text = decode(tokens)
            assert text is not None
            assert satisfied(text), text
            assert matcher.terminated
            assert matcher.allowed_token_ids() == eos_token_ids
            break
    return tokens


def toy_decoder(vocabulary: Sequence[str]) -> Callable[[Sequence[int]], str]:
    eos = len(vocabulary) - 1
    return lambda tokens: "".join(vocabulary[token] for token in tokens if token != eos)


@given(regexes(), st.text(alphabet=CONSTRAINT_ALPHABET, max_size=8))
def test_the_derivatives_agree_with_python_re(constraint: Regex, text: str) -> None:
    expected = re.fullmatch(constraint.pattern, text) is not None
    assert regex_matches(constraint.pattern, text) == expected


@given(st.one_of(regexes(), choices()), token_vocabularies(), st.data())
def test_every_walk_the_matcher_allows_satisfies_the_constraint(
    constraint: Choice | Regex, vocabulary: list[str], data: st.DataObject
) -> None:
    eos = len(vocabulary) - 1
    matcher = ReferenceMatcher(constraint, vocabulary, eos_token_ids=[eos])
    walk_and_check(
        matcher,
        data,
        decode=toy_decoder(vocabulary),
        satisfied=oracle(constraint),
        eos_token_ids=frozenset({eos}),
    )


def test_a_walk_through_a_choice() -> None:
    vocabulary = ["y", "e", "s", "ye", "yes!", "n", "o", EOS_TEXT]
    matcher = ReferenceMatcher(Choice(["yes", "ye", "no"]), vocabulary, eos_token_ids=[7])
    assert matcher.vocab_size == 8
    assert matcher.allowed_token_ids() == {0, 3, 5}  # y, ye, n; not yes! (no choice has it)
    assert not matcher.accepting
    assert not matcher.terminated
    assert matcher.advance(3)
    assert matcher.text == "ye"
    assert matcher.accepting
    assert matcher.allowed_token_ids() == {2, 7}
    assert matcher.advance(2)
    assert matcher.terminated  # "yes" is complete and nothing extends it
    assert matcher.allowed_token_ids() == {7}
    choice = "Choice(choices=('no', 'ye', 'yes'))"
    assert repr(matcher) == f"<ReferenceMatcher {choice} 'yes' terminated>"
    assert matcher.advance(7)
    assert matcher.advance(7)  # EOS again, after the end, changes nothing but the count
    assert (matcher.num_tokens, matcher.text, matcher.terminated) == (4, "yes", True)


def test_a_dead_end_is_terminated_but_not_accepting() -> None:
    matcher = ReferenceMatcher(Regex("ax"), ["a", "b", EOS_TEXT], eos_token_ids=[2])
    assert matcher.advance(0)
    assert matcher.allowed_token_ids() == frozenset()
    assert matcher.terminated
    assert not matcher.accepting
    assert repr(matcher) == "<ReferenceMatcher Regex('ax') 'a' terminated>"
    assert repr(ReferenceMatcher(Regex("ax"), ["a", "b", EOS_TEXT])) == (
        "<ReferenceMatcher Regex('ax') '' open>"
    )


def test_fill_bitmask_writes_the_allowed_set() -> None:
    vocabulary = [*"abcdefghij", *"klmnopqrstuvwxyz", "ab", "abc", "bc", "cd", "de", EOS_TEXT]
    matcher = ReferenceMatcher(Regex("(ab)+c?"), vocabulary, eos_token_ids=[31])
    row = bytearray(4)
    matcher.fill_bitmask(memoryview(row))
    assert read_bitmask(bytes(row)) == {0, 26, 27}
    matcher.advance(26)
    matcher.fill_bitmask(memoryview(row))
    assert read_bitmask(bytes(row)) == {0, 2, 26, 27, 31}
    with pytest.raises(ValueError, match=r"^a bitmask row must be 4 bytes, got 8$"):
        matcher.fill_bitmask(memoryview(bytearray(8)))


def test_a_copy_goes_on_alone_from_where_its_original_is() -> None:
    matcher = ReferenceMatcher(Choice(["ab", "ac"]), ["a", "b", "c", EOS_TEXT], eos_token_ids=[3])
    assert matcher.advance(0)
    ahead = matcher.copy()
    assert ahead.advance(1)
    assert (ahead.text, ahead.num_tokens, ahead.terminated) == ("ab", 2, True)
    assert (matcher.text, matcher.num_tokens) == ("a", 1)
    assert matcher.allowed_token_ids() == {1, 2}
    assert matcher.advance(2)
    assert (ahead.text, matcher.text) == ("ab", "ac")


def test_the_matcher_checks_what_it_is_given() -> None:
    with pytest.raises(TypeError, match=r"^the reference matcher follows a Choice or a Regex, got"):
        ReferenceMatcher(JsonSchema({}), ["a"])
    with pytest.raises(ValueError, match=r"^eos_token_ids \[1, 5\] are not all in the vocabulary$"):
        ReferenceMatcher(Regex("a"), ["a", "b"], eos_token_ids=[5, 1])
    with pytest.raises(ValueError, match=r"^every token but EOS must have a non-empty text$"):
        ReferenceMatcher(Regex("a"), ["a", ""], eos_token_ids=[0])
    # an empty text is fine for EOS
    assert ReferenceMatcher(Regex("a"), ["a", ""], eos_token_ids=[1]).allowed_token_ids() == {0}


@pytest.mark.parametrize(
    ("pattern", "texts", "not_texts"),
    [
        (r"a\.b", ["a.b"], ["axb", "a\\.b"]),
        ("[a-c]+", ["abcba"], ["", "abd"]),
        ("[^a]b", ["bb", "éb"], ["ab"]),
        ("[a-]", ["a", "-"], ["b"]),
        (".", ["é", "a"], ["\n", ""]),
        ("(a|bc)?d", ["d", "ad", "bcd"], ["abcd"]),
        ("(a*)*b", ["b", "aaab"], ["a"]),
        (r"[\]x]", ["]", "x"], ["\\"]),
        ("a|", ["", "a"], ["aa"]),
    ],
)
def test_the_regex_subset(pattern: str, texts: list[str], not_texts: list[str]) -> None:
    for text in texts:
        assert regex_matches(pattern, text), text
        assert re.fullmatch(pattern, text), text
    for text in not_texts:
        assert not regex_matches(pattern, text), text
        assert not re.fullmatch(pattern, text), text


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("(ab", "the reference regex parser misses a ')' at 3 in '(ab'"),
        ("ab)", "the reference regex parser does not read ')' at 2 in 'ab)'"),
        ("*a", "the reference regex parser does not read '*' at 1 in '*a'"),
        ("a\\", "the reference regex parser needs more at 2 in 'a\\\\'"),
        (r"\d", "the reference regex parser does not read the escape \\d at 2 in '\\\\d'"),
        (r"[\w]", "the reference regex parser does not read the escape \\w in a class at 3 in"),
        ("[c-a]", "the reference regex parser reads a reversed range c-a at 4 in '[c-a]'"),
        ("[]", "the reference regex parser does not read an empty class at 2 in '[]'"),
        ("[ab", "the reference regex parser needs more at 3 in '[ab'"),
    ],
)
def test_syntax_outside_the_subset_is_named(pattern: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^" + re.escape(message)):
        parse_regex(pattern)


def test_alternatives_of_one_branch_and_an_empty_one() -> None:
    assert regex_matches("(|a)b", "b")
    assert regex_matches("(a|a)", "a")
    assert not regex_matches("(a|a)", "aa")
