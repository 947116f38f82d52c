"""Prompts tokenize off the event loop, and text that cannot fit is refused before the
tokenizer runs (issue 48: a 7 MB prompt froze /health for seconds)."""

from __future__ import annotations

import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

from twostroke.engine import Engine, EngineOverloaded, RequestRejected, SamplingParams
from twostroke.engine.engine import TOKENIZER_THREADS
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


class GatedTokenizer(ByteTokenizer):
    """Records the thread each prompt tokenizes on, and holds it until released.

    It tells the loop it has started through ``anyio.from_thread``, which works only in a
    worker thread: tokenizing on the event loop fails at once instead of hanging.
    """

    def __init__(self, expect: int = 1) -> None:
        self.threads: list[int] = []
        self.expect = expect
        self.started = anyio.Event()  # set once ``expect`` prompts are tokenizing
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        anyio.from_thread.run_sync(self._enter, threading.get_ident())
        assert self.release.wait(timeout=30), "never released"  # a guard, not a sleep
        return super().encode(text)

    def _enter(self, thread: int) -> None:  # on the event loop
        self.threads.append(thread)
        if len(self.threads) == self.expect:
            self.started.set()


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.num_encoded = 0

    def encode(self, text: str) -> list[int]:
        self.num_encoded += 1
        return super().encode(text)


def open_engine(tokenizer: ByteTokenizer, **config: Any) -> Any:
    config.setdefault("num_blocks", 64)
    config.setdefault("block_size", 4)
    return Engine.open(runner=ToyRunner(), tokenizer=tokenizer, device="cpu", **config)


async def _generate(engine: Engine, prompt: Any) -> object:
    return await engine.generate(prompt, PARAMS)


async def _stream(engine: Engine, prompt: Any) -> object:
    async with engine.stream(prompt, PARAMS) as handle:
        return [delta async for delta in handle]


async def _tokenize(engine: Engine, prompt: Any) -> object:
    return await engine.tokenize(prompt)


async def _prepare(engine: Engine, prompt: Any) -> object:
    return engine.submit(await engine.prepare(prompt), PARAMS)  # what the server does


CALLS = {"generate": _generate, "stream": _stream, "tokenize": _tokenize, "prepare": _prepare}
PROMPTS = {"text": "hello", "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("prompt", PROMPTS)
async def test_the_loop_keeps_running_while_a_prompt_tokenizes(call: str, prompt: str) -> None:
    tokenizer = GatedTokenizer()
    run: Callable[[Engine, Any], Awaitable[object]] = CALLS[call]
    progress = 0
    async with open_engine(tokenizer) as engine, anyio.create_task_group() as task_group:
        task_group.start_soon(run, engine, PROMPTS[prompt])
        await tokenizer.started.wait()
        for _ in range(100):  # the loop serves this task while the tokenizer holds on
            await anyio.lowlevel.checkpoint()
            progress += 1
        assert engine.statistics().num_open_requests == 0  # not queued before its ids
        tokenizer.release.set()
    assert progress == 100
    assert tokenizer.threads
    assert threading.get_ident() not in tokenizer.threads


async def test_tokenizing_threads_are_limited() -> None:
    tokenizer = GatedTokenizer(expect=TOKENIZER_THREADS)
    async with open_engine(tokenizer) as engine, anyio.create_task_group() as task_group:
        for index in range(TOKENIZER_THREADS + 2):
            task_group.start_soon(engine.tokenize, f"prompt {index}")
        await tokenizer.started.wait()
        await anyio.wait_all_tasks_blocked()  # the others wait for the limiter
        assert len(tokenizer.threads) == TOKENIZER_THREADS
        tokenizer.release.set()
    assert len(tokenizer.threads) == TOKENIZER_THREADS + 2


async def test_a_generate_cancelled_while_its_prompt_tokenizes_leaves_nothing_queued() -> None:
    tokenizer = GatedTokenizer()
    async with open_engine(tokenizer) as engine:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(engine.generate, "cancelled", PARAMS)
            await tokenizer.started.wait()
            task_group.cancel_scope.cancel()
            tokenizer.release.set()  # the thread finishes; its ids are dropped
        await engine.wait_idle()
        after = engine.statistics()
        assert (after.num_open_requests, after.num_waiting) == (0, 0)
        engine.check_invariants()
        assert len(tokenizer.threads) == 1
        tokenizer.expect = 0  # the next one runs through
        output = await engine.generate([104, 105], PARAMS)
        assert output.request_id == 0  # the cancelled one never took an id


TEXT_TOO_LONG = (
    "prompt must have at most max_model_len x the longest token's characters = 64 x 1 = 64 "
    "characters, got 65"
)
TOO_MANY_MESSAGES = "messages must number at most max_model_len = 64, got 65"
CONTENT_TOO_LONG = (
    "messages must have at most max_model_len x the longest token's characters = 64 x 1 = "
    "64 characters of content in all, got 65"
)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("x" * 65, TEXT_TOO_LONG),
        ([{"role": "user", "content": ""}] * 65, TOO_MANY_MESSAGES),
        ([{"role": "user", "content": "x" * 33}, {"role": "user", "content": "y" * 32}],
         CONTENT_TOO_LONG),
    ],
)  # fmt: skip
async def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(
    prompt: Any, message: str
) -> None:
    tokenizer = CountingTokenizer()
    async with open_engine(tokenizer, max_model_len=64) as engine:
        before = engine.statistics()
        match = f"^{re.escape(message)}$"
        with pytest.raises(RequestRejected, match=match):
            engine.submit(prompt, PARAMS)
        with pytest.raises(RequestRejected, match=match):
            await engine.generate(prompt, PARAMS)
        with pytest.raises(RequestRejected, match=match):
            await engine.tokenize(prompt)
        assert tokenizer.num_encoded == 0
        assert engine.statistics() == before


async def test_a_prompt_at_the_bound_is_tokenized() -> None:
    async with open_engine(ByteTokenizer(), max_model_len=64) as engine:
        assert len(await engine.tokenize("x" * 64)) == 64
        messages = [{"role": "user", "content": ""}] * 64
        assert await engine.tokenize(messages)


async def test_prepare_refuses_a_full_waiting_queue_before_tokenizing() -> None:
    tokenizer = CountingTokenizer()
    async with open_engine(tokenizer, max_num_seqs=1, max_waiting_requests=1) as engine:
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        running = engine.submit([1, 2, 3], long)  # the one sequence a step may hold
        while engine.statistics().num_waiting:  # until it is admitted (no clock involved)
            await anyio.lowlevel.checkpoint()
        engine.submit([1, 2, 3], long)  # waiting: the queue is full
        with pytest.raises(EngineOverloaded, match="the waiting queue is full"):
            await engine.prepare("hello")
        assert tokenizer.num_encoded == 0
        running.cancel()
