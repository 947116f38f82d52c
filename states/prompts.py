"""What a caller may pass as a prompt, and the one check of its shape.

Tokenizer-free on purpose: the engine checks a prompt here and then tokenizes it
(:func:`~twostroke.engine.text.prompt_ids.tokenize_prompt`); the data-parallel coordinator,
which holds no tokenizer, checks it here and sends it as given to a replica
(:func:`~twostroke.engine.coordinator.frames.wire_prompt`). So a bad prompt raises the same
error through either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, TypeAlias

from twostroke.states.validators import is_int

__all__ = ["Prompt", "PromptKind", "prompt_kind"]

#: Text, token ids, or chat messages (``[{"role": "user", "content": "..."}]``).
Prompt: TypeAlias = str | Sequence[int] | Sequence[Mapping[str, str]]
#: Which of the three a :data:`Prompt` is.
PromptKind: TypeAlias = Literal["text", "token_ids", "messages"]


def prompt_kind(prompt: object) -> PromptKind:
    """Which kind of :data:`Prompt` ``prompt`` is: text, token ids or chat messages.

    Checks the shape only: whether token ids are in the vocabulary, and what the text or the
    messages tokenize to, is for whoever holds the tokenizer.

    Raises:
        TypeError: ``prompt`` is neither text, token ids (ints, not bools) nor chat messages
            (mappings), or mixes them.
        ValueError: it is empty.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty, got ''")
        return "text"
    # A list or a tuple is a Sequence without the ABC check (the engine asks at every submit).
    if isinstance(prompt, list | tuple) or (
        isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray)
    ):
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty, got an empty sequence")
        for item in prompt:  # the usual case first: plain ints, one type check each
            if type(item) is not int:
                break
        else:
            return "token_ids"
        if all(is_int(item) for item in prompt):
            return "token_ids"
        # A dict, the usual message, skips the ABC check (the engine asks at every submit).
        if all(type(item) is dict or isinstance(item, Mapping) for item in prompt):
            return "messages"
        kinds = sorted({type(item).__name__ for item in prompt})
        raise TypeError(
            "prompt must be text, a sequence of token ids (int) or of chat messages "
            f"(mappings), got a sequence of {', '.join(kinds)}"
        )
    raise TypeError(
        "prompt must be text, a sequence of token ids or a list of chat messages, "
        f"got {type(prompt).__name__}"
    )
