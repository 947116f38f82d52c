"""Incremental detokenization and stop strings, against decoding everything at once.

Two tokenizers are defined here: one where every id is a UTF-8 byte (as the engine's toy
tokenizer), and a small byte-level BPE trained with ``tokenizers``, whose tokens may end in
the middle of a character or span two. The property test tokenizes random texts at random
(any split of the bytes into vocabulary tokens), pushes the ids in random groups, and checks
every delta against a reference written from the definition.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from twostroke.engine.text.detokenizer import (
    MAX_UNRESOLVED_PUSHES,
    PROMPT_CONTEXT_TOKENS,
    DetokenizedDelta,
    DetokenizerError,
    IncrementalDetokenizer,
)
from twostroke.engine.text.tokenizer import Tokenizer
from twostroke.states.params import SamplingParams
from twostroke.states.request import Request

REPLACEMENT = "\ufffd"
BYTES_EOS = 256


class BytesTokenizer:
    """Ids 0..255 are the bytes of the UTF-8 text; 256 is EOS (special, no text)."""

    eos_token_ids = frozenset({BYTES_EOS})
    vocab_size = 257
    max_token_chars = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(i for i in token_ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: object) -> list[int]:
        raise NotImplementedError

    def token_bytes(self) -> dict[bytes, int]:
        return {bytes([i]): i for i in range(256)}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to the printable characters byte-level BPE spells them with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "日本語のテキストを書きます。本当に日本語です。",
    "emoji 😀😀 👍🏽 and café, naïve, Ωmega",
    "stop here STOP and ab ab abab baba",
]


class BPETokenizer:
    """A byte-level BPE trained on :data:`CORPUS`; ``<s>`` (0) and ``</s>`` (1) are special."""

    def __init__(self) -> None:
        raw = RawTokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        raw.train_from_iterator(CORPUS * 4, trainer=trainer)
        self._raw = raw
        self.eos_token_ids = frozenset({1})
        self.vocab_size = raw.get_vocab_size()
        self.max_token_chars = max(map(len, raw.get_vocab()))

    def encode(self, text: str) -> list[int]:
        return list(self._raw.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self._raw.decode(list(token_ids), skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    def apply_chat_template(self, messages: object) -> list[int]:
        raise NotImplementedError

    def token_bytes(self) -> dict[bytes, int]:
        char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        return {
            bytes(char_to_byte[c] for c in token): token_id
            for token, token_id in self._raw.get_vocab().items()
            if token not in ("<s>", "</s>")
        }


BYTES = BytesTokenizer()
BPE = BPETokenizer()
TOKENIZERS: dict[str, BytesTokenizer | BPETokenizer] = {"bytes": BYTES, "bpe": BPE}
TOKEN_BYTES = {name: tokenizer.token_bytes() for name, tokenizer in TOKENIZERS.items()}


def test_test_tokenizers_implement_the_protocol() -> None:
    assert isinstance(BYTES, Tokenizer)
    assert isinstance(BPE, Tokenizer)
    # The BPE must have tokens that end inside a character, or the tests prove little.
    assert any(
        token.decode("utf-8", errors="replace").endswith(REPLACEMENT) and len(token) > 1
        for token in TOKEN_BYTES["bpe"]
    )


# --- reference, written from the definition ------------------------------------------------


def reference_cut(text: str, stop: Sequence[str], include: bool) -> tuple[str, str | None]:
    """``text`` cut at the stop string that ends first (the longer one on a tie)."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stop if text[:end].endswith(s)]
        if matches:
            stop_string = max(matches, key=len)
            return (text[:end] if include else text[: end - len(stop_string)]), stop_string
    return text, None


def partial_stop_suffix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max(
        (n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])),
        default=0,
    )


def visible(text: str, stop: Sequence[str], include: bool) -> str:
    """What may be shown of ``text`` so far: cut at a stop, or minus a partial stop."""
    cut, stop_string = reference_cut(text, stop, include)
    if stop_string is not None:
        return cut
    return text[: len(text) - partial_stop_suffix(text, stop)]


# --- property -------------------------------------------------------------------------------

ALPHABET = st.one_of(
    st.sampled_from(list("ab \n.日本語😀👍🏽é")),
    st.characters(codec="utf-8", exclude_characters=REPLACEMENT),
)
STOP = st.lists(
    st.text(alphabet=st.sampled_from(list("ab .日😀")), min_size=1, max_size=4), max_size=3
)


def text_around(data: st.DataObject, stop: Sequence[str], label: str) -> str:
    """Random text with stop strings and their beginnings mixed in, so that matches happen."""
    pieces = [st.text(alphabet=ALPHABET, max_size=6)]
    if stop:
        pieces.append(st.sampled_from(stop))
        pieces.append(st.sampled_from(stop).flatmap(lambda s: st.just(s[: len(s) // 2 + 1])))
    chunks = data.draw(st.lists(st.one_of(pieces), max_size=6), label=label)
    return "".join(chunks)


def random_tokenization(data: st.DataObject, name: str, text: str) -> list[int]:
    """Any split of ``text``'s bytes into tokens of the vocabulary, drawn at random."""
    vocab = TOKEN_BYTES[name]
    longest = max(map(len, vocab))
    raw, ids, at = text.encode(), [], 0
    while at < len(raw):
        options = [
            raw[at : at + n]
            for n in range(1, min(longest, len(raw) - at) + 1)
            if raw[at : at + n] in vocab
        ]
        piece = data.draw(st.sampled_from(options), label="token")
        ids.append(vocab[piece])
        at += len(piece)
    return ids


def random_groups(data: st.DataObject, ids: list[int]) -> list[list[int]]:
    groups, at = [], 0
    while at < len(ids):
        size = data.draw(st.integers(1, 4), label="group size")
        groups.append(ids[at : at + size])
        at += size
    return groups


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@given(
    data=st.data(),
    stop=STOP,
    include=st.booleans(),
    eos=st.booleans(),
    engines=st.booleans(),
)
def test_deltas_add_up_to_the_decoded_output_cut_at_the_first_stop(
    name: str,
    data: st.DataObject,
    stop: list[str],
    include: bool,
    eos: bool,
    engines: bool,
) -> None:
    tokenizer = TOKENIZERS[name]
    prompt_ids = random_tokenization(data, name, text_around(data, stop, "prompt"))
    output_ids = random_tokenization(data, name, text_around(data, stop, "output"))
    if eos:
        output_ids.append(min(tokenizer.eos_token_ids))
    if engines:  # the engine's: from a request whose ids and parameters are checked already
        params = SamplingParams(stop=stop, include_stop_str_in_output=include)
        request = Request(0, prompt_ids, params, arrival_time=0.0)
        detokenizer = IncrementalDetokenizer.for_request(tokenizer, request)
    else:
        detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, stop=stop, include_stop_str_in_output=include
        )
    expected, expected_stop = reference_cut(tokenizer.decode(output_ids), stop, include)

    shown, pushed, clean = "", 0, 0
    for group in random_groups(data, output_ids):
        was_stopped = detokenizer.stopped
        delta = detokenizer.push(group)
        pushed += len(group)
        shown += delta.text
        if was_stopped:
            assert delta == DetokenizedDelta("", stopped=True, stop_string=expected_stop)
            continue
        # Text is shown at the last push whose tokens end on a whole character.
        if not tokenizer.decode(output_ids[:pushed]).endswith(REPLACEMENT):
            clean = pushed
        decoded = tokenizer.decode(output_ids[:clean])
        assert shown == visible(decoded, stop, include)
        if not delta.stopped:
            # Nothing shown begins text that could still grow into a stop string.
            assert not any(
                s.startswith(decoded[start:]) for s in stop for start in range(len(shown))
            )
        assert delta.stopped == (delta.stop_string is not None)
        assert detokenizer.text == shown

    shown += detokenizer.flush()
    assert shown == expected
    assert detokenizer.text == expected
    assert detokenizer.stop_string == expected_stop
    assert detokenizer.stopped == (expected_stop is not None)


# --- examples -------------------------------------------------------------------------------


def push_each(detokenizer: IncrementalDetokenizer, ids: Sequence[int]) -> list[DetokenizedDelta]:
    return [detokenizer.push([token_id]) for token_id in ids]


@pytest.mark.parametrize("character", ["😀", "日", "é", "👍🏽"])
def test_a_character_split_across_byte_tokens_appears_when_complete(character: str) -> None:
    detokenizer = IncrementalDetokenizer(BYTES, BYTES.encode("> "))
    raw = character.encode()
    texts = [delta.text for delta in push_each(detokenizer, [*raw, *b"!"])]
    # Nothing until the last byte of each code point, then the whole code point.
    expected = []
    for code_point in character:
        encoded = code_point.encode()
        expected += [""] * (len(encoded) - 1) + [code_point]
    assert texts == [*expected, "!"]


def test_bpe_tokens_that_span_characters_are_shown_whole() -> None:
    text = "日本語のテキスト"
    ids = BPE.encode(text)
    token_texts = [BPE.decode([token_id]) for token_id in ids]
    assert any(REPLACEMENT in piece for piece in token_texts)  # some token splits a character
    detokenizer = IncrementalDetokenizer(BPE, [])
    texts = [delta.text for delta in push_each(detokenizer, ids)]
    assert "".join(texts) == text
    assert all(REPLACEMENT not in piece for piece in texts)


def test_a_stop_string_across_token_boundaries_is_found() -> None:
    detokenizer = IncrementalDetokenizer(BYTES, [], stop=["lo wo"])
    deltas = [detokenizer.push(BYTES.encode(piece)) for piece in ["Hel", "l", "o w", "orld"]]
    assert deltas == [
        DetokenizedDelta("He"),  # "l" could begin "lo wo"
        DetokenizedDelta("l"),  # the first "l" cannot any more, the second still can
        DetokenizedDelta(""),  # "lo w" still could
        DetokenizedDelta("", stopped=True, stop_string="lo wo"),
    ]
    assert detokenizer.text == "Hel"
    assert detokenizer.push(BYTES.encode("!")) == DetokenizedDelta("", True, "lo wo")
    assert detokenizer.flush() == ""
    assert detokenizer.text == "Hel"


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    detokenizer = IncrementalDetokenizer(
        BYTES, [], stop=["</answer>"], include_stop_str_in_output=True
    )
    first = detokenizer.push(BYTES.encode("42</ans"))
    second = detokenizer.push(BYTES.encode("wer> and more"))
    assert first == DetokenizedDelta("42")
    assert second == DetokenizedDelta("</answer>", stopped=True, stop_string="</answer>")
    assert detokenizer.text == "42</answer>"


def test_held_text_is_released_once_it_cannot_become_a_stop_string() -> None:
    detokenizer = IncrementalDetokenizer(BYTES, [], stop=["abc", "xyz"])
    assert detokenizer.push(BYTES.encode("zab")) == DetokenizedDelta("z")
    assert detokenizer.push(BYTES.encode("d")) == DetokenizedDelta("abd")
    assert detokenizer.push(BYTES.encode("x")) == DetokenizedDelta("")
    assert detokenizer.flush() == "x"
    assert detokenizer.text == "zabdx"
    assert not detokenizer.stopped


def test_the_stop_string_that_ends_first_wins_and_the_longer_on_a_tie() -> None:
    first_end = IncrementalDetokenizer(BYTES, [], stop=["bcde", "cd"])
    assert first_end.push(BYTES.encode("abcdef")) == DetokenizedDelta("ab", True, "cd")
    tie = IncrementalDetokenizer(BYTES, [], stop=["cd", "bcd"])
    assert tie.push(BYTES.encode("abcdef")) == DetokenizedDelta("a", True, "bcd")


def test_a_match_that_begins_inside_a_failed_one_is_found() -> None:
    # "aab" fails at the third "a", whose last two characters begin it again; "abab" fails
    # at "abaa", where "a" still begins it; the shorter "ba" ends inside the longer "abab".
    detokenizer = IncrementalDetokenizer(BYTES, [], stop=["aab"])
    assert detokenizer.push(BYTES.encode("aaa")) == DetokenizedDelta("a")
    assert detokenizer.push(BYTES.encode("ab!")) == DetokenizedDelta("a", True, "aab")
    held = IncrementalDetokenizer(BYTES, [], stop=["abab", "bax"])
    assert held.push(BYTES.encode("abaa")) == DetokenizedDelta("aba")
    assert held.push(BYTES.encode("bax")) == DetokenizedDelta("a", True, "bax")
    inner = IncrementalDetokenizer(BYTES, [], stop=["abab", "ba"])
    assert inner.push(BYTES.encode("xabab")) == DetokenizedDelta("xa", True, "ba")


def test_a_long_stop_string_costs_memory_linear_in_its_length() -> None:
    # Issue 20: every prefix of every stop string was stored, O(length²): one stop string of
    # 20,000 characters cost 194 MiB per request (four choices took a server from 425 to
    # 1,199 MiB). SamplingParams caps the length; the detokenizer must not need the cap.
    stop = "ab" * 9_999 + "!"
    tracemalloc.start()
    try:
        detokenizer = IncrementalDetokenizer(BYTES, [], stop=[stop])
        delta = detokenizer.push(BYTES.encode("ab" * 9_999))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert delta == DetokenizedDelta("")  # all of it could still be the stop string
    assert peak < 400 * len(stop)  # bytes: a few hundred a character, never 10,000
    assert detokenizer.push(BYTES.encode("!")) == DetokenizedDelta("", True, stop)


def test_a_stop_string_in_the_prompt_does_not_stop_the_output() -> None:
    detokenizer = IncrementalDetokenizer(BYTES, BYTES.encode("say STOP"), stop=["STOP"])
    assert detokenizer.push(BYTES.encode(" ok")) == DetokenizedDelta(" ok")


def test_eos_contributes_no_text() -> None:
    detokenizer = IncrementalDetokenizer(BPE, BPE.encode("Hi"))
    ids = [*BPE.encode(" the fox"), 1]
    assert "".join(delta.text for delta in push_each(detokenizer, ids)) == " the fox"
    assert detokenizer.flush() == ""


def test_flush_drops_an_unfinished_character_like_vllm() -> None:
    detokenizer = IncrementalDetokenizer(BYTES, [])
    assert detokenizer.push([*b"ok", *"😀".encode()[:2]]) == DetokenizedDelta("")
    assert detokenizer.flush() == ""
    assert detokenizer.text == ""
    assert detokenizer.flush() == ""

    detokenizer = IncrementalDetokenizer(BYTES, [])
    push_each(detokenizer, [*b"ok", *"😀".encode()[:2]])
    assert detokenizer.text == "ok"
    assert detokenizer.flush() == ""
    assert detokenizer.text == "ok"


def test_push_after_flush_is_an_error() -> None:
    detokenizer = IncrementalDetokenizer(BYTES, [], stop=["x"])
    detokenizer.flush()
    with pytest.raises(DetokenizerError, match=r"cannot push tokens after flush\(\)"):
        detokenizer.push([65])


def test_decoding_in_context_keeps_a_space_that_depends_on_the_previous_token() -> None:
    """A decoder that is not byte-wise (words joined with spaces) needs the prefix window."""

    class WordTokenizer(BytesTokenizer):
        words = ("hello", "big", "world")

        def decode(self, token_ids: Sequence[int]) -> str:
            return " ".join(self.words[i] for i in token_ids)

    detokenizer = IncrementalDetokenizer(WordTokenizer(), [0])
    assert [delta.text for delta in push_each(detokenizer, [1, 2])] == [" big", " world"]


class CountingTokenizer(BytesTokenizer):
    """Records how many ids each ``decode`` call was given."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def decode(self, token_ids: Sequence[int]) -> str:
        self.lengths.append(len(token_ids))
        return super().decode(token_ids)


def test_work_per_token_is_constant() -> None:
    tokenizer = CountingTokenizer()
    text = "日本語 and 😀 " * 300
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(text), stop=["never!"])
    push_each(detokenizer, tokenizer.encode(text))
    assert detokenizer.flush() == ""
    assert detokenizer.text == text
    # One decode of the context and one of the window per push; a window holds the previous
    # resolved tokens and at most the 4 bytes of one character.
    assert len(tokenizer.lengths) == 2 * len(text.encode())
    assert max(tokenizer.lengths) <= 2 * 4


def test_invalid_bytes_cannot_grow_the_window_without_bound() -> None:
    tokenizer = CountingTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    continuation_byte = 0x80  # invalid on its own: every push ends in U+FFFD
    deltas = push_each(detokenizer, [continuation_byte] * 10 * MAX_UNRESOLVED_PUSHES)
    assert max(tokenizer.lengths) <= 2 * MAX_UNRESOLVED_PUSHES + PROMPT_CONTEXT_TOKENS
    shown = [delta.text for delta in deltas if delta.text]
    assert shown
    assert set("".join(shown)) == {REPLACEMENT}
    assert next(i for i, delta in enumerate(deltas) if delta.text) == MAX_UNRESOLVED_PUSHES - 1
    # Valid text afterwards is shown normally again.
    assert detokenizer.push(BYTES.encode("ok")).text.endswith("ok")


def test_repr_shows_state() -> None:
    detokenizer = IncrementalDetokenizer(BYTES, [], stop=["abc"])
    detokenizer.push([*b"xa", 0xE6])
    assert repr(detokenizer) == (
        "<IncrementalDetokenizer 0 chars shown, 3 unread tokens, 0 chars held>"
    )
    detokenizer.push([0x97, 0xA5])
    assert repr(detokenizer) == (
        "<IncrementalDetokenizer 3 chars shown, 0 unread tokens, 0 chars held>"
    )
    detokenizer.push(b"ab")
    assert repr(detokenizer) == (
        "<IncrementalDetokenizer 3 chars shown, 0 unread tokens, 2 chars held>"
    )
    detokenizer.push(b"c")
    assert repr(detokenizer) == "<IncrementalDetokenizer 3 chars shown, stopped at 'abc'>"


class ReadCountingIds(Sequence[int]):
    """Token ids that count how many of them are read."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.num_read = ids, 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: Any) -> Any:
        items = self.ids[index]
        self.num_read += len(items) if isinstance(items, list) else 1
        return items


def test_only_the_prompts_last_tokens_are_read() -> None:
    prompt = ReadCountingIds(BYTES.encode("a long prompt " * 1000))
    detokenizer = IncrementalDetokenizer(BYTES, prompt, stop=["!"])
    assert prompt.num_read == PROMPT_CONTEXT_TOKENS  # submit costs the same for any prompt
    assert detokenizer.push(BYTES.encode("ok")) == DetokenizedDelta("ok")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"stop": "abc"}, TypeError, "stop must be a sequence of strings, got str 'abc'"),
        ({"stop": ["a", 1]}, TypeError, "stop must contain only strings, got int 1"),
        ({"stop": ["a", ""]}, ValueError, "stop strings must be non-empty, got ''"),
        (
            {"prompt_token_ids": "abc"},
            TypeError,
            "prompt_token_ids must be a sequence of ints, got str",
        ),
        (
            {"prompt_token_ids": [1, 2.0]},
            TypeError,
            "prompt_token_ids must contain only ints, got float 2.0",
        ),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, object], error: type, message: str) -> None:
    arguments: dict[str, object] = {"prompt_token_ids": [], **kwargs}
    with pytest.raises(error) as caught:
        IncrementalDetokenizer(BYTES, **arguments)  # type: ignore[arg-type]
    assert str(caught.value) == message
