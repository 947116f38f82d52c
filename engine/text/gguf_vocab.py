"""How llama.cpp splits text before a GGUF vocabulary's merges run, by the file's names for it.

A GGUF file carries no ``tokenizer.json``: its vocabulary, merges and scores are metadata,
and two names say how to use them. ``tokenizer.ggml.model`` names the algorithm (``"gpt2"``:
byte-level BPE; ``"llama"``: SentencePiece with byte fallback, ``<0xNN>`` for a byte
with no piece of its own); for BPE, ``tokenizer.ggml.pre`` names the *pre-tokenizer*, the
regular expressions that cut text into the words the merges run within: SmolLM's writes
each digit alone, Llama 3's keeps up to three digits together and glues one punctuation
character to the word after it. Split differently, a text gets other ids than the model
was trained on, with no error anywhere.

llama.cpp defines the format and keeps the table from each name to its expressions
(``src/llama-vocab.cpp``, ``llm_tokenizer_bpe``). ``transformers``' GGUF converter knows
some of the names and splits every other one as GPT-2 does, without a word: SmolLM2's
``"smollm"`` among them. :data:`PRE_TOKENIZERS` is llama.cpp's table for the names of the
models twostroke loads, written for the ``tokenizers`` library: each expression splits
every piece the one before it left, its matches and the text between them each becoming a
piece (llama.cpp's ``unicode_regex_split``; ``Split(behavior="isolated")``), then
``ByteLevel`` spells the bytes in the vocabulary's alphabet. The expressions are the ones
llama.cpp runs, its "adapted" forms included where it rewrote a model's own for its regex
engine (contractions as ``'[sS]`` rather than ``(?i:'s)``, a letter's case as ASCII
``[^a-z]``), so a file's ids are llama.cpp's; ``tests/engine/text/test_gguf_vocab.py``
checks them against llama-cpp-python for each expression set. A name outside the table
is refused (:class:`UnknownPreTokenizer`), never split some default way.

A SentencePiece vocabulary (``"llama"``: Llama 2, Gemma) needs no pre-tokenizer, but its
spaces are llama.cpp's too (:meth:`GGUFVocab.fit`): transformers' Llama tokenizer adds the
prefix space its own way, and where the file says not to.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import attrs

from twostroke.states.errors import EngineError

if TYPE_CHECKING:
    import tokenizers

__all__ = [
    "BYTE_LEVEL_BPE",
    "PRE_TOKENIZERS",
    "SENTENCEPIECE",
    "GGUFVocab",
    "PreTokenizerRule",
    "UnknownPreTokenizer",
]

#: ``tokenizer.ggml.model`` of a byte-level BPE vocabulary (GPT-2's algorithm).
BYTE_LEVEL_BPE = "gpt2"
#: ``tokenizer.ggml.model`` of a SentencePiece vocabulary with scores and byte fallback.
SENTENCEPIECE = "llama"
#: What llama.cpp splits a BPE vocabulary's text by when the file names no pre-tokenizer
#: (it warns that generation quality will suffer; so do we).
DEFAULT_PRE_TOKENIZER = "default"


class UnknownPreTokenizer(EngineError, ValueError):
    """A GGUF file names a pre-tokenizer (``tokenizer.ggml.pre``) twostroke does not know.

    Args:
        name: The file's name for it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"tokenizer.ggml.pre must be a pre-tokenizer twostroke knows, got {name!r} "
            f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )


@attrs.frozen
class PreTokenizerRule:
    """How llama.cpp splits a BPE vocabulary's text for one family of pre-tokenizer names.

    Attributes:
        regexes: The expressions, applied one after another, each to every piece the one
            before it left (see the module).
        ignore_merges: A word that is a vocabulary entry whole is that one token, whatever
            the merges would make of it (llama.cpp's ``ignore_merges``, Llama 3's rule).
    """

    regexes: tuple[str, ...] = attrs.field(validator=attrs.validators.min_len(1))
    ignore_merges: bool = False

    def pre_tokenizer(self) -> tokenizers.pre_tokenizers.PreTokenizer:
        """The ``tokenizers`` pre-tokenizer that splits as this rule does.

        Returns:
            The splits by :attr:`regexes`, then the byte-level spelling.
        """
        from tokenizers import Regex, pre_tokenizers

        splits: list[tokenizers.pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in self.regexes
        ]
        # use_regex=False: the splits above are the whole of the word-splitting; ByteLevel's
        # own expression is GPT-2's, and would cut Llama 3's or SmolLM's words again.
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([*splits, byte_level])


@attrs.frozen
class GGUFVocab:
    """The names a GGUF file gives its tokenizer, checked against what twostroke can build.

    Use :meth:`from_metadata`.

    Attributes:
        model: ``tokenizer.ggml.model`` (``"gpt2"``, ``"llama"``, ...).
        pre: ``tokenizer.ggml.pre`` as the file states it, or ``None`` where it states none.
        rule: How a BPE vocabulary's text is split; ``None`` for any other model.
        add_space_prefix: ``tokenizer.ggml.add_space_prefix`` (default true): a
            SentencePiece vocabulary's text, and its text after each special token, starts
            with a space.
    """

    model: str
    pre: str | None
    rule: PreTokenizerRule | None
    add_space_prefix: bool = True

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, object]) -> GGUFVocab:
        """The tokenizer names of a GGUF file's metadata.

        A BPE file that names no pre-tokenizer gets llama.cpp's ``"default"`` one, as
        llama.cpp gives it (older conversions wrote no name).

        Args:
            metadata: The file's key/values (``tokenizer.ggml.*`` among them).

        Returns:
            The names, with the BPE vocabulary's rule.

        Raises:
            TypeError: ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre`` is not a string.
            UnknownPreTokenizer: a BPE file names a pre-tokenizer outside
                :data:`PRE_TOKENIZERS`.
        """
        model = metadata.get("tokenizer.ggml.model", SENTENCEPIECE)
        pre = metadata.get("tokenizer.ggml.pre")
        prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
        if not isinstance(model, str):
            raise TypeError(f"tokenizer.ggml.model must be a str, got {model!r:.80}")
        if pre is not None and not isinstance(pre, str):
            raise TypeError(f"tokenizer.ggml.pre must be a str, got {pre!r:.80}")
        if not isinstance(prefix, bool):
            raise TypeError(f"tokenizer.ggml.add_space_prefix must be a bool, got {prefix!r:.80}")
        if model != BYTE_LEVEL_BPE:
            return cls(model, pre, None, prefix)
        name = pre or DEFAULT_PRE_TOKENIZER
        rule = PRE_TOKENIZERS.get(name)
        if rule is None:
            raise UnknownPreTokenizer(name)
        return cls(model, pre, rule)

    def describe(self) -> str:
        """The names as a cached tokenizer's record keeps them: ``"gpt2/smollm"``."""
        return f"{self.model}/{self.pre or '-'}"

    def fit(self, tokenizer: tokenizers.Tokenizer) -> None:
        """Make the tokenizer ``transformers`` built from the file split as llama.cpp does.

        A BPE vocabulary gets its rule's pre-tokenizer. A SentencePiece one gets llama.cpp's
        spaces: each space written ``▁``, and one more before the text and after each
        special token where the file asks for a prefix space. transformers' ``Metaspace``
        adds none to a text that starts with a space (``" hi"`` is ``▁hi``, llama.cpp's
        ``▁▁hi``), nor after a special token, and adds one where the file says not to.

        Args:
            tokenizer: The Rust tokenizer (``backend_tokenizer``); changed in place.
        """
        if self.model == SENTENCEPIECE:
            self._fit_sentencepiece(tokenizer)
        if self.rule is None:
            return
        tokenizer.pre_tokenizer = self.rule.pre_tokenizer()
        # Every BPE vocabulary transformers builds from a GGUF has a BPE model.
        tokenizer.model.ignore_merges = self.rule.ignore_merges

    def _fit_sentencepiece(self, tokenizer: tokenizers.Tokenizer) -> None:
        from tokenizers import decoders, normalizers

        # The normalizer runs on each stretch of text between special tokens, as llama.cpp
        # prefixes each (its is_prev_special).
        spaces = normalizers.Replace(" ", "\u2581")
        prefix = [normalizers.Prepend("\u2581")] if self.add_space_prefix else []
        tokenizer.normalizer = normalizers.Sequence([*prefix, spaces])
        tokenizer.pre_tokenizer = None
        # Decoding drops the one space the prefix added, and no other.
        strip = [decoders.Strip(content=" ", left=1)] if self.add_space_prefix else []
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )


# The expressions as llama.cpp's llm_tokenizer_bpe holds them (src/llama-vocab.cpp, as
# llama-cpp-python 0.3.36 vendors it), in Python's raw-string spelling of its C strings.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# An upper-case run then a lower-case one, case by ASCII alone: llama.cpp's regex engine has
# no \p{Lu}, so it rewrote the model's [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]* as "a letter not a-z".
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_RULE_NAMES: tuple[tuple[PreTokenizerRule, tuple[str, ...]], ...] = (
    (
        PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
        (DEFAULT_PRE_TOKENIZER,),
    ),
    (
        PreTokenizerRule((_GPT2,)),
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"),
    ),
    (
        PreTokenizerRule((r"\p{N}", _GPT2)),  # one digit at a time
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
    ),
    (
        PreTokenizerRule((_LLAMA3,), ignore_merges=True),
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"),
    ),
    (PreTokenizerRule((_LLAMA3,)), ("dbrx", "smaug-bpe")),  # Llama 3's split, every merge
    (
        PreTokenizerRule((_QWEN2,)),
        ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"),
    ),
    (PreTokenizerRule((_QWEN35,)), ("qwen35",)),
    (PreTokenizerRule((_GPT4O,)), ("gpt-4o", "llama4")),
    (PreTokenizerRule((_TEKKEN,), ignore_merges=True), ("tekken",)),
)

#: Each ``tokenizer.ggml.pre`` name twostroke knows, and how llama.cpp splits text for it.
PRE_TOKENIZERS: Mapping[str, PreTokenizerRule] = MappingProxyType(
    {name: rule for rule, names in _RULE_NAMES for name in names}
)
