"""What a caller passes as a prompt, to token ids checked once (a tuple), with clear errors."""

from __future__ import annotations

import enum
import re
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.text.prompt_ids import tokenize_prompt

TOKENIZER = ByteTokenizer()


class Token(enum.IntEnum):
    A = 97


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("ab", (97, 98)),
        ([97, 98], (97, 98)),
        ((97, 98), (97, 98)),
        (range(97, 99), (97, 98)),
        ([Token.A, 256], (97, 256)),  # an int subclass is an int; the last id is the EOS
        ([{"role": "user", "content": "a"}], tuple(b"<user>a\n<assistant>")),
    ],
)
def test_a_prompt_becomes_a_tuple_of_ids(prompt: Any, expected: tuple[int, ...]) -> None:
    token_ids = tokenize_prompt(prompt, TOKENIZER)
    assert token_ids == expected
    assert type(token_ids) is tuple


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ([], ValueError, "prompt must not be empty, got an empty sequence"),
        ((), ValueError, "prompt must not be empty, got an empty sequence"),
        ([1, 257, -1], ValueError, "prompt token ids must be in [0, 257), got 257 at index 1"),
        ([0, 256, 257], ValueError, "prompt token ids must be in [0, 257), got 257 at index 2"),
        ([1, 2, -1], ValueError, "prompt token ids must be in [0, 257), got -1 at index 2"),
        ((97, -1), ValueError, "prompt token ids must be in [0, 257), got -1 at index 1"),
        ([97, 2**70], ValueError, f"must be in [0, 257), got {2**70} at index 1"),
        ([-(2**70)], ValueError, f"must be in [0, 257), got {-(2**70)} at index 0"),
        (range(250, 260), ValueError, "prompt token ids must be in [0, 257), got 257 at index 7"),
        ([Token.A, 300], ValueError, "prompt token ids must be in [0, 257), got 300 at index 1"),
        ([1, True], TypeError, "got a sequence of bool, int"),
        ([True, 1], TypeError, "got a sequence of bool, int"),
        ([1, 2.0], TypeError, "got a sequence of float, int"),
        ((1, None), TypeError, "got a sequence of NoneType, int"),
        ([1, "2"], TypeError, "got a sequence of int, str"),
        ([1, Fraction(2)], TypeError, "got a sequence of Fraction, int"),
        ([1, {"role": "user"}], TypeError, "got a sequence of dict, int"),
        (b"ab", TypeError, "prompt must be text, a sequence of token ids or a list of chat"),
    ],
)
def test_bad_prompts_are_refused_naming_what_is_wrong(
    prompt: Any, error: type[Exception], message: str
) -> None:
    """Given ids are checked in one pass in C; a bad one is then found and named id by id."""
    with pytest.raises(error, match=re.escape(message)):
        tokenize_prompt(prompt, TOKENIZER)


def reference_ids(prompt: list[Any], vocab: int) -> tuple[int, ...] | type[Exception]:
    """The rule, written plainly: ints that are not bools, each in ``[0, vocab)``."""
    if not prompt:
        return ValueError
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        return TypeError
    if not all(0 <= item < vocab for item in prompt):
        return ValueError
    return tuple(prompt)


ITEMS = st.one_of(
    st.integers(min_value=-3, max_value=260),
    st.integers(),  # far outside, past 64 bits too
    st.sampled_from([True, False, 1.0, None, "1", Token.A, Fraction(3)]),
)


@given(prompt=st.lists(ITEMS, max_size=8), as_tuple=st.booleans())
@example(prompt=[0, 256], as_tuple=False)  # the vocabulary's edges, in
@example(prompt=[257], as_tuple=False)  # and just past them
@example(prompt=[-1], as_tuple=True)
@example(prompt=[Token.A], as_tuple=False)  # an int subclass comes back a plain int
def test_given_ids_follow_the_rule_whichever_path_checks_them(
    prompt: list[Any], as_tuple: bool
) -> None:
    """The one pass in C (msgspec) accepts exactly what the rule accepts, and a refusal is
    the id-by-id check's error."""
    given: Any = tuple(prompt) if as_tuple else prompt
    expected = reference_ids(prompt, TOKENIZER.vocab_size)
    if isinstance(expected, tuple):
        token_ids = tokenize_prompt(given, TOKENIZER)
        assert token_ids == expected
        assert type(token_ids) is tuple
        assert all(type(token_id) is int for token_id in token_ids)
    else:
        with pytest.raises(expected, match=r"^prompt (must|token ids must) "):
            tokenize_prompt(given, TOKENIZER)
