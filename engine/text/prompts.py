"""Turning what a caller passes as a prompt into token ids, with clear errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from twostroke.engine.prompts import prompt_kind
from twostroke.engine.text.tokenizer import Tokenizer

__all__ = ["tokenize_prompt"]


def tokenize_prompt(prompt: object, tokenizer: Tokenizer) -> tuple[int, ...]:
    """Token ids for ``prompt`` (a :data:`~twostroke.engine.prompts.Prompt`), checked once.

    Returns:
        The ids, as a tuple: ints in the vocabulary (given ids are checked; the tokenizer's
        own are trusted). The engine builds the request, its handle and its detokenizer
        from this tuple without checking it again.

    Raises:
        TypeError: the prompt is neither text, token ids nor chat messages.
        ValueError: it is empty, or a token id is outside the vocabulary.
    """
    kind = prompt_kind(prompt)  # its shape: the coordinator's check too
    if kind == "text":
        token_ids = tokenizer.encode(cast(str, prompt))
    elif kind == "messages":
        token_ids = tokenizer.apply_chat_template(cast(Sequence[Mapping[str, str]], prompt))
    else:
        given = tuple(cast(Sequence[int], prompt))
        vocab = tokenizer.vocab_size
        if min(given) < 0 or max(given) >= vocab:  # one pass each, in C; then find which
            index, token_id = next((i, t) for i, t in enumerate(given) if not 0 <= t < vocab)
            raise ValueError(
                f"prompt token ids must be in [0, {vocab}), got {token_id} at index {index}"
            )
        return given
    if not token_ids:
        raise ValueError("prompt must encode to at least one token, got 0")
    return tuple(token_ids)
