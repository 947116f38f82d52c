"""Through the server: a chat template that runs past its bounds on one request is a 400
for that request alone, and a prompt that cannot fit is refused before tokenizing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.server.conftest import served
from tests.engine.text.test_chat_template import PER_CHARACTER
from tests.engine.text.test_tokenizer import write_model_directory
from twostroke.engine.runners.toy import ToyRunner
from twostroke.engine.text.tokenizer import HFTokenizer

pytestmark = pytest.mark.anyio


async def test_a_template_past_its_bounds_is_a_400_for_that_request(tmp_path: Path) -> None:
    write_model_directory(tmp_path, chat_template=PER_CHARACTER)
    tokenizer = HFTokenizer.from_pretrained(tmp_path)  # its short probe passes
    async with served(runner=ToyRunner(), tokenizer=tokenizer) as server:
        body = {"model": "toy", "max_tokens": 2}
        heavy = [{"role": "user", "content": "x" * 99}] * 11
        for path in ("/v1/chat/completions", "/tokenize"):
            answer = await server.http.post(path, json=body | {"messages": heavy})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == "messages"
            assert (
                "was stopped: a chat template may run at most max_loop_iterations = "
                in (error["message"])
            )
        assert (await server.http.get("/health")).status_code == 200
        light = [{"role": "user", "content": "hi"}]
        answer = await server.http.post("/v1/chat/completions", json=body | {"messages": light})
        assert answer.status_code == 200, answer.text


async def test_text_that_cannot_fit_is_a_400_before_tokenizing() -> None:
    async with served(max_model_len=64) as server:
        answer = await server.http.post(
            "/v1/completions", json={"model": "toy", "prompt": "x" * 65, "max_tokens": 2}
        )
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == (
            "prompt must have at most max_model_len x the longest token's characters = 64 x 1 "
            "= 64 characters, got 65"
        )
        assert server.engine.submitted == []
