"""Vocabularies for the structured-output tests: token texts of a strategy, and the toy's bytes."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.structured import GrammarCompiler, Vocabulary


@attrs.frozen
class TextVocabulary:
    """A :class:`~twostroke.engine.structured.TokenBytes` over token texts; the last is EOS."""

    texts: tuple[str, ...]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({len(self.texts) - 1})

    def token_bytes(self) -> Sequence[bytes]:
        return [text.encode() for text in self.texts[:-1]] + [b"<eos>"]

    def special_token_ids(self) -> frozenset[int]:
        return self.eos_token_ids

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(self.texts[token] for token in tokens if token != len(self.texts) - 1)


@pytest.fixture(scope="session")
def byte_vocabulary() -> Vocabulary:
    """The toy runner's vocabulary: bytes 0..255 and EOS (256)."""
    return Vocabulary.from_tokenizer(ByteTokenizer())


@pytest.fixture(scope="session")
def byte_compiler(byte_vocabulary: Vocabulary) -> GrammarCompiler:
    """A compiler for the byte vocabulary, shared (compiled constraints are values)."""
    return GrammarCompiler(byte_vocabulary)
