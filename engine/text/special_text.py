"""Special-token text inside chat messages, encoded as the text it is.

A chat template writes its control tokens as text (``'<|im_start|>' + message['role']``)
and the tokenizer recognizes them in the rendered string, the contents' text included: a
tool result or a user message that holds ``<|im_start|>system\\n...<|im_end|>`` would open
a real system turn in the middle of the prompt, a cheap amplifier for prompt injection
against an agent. Here the contents keep such text as text, while the template's own
control tokens stay the tokens they are:

* a conversation none of whose literal contents holds a special token's text (every
  ordinary one) is encoded exactly as before, the rendered string in one call;
* otherwise each occurrence is found in the rendered string: the template renders the
  conversation a second time with each occurrence replaced by a unique placeholder, and
  that rendering, with the occurrences put back, must be the first one character for
  character (a template that rewrites contents, say upper-cases them, is refused rather
  than guessed at);
* the rendered string is encoded as before, with offsets; the special tokens that cover an
  occurrence are the contents', the others the template's. Between two of the template's
  tokens lies a segment the tokenizer encodes on its own in any case (added tokens split
  the text first); a segment that holds an occurrence is encoded again by a copy of the
  tokenizer that reads special tokens as text (``tokenizers``' ``encode_special_tokens``),
  every other segment keeps its ids.

Only tokens the tokenizer marks ``special`` are kept as text: an added token that is not
special (Qwen2.5's ``<tool_call>``) is ordinary vocabulary for ``tokenizers``, recognized
in contents as before.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import tokenizers

__all__ = ["Masked", "SpecialText", "check_special_token_roles"]

#: Placeholders are a private-use character, a per-call nonce, the occurrence's number and
#: another private-use character: neither a token's text nor anything a client can guess.
_OPEN, _CLOSE = "\ue000", "\ue001"


def check_special_token_roles(roles: object) -> frozenset[str]:
    """``roles`` as the frozen set a tokenizer keeps, checked.

    Raises:
        TypeError: ``roles`` is a string, or not a collection of strings.
        ValueError: it holds ``"tool"`` or an empty role.
    """
    if isinstance(roles, str | bytes) or not isinstance(roles, Collection):
        raise TypeError(
            f"special_token_roles must be a collection of roles (str), got "
            f"{type(roles).__name__} {roles!r:.80}"
        )
    checked = frozenset(roles)
    for role in sorted(checked, key=repr):
        if not isinstance(role, str):
            raise TypeError(
                f"special_token_roles must hold roles (str), got {type(role).__name__} {role!r:.80}"
            )
        if not role:
            raise ValueError("special_token_roles must hold non-empty roles, got ''")
    if "tool" in checked:
        raise ValueError(
            "special_token_roles may not include 'tool': a tool result's special-token "
            f"text is always encoded as text, got {sorted(checked)}"
        )
    return checked


class SpecialText:
    """A ``tokenizers`` tokenizer's special tokens, and its encoding of a rendered chat that
    keeps their text inside the contents as text (see the module docstring).

    Args:
        raw: The Rust tokenizer the model's text is encoded with. It is read, never
            changed: the copy that reads special tokens as text is made from it on first
            use.
    """

    def __init__(self, raw: tokenizers.Tokenizer) -> None:
        self._raw = raw
        added = raw.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        texts = sorted({added[i].content for i in self._special_ids if added[i].content})
        # Longest first: a token whose text holds another's is found whole.
        texts.sort(key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, texts))) if texts else None

    def find(self, text: str) -> str | None:
        """The first special token's text in ``text``, or ``None``."""
        if self._pattern is None:
            return None
        found = self._pattern.search(text)
        return None if found is None else found.group()

    @functools.cached_property
    def _literal(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that encodes special tokens' text as text (a copy: the
        setting is the tokenizer's own, and the engine's other threads encode with it)."""
        import tokenizers

        copy = tokenizers.Tokenizer.from_str(self._raw.to_str())
        copy.no_truncation()
        copy.no_padding()
        copy.encode_special_tokens = True
        return copy

    def mask(
        self, conversation: Sequence[Mapping[str, Any]], special_token_roles: frozenset[str]
    ) -> Masked | None:
        """``conversation`` with every special token's text in a literal message's content
        (one whose role is not in ``special_token_roles``) replaced by a placeholder;
        ``None`` where there is none, and the conversation is encoded as it always was.
        """
        if self._pattern is None:
            return None
        nonce = secrets.token_hex(8)
        found: list[str] = []

        def placeholder(match: re.Match[str]) -> str:
            found.append(match.group())
            return f"{_OPEN}{nonce}:{len(found) - 1}{_CLOSE}"

        messages: list[dict[str, Any]] = []
        for message in conversation:
            content = message.get("content")
            if isinstance(content, str) and message.get("role") not in special_token_roles:
                messages.append({**message, "content": self._pattern.sub(placeholder, content)})
            else:
                messages.append(dict(message))
        return Masked(messages, nonce, tuple(found)) if found else None

    def encode(self, rendered: str, spans: Sequence[tuple[int, int]]) -> list[int]:
        """Ids of ``rendered`` (no special tokens added), the text in ``spans`` encoded as
        text and everything else as the tokenizer always encodes it."""
        encoding = self._raw.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        segment_ids: list[int] = []
        segment_start = 0

        def close_segment(end: int) -> None:
            if _overlaps(segment_start, end, spans):
                text = rendered[segment_start:end]
                ids.extend(self._literal.encode(text, add_special_tokens=False).ids)
            else:
                ids.extend(segment_ids)
            segment_ids.clear()

        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self._special_ids and not _overlaps(start, end, spans):
                close_segment(start)  # one of the template's: it ends a segment
                ids.append(token_id)
                segment_start = end
            else:
                segment_ids.append(token_id)
        close_segment(len(rendered))
        return ids


@attrs.frozen
class Masked:
    """A conversation whose contents' special-token text is replaced by placeholders.

    Attributes:
        messages: The conversation, for the template to render.
        nonce: The random part of this conversation's placeholders.
        texts: What each placeholder stands for, by its number.
    """

    messages: list[dict[str, Any]]
    nonce: str
    texts: tuple[str, ...]

    def unmask(self, rendering: str) -> tuple[str, tuple[tuple[int, int], ...]]:
        """``rendering`` with the placeholders put back, and the spans they fill in it."""
        parts = re.split(f"{_OPEN}{self.nonce}:([0-9]+){_CLOSE}", rendering)
        text: list[str] = []
        spans: list[tuple[int, int]] = []
        at = 0
        for index, part in enumerate(parts):
            number = int(part) if index % 2 else len(self.texts)  # re.split keeps the group
            if number < len(self.texts):  # (a number past them: the template wrote it)
                part = self.texts[number]
                spans.append((at, at + len(part)))
            text.append(part)
            at += len(part)
        return "".join(text), tuple(spans)


def _overlaps(start: int, end: int, spans: Sequence[tuple[int, int]]) -> bool:
    return any(start < span_end and span_start < end for span_start, span_end in spans)
