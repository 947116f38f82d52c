"""Through the server: a chat template that runs past its bounds on one request is a 400
for that request alone, a prompt that cannot fit is refused before tokenizing, and what is
tokenized (prompts, chat templates, conversations with tools) is tokenized off the event
loop, on every endpoint."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from tests.engine.server.conftest import served
from tests.engine.server.test_tools import NATIVE, TOOLS, TemplateByteTokenizer
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


class _Recorded(TemplateByteTokenizer):
    """The toy's bytes, with a template that reads ``tools``, recording the thread of every
    ``encode`` (every prompt, every chat template's and tool template's output, goes through
    it); text holding ``HOLD`` is held there until :attr:`release` is set."""

    def __init__(self) -> None:
        super().__init__(NATIVE[0][0])  # Qwen's: the server renders tools through it
        self.threads: list[int] = []
        self.holding = threading.Event()
        self.release = threading.Event()
        self.released = False

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        if "HOLD" in text:
            self.holding.set()
            # Bounded, so a server that tokenizes on its loop fails the test instead of
            # hanging it: there nothing can set the event before this returns.
            self.released = self.release.wait(timeout=10)
        return super().encode(text)


_ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
_RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
_ENDPOINTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 2, "n": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": _ASK, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": _ASK, "max_tokens": 2, "tools": TOOLS}),
    ("/v1/chat/completions", {"messages": _ASK, "tools": TOOLS, "stream": True}),
    ("/v1/responses", {"input": "hello there", "max_output_tokens": 2}),
    ("/v1/responses", {"input": "hello", "max_output_tokens": 2, "tools": _RESPONSE_TOOLS}),
    ("/tokenize", {"prompt": "hello there"}),
    ("/tokenize", {"messages": _ASK}),
]


@pytest.mark.parametrize(("path", "body"), _ENDPOINTS)
async def test_every_endpoint_renders_and_tokenizes_off_the_event_loop(
    path: str, body: dict[str, Any]
) -> None:
    """Prompts, chat templates and the templates' tools are tokenized in worker threads:
    the event loop's thread never runs the tokenizer."""
    tokenizer = _Recorded()
    async with served(runner=ToyRunner(), tokenizer=tokenizer) as server:
        tokenizer.threads.clear()  # the engine's own, at its start
        answer = await server.http.post(path, json={"model": "toy"} | body)
        assert answer.status_code == 200, answer.text
        assert tokenizer.threads, "nothing was tokenized"
        assert threading.get_ident() not in tokenizer.threads


@pytest.mark.parametrize("tools", [False, True])
async def test_health_is_answered_while_a_prompt_tokenizes(tools: bool) -> None:
    """The loop serves ``/health`` while a prompt is held in the tokenizer (before, the
    completion endpoints tokenized on the loop: a 7 MB chat message froze it for 5-6 s)."""
    tokenizer = _Recorded()
    body: dict[str, Any] = {"model": "toy", "max_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "HOLD"}]}
    if tools:
        body["tools"] = TOOLS
    async with served(runner=ToyRunner(), tokenizer=tokenizer) as server:
        answers: list[Any] = []

        async def ask() -> None:
            answers.append(await server.http.post("/v1/chat/completions", json=body))

        async with anyio.create_task_group() as group:
            group.start_soon(ask)
            await anyio.to_thread.run_sync(tokenizer.holding.wait)
            assert (await server.http.get("/health")).status_code == 200
            assert server.engine.submitted == []  # still tokenizing: nothing queued yet
            tokenizer.release.set()
        assert tokenizer.released
        assert answers[0].status_code == 200, answers[0].text
