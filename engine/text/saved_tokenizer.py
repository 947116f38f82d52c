"""A fast tokenizer read from the files ``transformers`` saves, without importing ``transformers``.

Importing ``transformers`` takes 1.7-2.8 s (its ``__init__`` scans every model folder it
ships), and ``AutoTokenizer.from_pretrained`` then parses ``tokenizer.json`` four times
(another second): more than half of a warm start (measured on the AVX2 EPYC; see
docs/performance.md). A tokenizer that ``save_pretrained`` wrote, as the artifact cache
holds for a GGUF model (:mod:`twostroke.engine.artifacts.cache`), needs none of it:

* ``tokenizer.json`` is the Rust tokenizer exactly as ``transformers`` configured it (its
  post-processor adds BOS where the model wants one), read by ``tokenizers`` in a few
  hundred milliseconds;
* ``tokenizer_config.json`` names the special tokens (``eos_token``, ``bos_token``, ...);
* ``chat_template.jinja`` (or ``tokenizer_config.json``'s ``chat_template``) is rendered
  with Jinja the way ``transformers`` renders it, within bounds
  (:mod:`~twostroke.engine.text.chat_template`), the named special tokens as variables,
  and the result tokenized without added special tokens.

Our messages are plain dicts (``{"role": str, "content": str}``, checked by
:func:`~twostroke.engine.text.chat.validate_messages`; with tools, the OpenAI-shaped
``tool_calls`` and tool messages :mod:`twostroke.engine.tools.template` builds) and tools
arrive as JSON schemas, so none of ``transformers``' conversions of message objects, Python
functions as tools, or documents apply. The tests compare ids, text and
chat renderings with ``transformers`` on SmolLM2's tokenizer and on a small BPE.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twostroke.engine.text.chat_template import (
    DEFAULT_TEMPLATE_LIMITS,
    TemplateLimits,
    render_chat,
)

if TYPE_CHECKING:
    import tokenizers

__all__ = ["SavedTokenizer"]

#: The named special tokens ``transformers`` passes to a chat template (its
#: ``SPECIAL_TOKENS_ATTRIBUTES``).
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_TOKENIZER_JSON = "tokenizer.json"
_TOKENIZER_CONFIG = "tokenizer_config.json"
_CHAT_TEMPLATE = "chat_template.jinja"


class SavedTokenizer:
    """The tokenizer files of one folder, read with ``tokenizers`` and Jinja.

    Use :meth:`read`.

    Args:
        folder: Where the files are (``transformers`` can load the same folder).
        raw: The Rust tokenizer of ``tokenizer.json``.
        special_tokens: Named special tokens (``"eos_token": "<|im_end|>"``).
        chat_template: The Jinja chat template, if the tokenizer has one.
    """

    def __init__(
        self,
        folder: Path,
        raw: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
    ) -> None:
        self.folder = folder
        self._raw = raw
        self._special_tokens = dict(special_tokens)
        self.chat_template = chat_template

    @classmethod
    def read(cls, folder: Path) -> SavedTokenizer:
        """Read ``folder``'s ``tokenizer.json``, ``tokenizer_config.json`` and chat template.

        Args:
            folder: A folder ``save_pretrained`` wrote for a fast tokenizer.

        Returns:
            The tokenizer.

        Raises:
            ValueError: a file is missing, unreadable or not what ``transformers`` writes
                (the message names it); the caller falls back to ``transformers``.
        """
        import tokenizers

        config_path = folder / _TOKENIZER_CONFIG
        template_path = folder / _CHAT_TEMPLATE
        try:
            raw = tokenizers.Tokenizer.from_file(str(folder / _TOKENIZER_JSON))
            config = json.loads(config_path.read_text(encoding="utf-8"))
            template_file = (
                template_path.read_text(encoding="utf-8") if template_path.is_file() else None
            )
        except Exception as error:  # tokenizers raises its own Exception; OSError; JSON
            raise ValueError(f"{folder}: {type(error).__name__}: {error}") from error
        if not isinstance(config, dict):  # a damaged file, not a wrong argument
            kind = type(config).__name__
            raise ValueError(f"{config_path} must hold a JSON object, got {kind}")  # noqa: TRY004
        template = config.get("chat_template") if template_file is None else template_file
        if template is not None and not isinstance(template, str):
            # Several named templates: transformers' selection rules are not worth copying.
            raise ValueError(f"{config_path}: chat_template is a {type(template).__name__}")
        special = {
            name: _token_text(config_path, name, config.get(name)) for name in _SPECIAL_TOKENS
        }
        # transformers turns these off before every call; a saved file may carry them.
        raw.no_truncation()
        raw.no_padding()
        named = {name: text for name, text in special.items() if text is not None}
        return cls(folder, raw, named, template)

    @property
    def raw(self) -> tokenizers.Tokenizer:
        """The Rust tokenizer of ``tokenizer.json`` (to read, not to change: it is shared)."""
        return self._raw

    @property
    def vocab_size(self) -> int:
        """Ids known, added tokens included (``len()`` of the ``transformers`` tokenizer)."""
        return int(self._raw.get_vocab_size(with_added_tokens=True))

    def vocabulary(self) -> list[str]:
        """Every token's vocabulary entry, added tokens included."""
        return list(self._raw.get_vocab(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        """The id of ``eos_token``, if it is named and known."""
        eos = self._special_tokens.get("eos_token")
        return None if eos is None else self._raw.token_to_id(eos)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; with ``add_special_tokens`` the post-processor's (BOS) too."""
        return list(self._raw.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped, spaces not cleaned up."""
        return str(self._raw.decode(list(token_ids), skip_special_tokens=True))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        limits: TemplateLimits = DEFAULT_TEMPLATE_LIMITS,
    ) -> str:
        """``messages`` (and ``tools``, the template's ``tools`` variable) through the chat
        template, ending with the generation prompt, within ``limits``.

        Raises:
            ValueError: the tokenizer has no chat template.
            TemplateBoundExceeded: the rendering crossed one of ``limits``.
            jinja2.TemplateError: the template does not compile or rejects the messages.
        """
        if self.chat_template is None:
            raise ValueError(f"the tokenizer in {self.folder} has no chat template")
        return render_chat(self.chat_template, messages, tools, self._special_tokens, limits)

    @property
    def special_tokens(self) -> Mapping[str, str]:
        """The named special tokens (``"eos_token": "<|im_end|>"``), as a template sees them."""
        return self._special_tokens

    def __repr__(self) -> str:
        return f"<SavedTokenizer {str(self.folder)!r} vocab_size={self.vocab_size}>"


def _token_text(path: Path, name: str, value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: text, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ValueError(f"{path}: {name} must be a string or {{'content': str}}, got {value!r:.80}")
