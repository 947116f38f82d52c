"""Turning what a caller passes as a prompt into token ids, with clear errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

from twostroke.engine.text.tokenizer import Tokenizer

__all__ = ["Prompt", "tokenize_prompt"]

#: Text, token ids, or chat messages (``[{"role": "user", "content": "..."}]``).
Prompt: TypeAlias = str | Sequence[int] | Sequence[Mapping[str, str]]


def tokenize_prompt(prompt: object, tokenizer: Tokenizer) -> list[int]:
    """Token ids for ``prompt``.

    Raises:
        TypeError: the prompt is neither text, token ids nor chat messages.
        ValueError: it is empty, or a token id is outside the vocabulary.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty, got ''")
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty, got an empty sequence")
        if all(isinstance(item, Mapping) for item in prompt):
            token_ids = tokenizer.apply_chat_template(prompt)
        elif all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
            token_ids = list(prompt)
            vocab = tokenizer.vocab_size
            for index, token_id in enumerate(token_ids):
                if not 0 <= token_id < vocab:
                    raise ValueError(
                        f"prompt token ids must be in [0, {vocab}), got {token_id} at index {index}"
                    )
        else:
            kinds = sorted({type(item).__name__ for item in prompt})
            raise TypeError(
                "prompt must be text, a sequence of token ids (int) or of chat messages "
                f"(mappings), got a sequence of {', '.join(kinds)}"
            )
    else:
        raise TypeError(
            "prompt must be text, a sequence of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    if not token_ids:
        raise ValueError("prompt must encode to at least one token, got 0")
    return token_ids
