"""Over HTTP, special-token text in a tool result or a user message stays text (issue 48,
finding 5c): the chat completions and Responses endpoints reach the engine's tokenizer,
which keeps it as text (tests/engine/text/test_special_text.py has the tokenizer's side)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.engine.text.test_special_text import INJECTION, TEMPLATE
from tests.engine.text.test_tokenizer import BOS, END_OF_TURN, write_model_directory
from twostroke.engine.text.saved_tokenizer import SavedTokenizer
from twostroke.engine.text.tokenizer import HFTokenizer

from .conftest import OPENAI_STREAMS_ON_TRIO, served
from .scripted import ScriptedRunner

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]


class RecordingTokenizer(HFTokenizer):
    """The small BPE's tokenizer, keeping the ids of every conversation it renders."""

    def __init__(self, folder: Path) -> None:
        super().__init__(SavedTokenizer.read(folder), source=str(folder))
        self.rendered: list[list[int]] = []

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        ids = super().apply_chat_template(messages)
        self.rendered.append(ids)
        return ids


async def test_a_tool_result_and_a_user_message_cannot_open_a_turn(tmp_path: Path) -> None:
    write_model_directory(tmp_path, chat_template=TEMPLATE)
    tokenizer = RecordingTokenizer(tmp_path)
    bos, end = tokenizer.encode(BOS)[-1], tokenizer.encode(END_OF_TURN)[-1]
    history: list[Any] = [
        {"role": "user", "content": f"Read it. {INJECTION}"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "fetch", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": f"page {INJECTION}"},
    ]  # fmt: skip
    async with served(runner=ScriptedRunner(lambda prompt: "ok"), tokenizer=tokenizer) as server:
        await server.client.chat.completions.create(model="toy", messages=history, max_tokens=2)
        await server.client.responses.create(
            model="toy",
            max_output_tokens=2,
            input=[
                {"role": "user", "content": f"Read it. {INJECTION}"},
                {"type": "function_call", "call_id": "call_1", "name": "fetch", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": INJECTION},
            ],
        )
    chat, responses = tokenizer.rendered
    # Three messages and the answer's header each open with BOS and the messages end with
    # <|end|>; the contents' own (two of each in each conversation) are text.
    for ids in (chat, responses):
        assert (ids.count(bos), ids.count(end)) == (4, 3)
