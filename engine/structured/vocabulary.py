"""A tokenizer's vocabulary as the backend reads it: every token's bytes, and EOS.

llguidance computes a mask by walking a trie of the tokens' bytes, so it needs each token as
bytes (a byte-level BPE token is not a string: it may hold half a UTF-8 character). It reads
them from a Hugging Face fast tokenizer (:class:`~twostroke.engine.text.tokenizer.HFTokenizer`)
itself, or from any tokenizer that lists its tokens' bytes (:class:`TokenBytes`: the toy
runner's byte tokenizer, or a test's own vocabulary). Building one takes about a second for
SmolLM2's 49,152 tokens: do it once per tokenizer, off the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from twostroke.engine.structured.backend import llguidance
from twostroke.engine.text.tokenizer import HFTokenizer, Tokenizer

__all__ = ["TokenBytes", "Vocabulary"]


@runtime_checkable
class TokenBytes(Protocol):
    """A tokenizer that lists its tokens' bytes (besides what :class:`Tokenizer` has)."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end generation."""
        ...

    def token_bytes(self) -> Sequence[bytes]:
        """Each token id's bytes, in id order (a special token's may be its name)."""
        ...

    def special_token_ids(self) -> frozenset[int]:
        """The ids of tokens that are not text (EOS among them): no grammar spells them."""
        ...


class _Wrapped:
    """What ``llguidance.TokenizerWrapper`` reads: tokens, EOS, and a tokenizing call."""

    def __init__(self, tokenizer: TokenBytes) -> None:
        self.tokens = list(tokenizer.token_bytes())
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = None
        self.special_token_ids = sorted(tokenizer.special_token_ids())
        ordinary = [
            (text, token)
            for token, text in enumerate(self.tokens)
            if token not in tokenizer.special_token_ids() and text
        ]
        self._by_text = dict(ordinary)
        self._longest = max((len(text) for text, _ in ordinary), default=1)

    def __call__(self, text: bytes) -> list[int]:
        """Greedy longest-match tokenization; bytes no token spells are skipped.

        llguidance calls this only for text it tokenizes itself (forced continuations);
        a mask never depends on it.
        """
        tokens, start = [], 0
        while start < len(text):
            for length in range(min(self._longest, len(text) - start), 0, -1):
                token = self._by_text.get(text[start : start + length])
                if token is not None:
                    tokens.append(token)
                    start += length
                    break
            else:
                start += 1
        return tokens


@attrs.frozen(eq=False)
class Vocabulary:
    """A tokenizer's vocabulary, built for the backend once.

    Use :meth:`from_tokenizer`.

    Attributes:
        backend: llguidance's tokenizer (the token trie and its precomputed slices).
        vocab_size: How many token ids a mask covers.
        eos_token_ids: The ids that end generation: allowed exactly where the output is
            complete.
    """

    backend: llguidance.LLTokenizer
    vocab_size: int
    eos_token_ids: frozenset[int]

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer | TokenBytes) -> Vocabulary:
        """Read a tokenizer's vocabulary (blocking: about a second for 50,000 tokens).

        Args:
            tokenizer: An :class:`HFTokenizer` (a fast one), or a :class:`TokenBytes`.

        Returns:
            The vocabulary.

        Raises:
            TypeError: another kind of tokenizer, or one without EOS.
        """
        eos = frozenset(tokenizer.eos_token_ids)
        if not eos:
            raise TypeError("structured output needs a tokenizer with an EOS token, got none")
        if isinstance(tokenizer, HFTokenizer):
            from llguidance.hf import from_tokenizer
            from transformers import PreTrainedTokenizerFast

            fast = tokenizer.backend
            if not isinstance(fast, PreTrainedTokenizerFast):
                raise TypeError(
                    "structured output reads a fast (Rust) Hugging Face tokenizer, got "
                    f"{type(fast).__name__} from {tokenizer.source}"
                )
            backend = from_tokenizer(fast, n_vocab=tokenizer.vocab_size, eos_token=sorted(eos))
            return cls(backend, tokenizer.vocab_size, eos)
        if isinstance(tokenizer, TokenBytes):
            wrapped = _Wrapped(tokenizer)
            backend = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(wrapped), eos_token=sorted(eos)
            )
            return cls(backend, len(wrapped.tokens), eos)
        raise TypeError(
            "structured output reads the vocabulary of an HFTokenizer or of a tokenizer "
            f"with token_bytes() and special_token_ids(), got {type(tokenizer).__name__}"
        )

    def __repr__(self) -> str:
        return f"<Vocabulary {self.vocab_size} tokens, eos_token_ids={sorted(self.eos_token_ids)}>"
