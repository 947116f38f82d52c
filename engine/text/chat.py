"""Chat messages: the one check every tokenizer runs before rendering a conversation.

The real tokenizer (:class:`~twostroke.engine.text.tokenizer.HFTokenizer`) and the toy one
(:class:`~twostroke.engine.runners.toy.ByteTokenizer`) both call :func:`validate_messages`,
so a malformed conversation fails with the same error on every model, before anything is
queued.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence

__all__ = ["validate_messages"]

_MESSAGE_KEYS = frozenset({"role", "content"})
_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_REPR.maxstring = _REPR.maxother = 40


def _show(value: object) -> str:
    return f"{type(value).__name__} {_REPR.repr(value)}"


def validate_messages(messages: object) -> list[dict[str, str]]:
    """Check that ``messages`` is a non-empty list of ``{"role": str, "content": str}``.

    Shared by every :class:`~twostroke.engine.text.tokenizer.Tokenizer` so that a malformed
    conversation fails the same way, with the index of the bad message, whatever the model;
    a chat template would otherwise fail inside Jinja with a message about the template
    rather than the input.

    Args:
        messages: The conversation, oldest message first.

    Returns:
        A copy of the messages as plain dicts, ready for a chat template.

    Raises:
        TypeError: ``messages`` is not a sequence of mappings, or a role or content is not a
            string.
        ValueError: ``messages`` is empty, a message lacks ``role`` or ``content`` or has
            other keys, or a role is empty.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a sequence of {{'role': str, 'content': str}} mappings, "
            f"got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages must contain at least one message, got an empty sequence")
    checked: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        # A dict, the usual message, skips the ABC check: this runs at every chat submit.
        if type(message) is not dict and not isinstance(message, Mapping):
            raise TypeError(
                f"messages[{index}] must be a mapping with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        if message.keys() != _MESSAGE_KEYS:  # one set comparison when the keys are right
            missing = sorted(map(repr, _MESSAGE_KEYS - message.keys()))
            if missing:
                raise ValueError(
                    f"messages[{index}] must have keys 'role' and 'content', "
                    f"missing {', '.join(missing)}"
                )
            extra = sorted(map(repr, message.keys() - _MESSAGE_KEYS))
            raise ValueError(
                f"messages[{index}] may have only keys 'role' and 'content', got also "
                f"{', '.join(extra)}"
            )
        role, content = message["role"], message["content"]
        if not isinstance(role, str):
            raise TypeError(f"messages[{index}]['role'] must be a str, got {_show(role)}")
        if not isinstance(content, str):
            raise TypeError(f"messages[{index}]['content'] must be a str, got {_show(content)}")
        if not role:
            raise ValueError(f"messages[{index}]['role'] must be non-empty, got ''")
        checked.append({"role": role, "content": content})
    return checked
