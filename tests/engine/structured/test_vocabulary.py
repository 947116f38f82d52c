"""Vocabulary: a tokenizer's tokens as bytes for the backend."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from tests.engine.structured.conftest import TextVocabulary
from twostroke.engine.runners.toy import EOS_TOKEN_ID, ByteTokenizer
from twostroke.engine.structured import GrammarCompiler, TokenBytes, Vocabulary
from twostroke.engine.structured.vocabulary import _Wrapped
from twostroke.states.constraints import Regex


def test_the_toy_tokenizer_lists_its_bytes() -> None:
    tokenizer = ByteTokenizer()
    assert isinstance(tokenizer, TokenBytes)
    vocabulary = Vocabulary.from_tokenizer(tokenizer)
    assert vocabulary.vocab_size == 257
    assert vocabulary.eos_token_ids == {EOS_TOKEN_ID}
    assert repr(vocabulary) == "<Vocabulary 257 tokens, eos_token_ids=[256]>"
    assert vocabulary.backend.is_special_token(EOS_TOKEN_ID)
    assert not vocabulary.backend.is_special_token(ord("a"))


def test_the_backend_tokenizes_greedily_and_skips_what_no_token_spells() -> None:
    wrapped = _Wrapped(TextVocabulary(("a", "ab", "abc", "b", "<eos>")))
    assert wrapped(b"abcab") == [2, 1]
    assert wrapped(b"xaby") == [1]  # x and y: no token
    assert wrapped(b"") == []
    assert (wrapped.eos_token_id, wrapped.special_token_ids) == (4, [4])


class NoEos:
    eos_token_ids: frozenset[int] = frozenset()

    def token_bytes(self) -> Sequence[bytes]:
        return [b"a"]

    def special_token_ids(self) -> frozenset[int]:
        return frozenset()


def test_a_tokenizer_it_cannot_read_is_a_type_error() -> None:
    with pytest.raises(
        TypeError, match=r"^structured output needs a tokenizer with an EOS token, got none$"
    ):
        Vocabulary.from_tokenizer(NoEos())

    class Opaque:
        eos_token_ids = frozenset({0})

    message = (
        "structured output reads the vocabulary of an HFTokenizer or of a tokenizer "
        "with token_bytes() and special_token_ids(), got Opaque"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        Vocabulary.from_tokenizer(Opaque())  # type: ignore[arg-type]


def test_a_multi_byte_token_is_one_token() -> None:
    vocabulary = Vocabulary.from_tokenizer(TextVocabulary(("é", "e", "<eos>")))
    matcher = GrammarCompiler(vocabulary).compile_now(Regex("é+")).matcher()
    assert matcher.allowed_token_ids() == {0}
    assert matcher.advance(0)
    assert matcher.allowed_token_ids() == {0, 2}
