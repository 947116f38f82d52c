"""Tokenizers: what the engine needs from one, and the Hugging Face implementation.

The engine sees a tokenizer only through the :class:`Tokenizer` protocol (encode, decode,
chat template, EOS ids, vocabulary size), so a model's own tokenizer and the byte-level toy
tokenizer of the tests are interchangeable. :class:`HFTokenizer` implements it over a
``transformers`` tokenizer loaded from a model directory or from the tokenizer embedded in a
GGUF file, offline: loading never touches the network.

``transformers`` is imported only when a tokenizer is loaded, because importing it takes
seconds and the engine's pure paths (tests, toy models) never need it. A GGUF file's
tokenizer is converted once and kept in the artifact cache
(:mod:`twostroke.engine.artifacts.cache`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from twostroke.engine.text.chat import validate_messages
from twostroke.engine.text.chat_template import (
    DEFAULT_TEMPLATE_LIMITS,
    TemplateBoundExceeded,
    TemplateLimits,
    render_chat,
)
from twostroke.engine.text.saved_tokenizer import SavedTokenizer
from twostroke.engine.text.special_text import SpecialText, check_special_token_roles
from twostroke.states.errors import EngineError
from twostroke.states.validators import is_int

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from twostroke.engine.text.gguf_vocab import GGUFVocab

__all__ = [
    "ChatTemplateError",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerLoadError",
]

_GGUF_MAGIC = b"GGUF"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_GENERATION_CONFIG = "generation_config.json"
_CACHED_TOKENIZER = "tokenizer"
#: The version of the GGUF tokenizer conversion, in a cached tokenizer's record: a tokenizer
#: converted by another one is converted again (1: transformers' own pre-tokenizers, before
#: the record named any; 2: llama.cpp's, :mod:`twostroke.engine.text.gguf_vocab`).
_GGUF_CONVERSION = 2
#: What :meth:`HFTokenizer.check_chat_template` renders at load.
_PROBE_CONVERSATION = (
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Say hi."},
)

_log = logging.getLogger(__name__)


class TokenizerLoadError(EngineError):
    """A tokenizer could not be loaded; the message names the path and the problem."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"cannot load a tokenizer from {self.path}: {reason}")


class ChatTemplateError(EngineError, ValueError):
    """Chat messages could not be rendered: the model has no chat template, or it refused them."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer.

    Implementations: :class:`HFTokenizer` for real models, and the byte tokenizer of
    ``twostroke.engine.runners.toy`` (ids 0..255 are UTF-8 bytes) for toy models.
    """

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end generation (unless a request ignores EOS)."""
        ...

    @property
    def vocab_size(self) -> int:
        """How many ids the tokenizer knows, added and special tokens included."""
        ...

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (its longest vocabulary entry).

        A text of more than ``max_model_len * max_token_chars`` characters cannot fit the
        context, so the engine refuses it before the tokenizer runs.
        """
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with a BOS token iff the model's tokenizer adds one."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped.

        An incomplete UTF-8 sequence renders as U+FFFD, as in ``bytes.decode(errors="replace")``.
        """
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template.

        The rendering ends with the generation prompt (the assistant turn's header). A
        special token's text inside a message's content is encoded as text, not as the
        token (:mod:`twostroke.engine.text.special_text`), unless the tokenizer was told
        that the message's role may write special tokens. ``template_kwargs`` are more
        variables for the template (``enable_thinking``), checked by
        :func:`~twostroke.engine.text.chat_template.check_template_kwargs`.
        """
        ...


class HFTokenizer:
    """A :class:`Tokenizer` over a Hugging Face ``transformers`` tokenizer, or its saved files.

    Decoding never cleans up tokenization spaces (``clean_up_tokenization_spaces=False``),
    whatever the model's configuration says: the clean-up rewrites text across token
    boundaries (``" ,"`` becomes ``","``), so decoding a window of tokens would no longer
    agree with decoding the whole output, and incremental detokenization relies on that
    agreement. vLLM's streamed text has the same property.

    Use :meth:`from_pretrained`; the constructor wraps a tokenizer already loaded. A GGUF
    model's tokenizer read back from the artifact cache is a
    :class:`~twostroke.engine.text.saved_tokenizer.SavedTokenizer`, which gives the same ids
    and text without importing ``transformers`` (seconds of every start); :attr:`backend`
    then loads the ``transformers`` tokenizer from the same files when first asked.

    A chat's contents keep a special token's text as text: a tool result or a user message
    that writes ``<|im_start|>system`` cannot open a system turn
    (:mod:`twostroke.engine.text.special_text`). The template's own control tokens, and a
    prompt given as text, are encoded as always. A conversation none of whose contents holds
    such text (any ordinary one) gets the ids it always got.

    Args:
        tokenizer: The loaded ``transformers`` tokenizer, or a saved fast tokenizer.
        extra_eos_token_ids: Ids that end generation besides the tokenizer's EOS token (the
            generation config's ``eos_token_id``).
        source: Where the tokenizer came from, for messages and ``repr``.
        template_limits: The bounds every rendering of the chat template runs within.
        special_token_roles: The roles whose messages' special-token text is encoded as
            the special tokens (a system prompt written with the model's control tokens
            on purpose, say), as before; every other role's is encoded as text. Never
            ``"tool"``: a tool result's is always text. Default: none.

    Raises:
        TypeError, ValueError: ``special_token_roles`` is not a collection of roles, or
            names ``"tool"``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | SavedTokenizer,
        *,
        extra_eos_token_ids: Iterable[int] = (),
        source: str = "<memory>",
        template_limits: TemplateLimits = DEFAULT_TEMPLATE_LIMITS,
        special_token_roles: Collection[str] = frozenset(),
    ) -> None:
        self._special_token_roles = check_special_token_roles(special_token_roles)
        eos = set(extra_eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        if isinstance(tokenizer, SavedTokenizer):
            self._saved: SavedTokenizer | None = tokenizer
            self._tokenizer: PreTrainedTokenizerBase | None = None
            self._vocab_size = tokenizer.vocab_size
        else:
            self._saved = None
            self._tokenizer = tokenizer
            self._vocab_size = len(tokenizer)
        self._eos_token_ids = frozenset(eos)
        self._source = source
        self._limits = template_limits

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], *, special_token_roles: Collection[str] = frozenset()
    ) -> HFTokenizer:
        """Load the tokenizer of a Hugging Face model directory or of a GGUF file.

        Offline only: files are read from ``path`` and nothing is downloaded, whatever
        ``HF_HUB_OFFLINE`` says, and no remote code runs.

        Args:
            path: A model directory holding ``tokenizer.json`` and/or
                ``tokenizer_config.json`` (and optionally ``generation_config.json``, whose
                ``eos_token_id`` adds EOS ids), or a ``.gguf`` file whose embedded tokenizer
                is used.
            special_token_roles: The roles whose contents may write special tokens (see
                the class); default none.

        Returns:
            The tokenizer.

        Raises:
            TypeError, ValueError: ``special_token_roles`` is not a collection of roles,
                or names ``"tool"``.
            TokenizerLoadError: the path does not exist, is neither a model directory nor a
                GGUF file, or its files are missing or corrupt, or a GGUF file names a
                pre-tokenizer twostroke does not know
                (:class:`~twostroke.engine.text.gguf_vocab.UnknownPreTokenizer`), or its chat
                template runs past its bounds on a short conversation
                (:meth:`check_chat_template`).
        """
        roles = check_special_token_roles(special_token_roles)
        path = Path(path)
        if path.is_dir():
            if not any((path / name).is_file() for name in _TOKENIZER_FILES):
                raise TokenizerLoadError(
                    path, f"the directory has neither {' nor '.join(_TOKENIZER_FILES)}"
                )
            tokenizer: PreTrainedTokenizerBase | SavedTokenizer = _load_transformers_tokenizer(
                path, str(path)
            )
            extra_eos = _generation_config_eos_ids(path / _GENERATION_CONFIG)
        elif path.is_file():
            _check_gguf_magic(path)
            tokenizer = _load_gguf_tokenizer(path)
            extra_eos = frozenset()
        else:
            raise TokenizerLoadError(path, "no such file or directory")
        loaded = cls(
            tokenizer, extra_eos_token_ids=extra_eos, source=str(path), special_token_roles=roles
        )
        try:
            loaded.check_chat_template()
        except ChatTemplateError as exc:
            raise TokenizerLoadError(path, str(exc)) from exc
        return loaded

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS id and the generation config's EOS ids."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """How many ids the tokenizer knows (``len(tokenizer)``: added tokens included)."""
        return self._vocab_size

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry's characters, added tokens included (read once).

        A byte-level BPE writes each byte as one character, so this is the most bytes, and
        so characters, a token stands for; a SentencePiece entry is as long as its text or
        longer (``<0x0A>`` for one byte). The bound holds for tokenizers whose normalizer
        does not shrink text (none of the supported models has one that does).
        """
        if self._saved is not None:
            vocab: Iterable[str] = self._saved.vocabulary()
        else:
            assert self._tokenizer is not None
            vocab = self._tokenizer.get_vocab()
        return max(map(len, vocab), default=1)

    @property
    def backend(self) -> PreTrainedTokenizerBase:
        """The ``transformers`` tokenizer this wraps (loaded on first use from saved files).

        For libraries that read a tokenizer's whole vocabulary in their own way (the
        structured-output backend builds its token trie from it); the engine itself goes
        through the methods above.

        Raises:
            TokenizerLoadError: ``transformers`` cannot load the saved files.
        """
        if self._tokenizer is None:
            assert self._saved is not None
            folder = self._saved.folder
            self._tokenizer = _load_transformers_tokenizer(folder, str(folder))
        return self._tokenizer

    @property
    def source(self) -> str:
        """The path the tokenizer was loaded from."""
        return self._source

    @property
    def special_token_roles(self) -> frozenset[str]:
        """The roles whose contents' special-token text is encoded as the special tokens."""
        return self._special_token_roles

    @functools.cached_property
    def _special_text(self) -> SpecialText | None:
        """The special tokens of the Rust tokenizer, if the tokenizer is one (a fast one)."""
        if self._saved is not None:
            return SpecialText(self._saved.raw)
        raw = getattr(self._tokenizer, "backend_tokenizer", None)
        return None if raw is None else SpecialText(raw)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with the special tokens the model's tokenizer adds (BOS).

        Args:
            text: The prompt.

        Returns:
            The token ids.

        Raises:
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__} {text!r:.80}")
        if self._saved is not None:
            return self._saved.encode(text)
        assert self._tokenizer is not None
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped and no space clean-up.

        Args:
            token_ids: Token ids, as produced by the model.

        Returns:
            The text; an incomplete UTF-8 sequence at the end renders as U+FFFD.
        """
        if self._saved is not None:
            return self._saved.decode(token_ids)
        assert self._tokenizer is not None
        text = self._tokenizer.decode(
            list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the model's own chat template.

        The rendering ends with the generation prompt (``add_generation_prompt=True``) and is
        tokenized exactly as ``transformers`` does it (the template writes BOS itself, so no
        special tokens are added on top).

        A special token's text in a content is encoded as text unless the message's role
        is one of :attr:`special_token_roles` (see the class).

        Args:
            messages: The conversation, oldest first, each ``{"role": ..., "content": ...}``.
            template_kwargs: More variables for the template (vLLM's
                ``chat_template_kwargs``: ``{"enable_thinking": False}`` for Qwen3's).

        Returns:
            The prompt's token ids.

        Raises:
            TypeError, ValueError: ``messages`` is malformed (see
                :func:`~twostroke.engine.text.chat.validate_messages`).
            ChatTemplateKwargsError: ``template_kwargs`` breaks a rule of
                :func:`~twostroke.engine.text.chat_template.check_template_kwargs`.
            ChatTemplateError: the model has no chat template, or the template rejected the
                conversation (for example roles that do not alternate), or a content holds
                special-token text that cannot be kept as text (the template rewrites
                contents, or the tokenizer is not a ``tokenizers`` one).
        """
        return self._render(validate_messages(messages), None, template_kwargs)

    def apply_tool_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation with tools, rendered by the template's own ``tools``
        variable and its tool-call and tool messages, as ``transformers`` renders them.

        Args:
            messages: The conversation as
                :func:`~twostroke.engine.tools.template.template_messages` writes it: each
                ``role`` and ``content``, an assistant's ``tool_calls``, a tool message's
                ``tool_call_id`` and ``name``.
            tools: The tools shown (OpenAI's ``{"type": "function", "function": ...}``), or
                ``None``.
            template_kwargs: More variables for the template (as :meth:`apply_chat_template`).

        A tool result's special-token text is always encoded as text; any other
        message's as :meth:`apply_chat_template` encodes it.

        Raises:
            ChatTemplateError: the model has no chat template, or it refused the
                conversation, or a content's special-token text cannot be kept as text.
            ChatTemplateKwargsError: ``template_kwargs`` breaks a rule.
        """
        conversation = [dict(message) for message in messages]
        return self._render(conversation, None if tools is None else list(tools), template_kwargs)

    def _render(
        self,
        conversation: list[dict[str, Any]],
        tools: list[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        rendered = self._render_text(conversation, tools, template_kwargs)
        special = self._special_text
        if special is None:  # no Rust tokenizer to read special tokens as text with
            found = self._first_special_text(conversation, self._find_special_text)
            if found is not None:
                raise ChatTemplateError(
                    f"the tokenizer from {self._source} cannot encode special-token text as "
                    f"text, and messages[{found[0]}]['content'] holds {found[1]!r}; remove it "
                    "from the message"
                )
        masked = None if special is None else special.mask(conversation, self.special_token_roles)
        if masked is None:  # every ordinary conversation: encoded as it always was
            # The template writes BOS itself, as transformers' apply_chat_template assumes.
            if self._saved is not None:
                return self._saved.encode(rendered, add_special_tokens=False)
            assert self._tokenizer is not None
            return list(self._tokenizer.encode(rendered, add_special_tokens=False))
        assert special is not None
        unmasked, spans = masked.unmask(self._render_text(masked.messages, tools, template_kwargs))
        if unmasked != rendered:
            found = self._first_special_text(conversation, special.find)
            assert found is not None  # the masked conversation had a placeholder
            raise ChatTemplateError(
                f"the chat template of {self._source} rewrites message contents, so the "
                f"special-token text {found[1]!r} in messages[{found[0]}]['content'] cannot be "
                "kept as text; remove it from the message"
            )
        return special.encode(rendered, spans)

    def _first_special_text(
        self, conversation: Sequence[Mapping[str, Any]], find: Callable[[str], str | None]
    ) -> tuple[int, str] | None:
        """The first literal content that holds special-token text: its index, its text."""
        for index, message in enumerate(conversation):
            content = message.get("content")
            if isinstance(content, str) and message.get("role") not in self.special_token_roles:
                text = find(content)
                if text is not None:
                    return index, text
        return None

    def _find_special_text(self, content: str) -> str | None:
        """A special token's text in ``content`` (for a tokenizer without a Rust one)."""
        assert self._tokenizer is not None
        return next((t for t in self._tokenizer.all_special_tokens if t in content), None)

    def _render_text(
        self,
        conversation: list[dict[str, Any]],
        tools: list[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation through the chat template, within the tokenizer's bounds."""
        template = self._chat_template
        if not template:
            raise ChatTemplateError(
                f"the tokenizer from {self._source} has no chat template; "
                "pass the prompt as text or token ids instead of chat messages"
            )
        from jinja2 import TemplateError

        # Both backends render through the bounded environment, the one transformers builds
        # plus the bounds (twostroke.engine.text.chat_template): transformers' own has none.
        if self._saved is not None:
            special_tokens: Mapping[str, str] = self._saved.special_tokens
        else:
            assert self._tokenizer is not None
            special_tokens = self._tokenizer.special_tokens_map
        try:
            return render_chat(
                template, conversation, tools, special_tokens, self._limits, template_kwargs
            )
        except TemplateBoundExceeded as exc:
            raise ChatTemplateError(
                f"the chat template of {self._source} was stopped: {exc}"
            ) from exc
        except TemplateError as exc:
            raise ChatTemplateError(
                f"the chat template of {self._source} rejected the messages: {exc}"
            ) from exc

    def check_chat_template(self) -> None:
        """Render a short conversation, to refuse at load a template that runs past its
        bounds on any conversation (a loop of 10^10 iterations, say).

        A template that refuses the conversation by its own rules (``raise_exception``, a
        syntax error) is let through: requests get its refusal as before.

        Raises:
            ChatTemplateError: the rendering crossed one of the template's bounds.
        """
        if not self._chat_template:
            return
        try:
            self._render([dict(message) for message in _PROBE_CONVERSATION], None)
        except ChatTemplateError as exc:
            if isinstance(exc.__cause__, TemplateBoundExceeded):
                raise

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (Jinja text), if it has one."""
        return self._chat_template

    @property
    def _chat_template(self) -> str | None:
        if self._saved is not None:
            return self._saved.chat_template
        assert self._tokenizer is not None
        template = self._tokenizer.chat_template
        return template if isinstance(template, str) else None

    def __repr__(self) -> str:
        return (
            f"<HFTokenizer {self._source!r} vocab_size={self._vocab_size} "
            f"eos_token_ids={sorted(self._eos_token_ids)}>"
        )


def _check_gguf_magic(path: Path) -> None:
    try:
        with path.open("rb") as file:
            magic = file.read(len(_GGUF_MAGIC))
    except OSError as exc:
        raise TokenizerLoadError(path, f"cannot read the file ({exc})") from exc
    if magic != _GGUF_MAGIC:
        raise TokenizerLoadError(
            path,
            f"a file must be a GGUF file (it starts with {magic!r}, not {_GGUF_MAGIC!r}); "
            "for Hugging Face tokenizer files pass their directory",
        )


def _load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase | SavedTokenizer:
    """The tokenizer embedded in a GGUF file, through the artifact cache.

    transformers builds it from the GGUF vocabulary in seconds (it parses the whole file),
    and its text splitting is then made llama.cpp's (:mod:`twostroke.engine.text.gguf_vocab`):
    a BPE vocabulary's pre-tokenizer for the file's ``tokenizer.ggml.pre`` (transformers
    splits the names it does not know as GPT-2 does), a SentencePiece one's prefix space.
    The first load saves the result
    (``tokenizer.json`` and its configuration) in the artifact cache
    (:mod:`twostroke.engine.artifacts.cache`), recording the file's tokenizer names and
    the conversion's version; the next loads read it with ``tokenizers`` alone
    (:class:`SavedTokenizer`) in a fraction of a second, and one recorded otherwise (an
    older twostroke's conversion) is converted again.
    """
    from twostroke.engine.artifacts.cache import ArtifactCache
    from twostroke.engine.artifacts.records import Provenance

    vocab = _gguf_vocab(path)
    provenance = Provenance(
        what=_CACHED_TOKENIZER,
        source=str(path),
        detail=f"{vocab.describe()}, conversion {_GGUF_CONVERSION}",
    )
    cache = ArtifactCache.from_environment()
    try:
        cached = None if cache is None else cache.entry(path) / _CACHED_TOKENIZER
    except OSError:
        cached = None
    if cache is not None and cached is not None and (cached / "tokenizer.json").is_file():
        try:
            # its files as recorded, and this user's alone: or ValueError
            record = cache.open(cached)
            if record is not None and record.provenance.detail == provenance.detail:
                return SavedTokenizer.read(cached)
            _log.info(
                "twostroke: the cached tokenizer was converted as %r, not %r; converting again",
                None if record is None else record.provenance.detail,
                provenance.detail,
            )
        except ValueError as error:  # a damaged entry: convert again and replace it
            _log.warning("twostroke: ignoring the cached tokenizer (%s); converting again", error)
    _log.info("twostroke: converting the tokenizer of %s (once: it is cached)", path.name)
    tokenizer = _load_transformers_tokenizer(path, str(path.parent), gguf_file=path.name)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # transformers builds every GGUF vocabulary on tokenizers
        raise TokenizerLoadError(
            path,
            f"transformers built a {type(tokenizer).__name__} without a tokenizers backend, "
            f"so the {vocab.describe()} vocabulary cannot be split as llama.cpp splits it",
        )
    vocab.fit(backend)
    if cache is not None and cached is not None:
        if cached.is_dir():
            shutil.rmtree(cached, ignore_errors=True)
        with contextlib.suppress(OSError):  # the file just read vanished: store all the same
            cache.prepare(path)  # records the source, removes stale folders
        cache.store(
            cached, lambda folder: _save_tokenizer(tokenizer, folder), provenance=provenance
        )
    return tokenizer


def _gguf_vocab(path: Path) -> GGUFVocab:
    """The tokenizer names of a GGUF file's metadata, checked (see :class:`GGUFVocab`)."""
    from twostroke.engine.checkpoints.gguf import read_gguf
    from twostroke.engine.text.gguf_vocab import GGUFVocab

    try:
        metadata = read_gguf(path).metadata
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(path, f"cannot read the GGUF file ({exc})") from exc
    try:
        return GGUFVocab.from_metadata(metadata)
    except (TypeError, ValueError) as exc:  # UnknownPreTokenizer among them
        raise TokenizerLoadError(path, str(exc)) from exc


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    tokenizer.save_pretrained(str(folder))


def _load_transformers_tokenizer(
    path: Path, directory: str, gguf_file: str | None = None
) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained`` offline, with any failure named after ``path``.

    For a GGUF file, the class ``AutoTokenizer`` would choose is looked up directly (see
    :func:`_gguf_tokenizer_class`).
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TokenizerLoadError(
            path, "transformers is not installed (pip install 'twostroke[models]')"
        ) from exc
    extra = {} if gguf_file is None else {"gguf_file": gguf_file}
    loader = AutoTokenizer if gguf_file is None else _gguf_tokenizer_class(path)
    try:
        tokenizer = loader.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False, **extra
        )
    except Exception as exc:  # transformers raises anything from OSError to JSONDecodeError
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TokenizerLoadError(path, f"{type(exc).__name__}: {first_line}") from exc
    return tokenizer


def _gguf_tokenizer_class(path: Path) -> Any:
    """The tokenizer class ``AutoTokenizer`` picks for a GGUF file, found without its config.

    ``AutoTokenizer`` builds the model's whole configuration to learn its type, and for an
    architecture transformers reads no GGUF configuration of (``llama`` among them) that
    means ``gguf.GGUFReader`` parsing every vocabulary string into numpy views: 16 s of the
    17 s SmolLM2's tokenizer took (AVX2 EPYC, load average 5), against 1.1 s for the class
    itself. The class comes from the same table ``AutoTokenizer`` reads, by the file's
    ``general.architecture``; a model type without an entry gets ``TokenizersBackend``, as
    ``AutoTokenizer`` gives it. An architecture transformers does not know as a model type,
    or a file our reader rejects, goes through ``AutoTokenizer`` itself.
    """
    from transformers import CONFIG_MAPPING, AutoTokenizer, TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    from twostroke.engine.checkpoints.gguf import read_gguf

    try:
        architecture = read_gguf(path).metadata.get("general.architecture")
    except (OSError, ValueError):
        return AutoTokenizer  # it reports the file's problem in its own words
    if not isinstance(architecture, str) or architecture not in CONFIG_MAPPING:
        return AutoTokenizer
    name = TOKENIZER_MAPPING_NAMES.get(architecture)
    if name is None:
        return TokenizersBackend
    found = tokenizer_class_from_name(name)
    return AutoTokenizer if found is None else found


def _generation_config_eos_ids(path: Path) -> frozenset[int]:
    """The ``eos_token_id`` (an int or a list of ints) of a generation config, if any."""
    if not path.is_file():
        return frozenset()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(path, f"cannot read the generation config ({exc})") from exc
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    if value is None:
        return frozenset()
    ids = [value] if is_int(value) else value
    if not isinstance(ids, list) or not all(is_int(item) and item >= 0 for item in ids):
        raise TokenizerLoadError(
            path, f"eos_token_id must be an int >= 0 or a list of them, got {value!r}"
        )
    return frozenset(ids)
