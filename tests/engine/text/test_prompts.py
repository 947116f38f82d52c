"""What a caller passes as a prompt, to token ids checked once (a tuple), with clear errors."""

from __future__ import annotations

import enum
import re
from typing import Any

import pytest

from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.text.prompts import tokenize_prompt

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
        ([1, 257, -1], ValueError, "prompt token ids must be in [0, 257), got 257 at index 1"),
        ([1, 2, -1], ValueError, "prompt token ids must be in [0, 257), got -1 at index 2"),
        ([1, True], TypeError, "got a sequence of bool, int"),
        ([1, {"role": "user"}], TypeError, "got a sequence of dict, int"),
        (b"ab", TypeError, "prompt must be text, a sequence of token ids or a list of chat"),
    ],
)
def test_bad_prompts_are_refused_naming_what_is_wrong(
    prompt: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        tokenize_prompt(prompt, TOKENIZER)
