"""Chat messages: one validator, the same error from the toy and the real tokenizer."""

from __future__ import annotations

import types
from typing import Any

import pytest

from twostroke.engine.runners.toy import ByteTokenizer
from twostroke.engine.text.chat import validate_messages

from ..conftest import toy_engine

#: (messages, error, message): every tokenizer must refuse these exactly so.
MALFORMED: list[tuple[Any, type[Exception], str]] = [
    (
        "hello",
        TypeError,
        "messages must be a sequence of {'role': str, 'content': str} mappings, got str",
    ),
    ([], ValueError, "messages must contain at least one message, got an empty sequence"),
    (
        [{"role": "user", "content": "a"}, ("user", "b")],
        TypeError,
        "messages[1] must be a mapping with 'role' and 'content', got tuple",
    ),
    (
        [{"role": "user"}],
        ValueError,
        "messages[0] must have keys 'role' and 'content', missing 'content'",
    ),
    (
        [{"role": "user", "content": "a"}, {"content": "b"}],
        ValueError,
        "messages[1] must have keys 'role' and 'content', missing 'role'",
    ),
    (
        [{"content": "x", "role": "user", "name": "bob"}],
        ValueError,
        "messages[0] may have only keys 'role' and 'content', got also 'name'",
    ),
    (  # both wrong: the missing key is named first
        [{"role": "user", "name": "bob"}],
        ValueError,
        "messages[0] must have keys 'role' and 'content', missing 'content'",
    ),
    (  # a mapping other than a dict is checked as closely
        [types.MappingProxyType({"role": "user", "content": "a", "name": "bob"})],
        ValueError,
        "messages[0] may have only keys 'role' and 'content', got also 'name'",
    ),
    (
        [{"role": "user", "content": 5}],
        TypeError,
        "messages[0]['content'] must be a str, got int 5",
    ),
    (
        [{"role": "user", "content": None}],
        TypeError,
        "messages[0]['content'] must be a str, got NoneType None",
    ),
    (
        [{"role": "user", "content": ["hi"]}],
        TypeError,
        "messages[0]['content'] must be a str, got list ['hi']",
    ),
    ([{"role": 7, "content": "x"}], TypeError, "messages[0]['role'] must be a str, got int 7"),
    ([{"role": "", "content": "x"}], ValueError, "messages[0]['role'] must be non-empty, got ''"),
]


@pytest.mark.parametrize(("messages", "error", "message"), MALFORMED)
def test_the_toy_tokenizer_refuses_malformed_messages(
    messages: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        ByteTokenizer().apply_chat_template(messages)
    assert str(caught.value) == message
    with pytest.raises(error) as caught:
        validate_messages(messages)
    assert str(caught.value) == message


def test_a_long_bad_content_is_shown_short() -> None:
    with pytest.raises(TypeError) as caught:
        validate_messages([{"role": "user", "content": b"x" * 1000}])
    assert len(str(caught.value)) < 100


def test_validate_messages_returns_plain_dicts() -> None:
    class Message(dict[str, str]):
        pass

    proxy = types.MappingProxyType({"content": "there", "role": "assistant"})
    checked = validate_messages((Message(role="user", content="hi"), proxy))
    assert checked == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "there"},
    ]
    assert type(checked) is list
    assert [type(message) for message in checked] == [dict, dict]


def test_the_toy_template() -> None:
    ids = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert bytes(ids) == b"<user>hi\n<assistant>"


@pytest.mark.anyio
@pytest.mark.parametrize(("messages", "error", "message"), MALFORMED[3:])
async def test_the_engine_queues_nothing_for_malformed_messages(
    messages: Any, error: type[Exception], message: str
) -> None:
    async with toy_engine() as engine:
        with pytest.raises(error) as caught:
            engine.submit(messages)
        assert str(caught.value) == message
        stats = engine.statistics()
        assert (stats.num_open_requests, stats.num_waiting, stats.num_steps) == (0, 0, 0)
