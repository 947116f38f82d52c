"""The one check of a prompt's shape, shared by the engine and the coordinator."""

from __future__ import annotations

import enum
from typing import Any

import pytest

from twostroke.states.prompts import prompt_kind


class Token(enum.IntEnum):
    A = 97


@pytest.mark.parametrize(
    ("prompt", "kind"),
    [
        ("hello", "text"),
        ([1, 2], "token_ids"),
        ((7,), "token_ids"),
        ([3, Token.A], "token_ids"),  # an int subclass is an int (not a bool)
        ([{"role": "user", "content": "hi"}], "messages"),
    ],
)
def test_a_prompt_is_text_token_ids_or_chat_messages(prompt: Any, kind: str) -> None:
    assert prompt_kind(prompt) == kind


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ("", ValueError, "prompt must not be empty, got ''"),
        ([], ValueError, "prompt must not be empty, got an empty sequence"),
        (
            [1, "a"],
            TypeError,
            "prompt must be text, a sequence of token ids (int) or of chat messages "
            "(mappings), got a sequence of int, str",
        ),
        (
            [True, 1],
            TypeError,
            "prompt must be text, a sequence of token ids (int) or of chat messages "
            "(mappings), got a sequence of bool, int",
        ),
        (
            b"bytes",
            TypeError,
            "prompt must be text, a sequence of token ids or a list of chat messages, got bytes",
        ),
        (
            None,
            TypeError,
            "prompt must be text, a sequence of token ids or a list of chat messages, got NoneType",
        ),
    ],
)
def test_a_bad_prompt_raises_naming_what_it_got(
    prompt: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        prompt_kind(prompt)
    assert str(raised.value) == message
