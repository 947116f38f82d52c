"""Turning what a caller passes as a prompt into token ids, with clear errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from twostroke.engine.prompts import prompt_kind
from twostroke.engine.text.tokenizer import Tokenizer

__all__ = ["tokenize_prompt"]


def tokenize_prompt(prompt: object, tokenizer: Tokenizer) -> list[int]:
    """Token ids for ``prompt`` (a :data:`~twostroke.engine.prompts.Prompt`).

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
        token_ids = list(cast(Sequence[int], prompt))
        vocab = tokenizer.vocab_size
        for index, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab:
                raise ValueError(
                    f"prompt token ids must be in [0, {vocab}), got {token_id} at index {index}"
                )
    if not token_ids:
        raise ValueError("prompt must encode to at least one token, got 0")
    return token_ids
