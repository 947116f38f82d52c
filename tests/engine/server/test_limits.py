"""Caps on the work one request may ask for, checked from its body before anything is tokenized.

Issue 20: 400 one-token prompts with ``n=128`` (a 1.7 KB body) made 51,200 engine requests; a
20,000-character stop string with ``n=4`` cost 774 MiB; JSON nested 100,000 levels deep and a
non-ASCII ``Authorization`` were 500s with a traceback; nothing bounded the waiting queue.
Each answer here is a 4xx naming the field (or a 503 with ``Retry-After``), with nothing
tokenized, nothing queued and nothing logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import httpx
import pytest

from twostroke.engine import Engine, SamplingParams
from twostroke.engine.cli import build_parser
from twostroke.engine.config import ServerConfig
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.engine.server import serve
from twostroke.engine.server.app import build_app
from twostroke.states.plan import StepPlan

from .conftest import API_KEY, ObservedEngine, http_client

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]


class CountingEngine(ObservedEngine):
    """The observed engine, counting the prompts the server has it tokenize."""

    num_tokenized = 0

    async def tokenize(self, prompt: Any) -> list[int]:
        self.num_tokenized += 1
        return await super().tokenize(prompt)


class GatedRunner(ToyRunner):
    """The toy runner, whose steps wait for ``gate`` (on the device's thread, bounded).

    ``entered`` is set once a step has started: its requests were admitted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def execute(self, plan: StepPlan) -> Any:
        self.entered.set()
        self.gate.wait(timeout=30)
        return super().execute(plan)


@asynccontextmanager
async def limited(
    *, runner: ToyRunner | None = None, api_key: str = API_KEY, config: ServerConfig | None = None
) -> AsyncIterator[tuple[CountingEngine, httpx.AsyncClient]]:
    """A toy engine served on 127.0.0.1 with the server's limits given, and a client for it."""
    async with Engine.open(
        runner=runner or ToyRunner(), tokenizer=ByteTokenizer(), device="cpu", model_name="toy",
        num_blocks=64, block_size=4, max_num_seqs=1,
    ) as real:  # fmt: skip
        engine = CountingEngine(real)
        async with anyio.create_task_group() as task_group:
            port = await task_group.start(
                partial(serve, engine, port=0, api_key=api_key, config=config)
            )
            async with http_client(
                f"http://127.0.0.1:{port}",
                headers={"authorization": f"Bearer {api_key}".encode()},
                timeout=20,
            ) as http:
                try:
                    yield engine, http
                finally:
                    if isinstance(runner, GatedRunner):
                        runner.gate.set()  # a failed test must not hold the steps up
            task_group.cancel_scope.cancel()


def error_of(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error: dict[str, Any] = reply.json()["error"]
    return error


async def test_prompts_times_n_is_capped_before_tokenizing() -> None:
    async with limited() as (engine, http):
        # The body of issue 20: 1.7 KB asking for 51,200 engine requests.
        body = {"model": "toy", "prompt": [[1]] * 400, "n": 128, "max_tokens": 1}
        error = error_of(await http.post("/v1/completions", json=body), 400)
        assert error == {
            "message": "the choices of a request (prompts x n) must be <= 128, got 400 prompts "
            "x n=128 = 51200",
            "type": "invalid_request_error",
            "param": "n",
            "code": "too_many_choices",
        }
        many = {"model": "toy", "prompt": ["a"] * 129, "max_tokens": 1}
        error = error_of(await http.post("/v1/completions", json=many), 400)
        assert error["param"] == "prompt"
        assert error["message"].endswith("got 129 prompts x n=1 = 129")
        assert (engine.num_tokenized, engine.submitted) == (0, [])
        most = {"model": "toy", "prompt": [[1]] * 64, "n": 2, "max_tokens": 1}
        assert len((await http.post("/v1/completions", json=most)).json()["choices"]) == 128


async def test_max_choices_is_configurable_and_counts_chat_choices_too() -> None:
    async with limited(config=ServerConfig(max_choices=4)) as (engine, http):
        body = {"model": "toy", "prompt": ["a", "b"], "n": 3, "max_tokens": 1}
        error = error_of(await http.post("/v1/completions", json=body), 400)
        assert error["message"].endswith("must be <= 4, got 2 prompts x n=3 = 6")
        chat = {"model": "toy", "messages": CHAT, "n": 5, "max_tokens": 1}
        error = error_of(await http.post("/v1/chat/completions", json=chat), 400)
        assert error["param"] == "n"
        assert error["message"].endswith("must be <= 4, got 1 prompts x n=5 = 5")
        assert (engine.num_tokenized, engine.submitted) == (0, [])
        body["n"] = 2
        assert len((await http.post("/v1/completions", json=body)).json()["choices"]) == 4


STOPS: list[tuple[dict[str, Any], str, str]] = [
    (
        {"stop": ["x" * 20_000], "n": 4},
        "stop",
        "stop strings must be <= 256 characters long, got one of 20000",
    ),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "stop must hold <= 16 strings, got 17"),
    (
        {"stop_token_ids": list(range(129))},
        "stop_token_ids",
        "stop_token_ids must hold <= 128 ids, got 129",
    ),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stop_strings_and_stop_token_ids_are_capped_before_tokenizing(path: str) -> None:
    async with limited() as (engine, http):
        for fields, param, message in STOPS:
            prompt = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
            body = {"model": "toy", "max_tokens": 2, **prompt, **fields}
            error = error_of(await http.post(path, json=body), 400)
            assert (error["param"], error["message"]) == (param, message)
        assert (engine.num_tokenized, engine.submitted) == (0, [])


async def test_a_stop_token_id_outside_the_vocabulary_is_a_400_naming_it() -> None:
    async with limited() as (engine, http):
        body = {"model": "toy", "prompt": "hi", "max_tokens": 2, "stop_token_ids": [3, 300]}
        error = error_of(await http.post("/v1/completions", json=body), 400)
        assert (error["param"], error["message"]) == (
            "stop_token_ids",
            "stop_token_ids must be in [0, 257), got 300 at index 1",
        )
        assert engine.statistics().num_open_requests == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_deeply_nested_json_is_a_400_without_a_traceback(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    nested = b"[" * 100_000 + b"]" * 100_000
    body = b'{"model": "toy", "prompt": ' + nested + b', "messages": ' + nested + b"}"
    with caplog.at_level(logging.INFO):
        async with limited() as (engine, http):
            reply = await http.post(
                path, content=body, headers={"content-type": "application/json"}
            )
            error = error_of(reply, 400)
            assert error["message"].startswith("the request body is nested too deeply")
            assert error["type"] == "invalid_request_error"
            assert (engine.num_tokenized, engine.submitted) == (0, [])
    assert [record for record in caplog.records if record.exc_info] == []


async def test_a_non_ascii_authorization_is_a_401_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        async with limited(api_key="clé") as (_, http):
            for header in (b"Bearer sk-\xe9t\xe9", b"Bearer \xff\xfe", "Bearer clé".encode()[:-1]):
                reply = await http.get("/v1/models", headers={"authorization": header})
                assert error_of(reply, 401)["code"] == "invalid_api_key", header
            # A key outside ASCII is sent as UTF-8, and it works.
            right = await http.get("/v1/models", headers={"authorization": "Bearer clé".encode()})
            assert right.status_code == 200
    assert [record for record in caplog.records if record.exc_info] == []


async def test_a_full_waiting_queue_is_a_503_before_tokenizing_and_a_request_is_queued_whole() -> (
    None
):
    runner = GatedRunner()
    config = ServerConfig(max_waiting_requests=3)
    async with limited(runner=runner, config=config) as (engine, http):
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        # One runs (max_num_seqs=1), held in its first step by the gate; two wait.
        direct = [engine.engine.submit("first", params)]
        # (Not wait_all_tasks_blocked: uvicorn's 0.1 s tick can keep it looking forever.)
        assert await anyio.to_thread.run_sync(partial(runner.entered.wait, 20))
        direct += [engine.engine.submit(text, params) for text in ("second", "third")]
        assert engine.statistics().num_waiting == 2

        body = {"model": "toy", "prompt": "hi", "max_tokens": 2, "n": 2}
        reply = await http.post("/v1/completions", json=body)
        assert reply.headers["retry-after"] == "1"
        assert error_of(reply, 503) == {
            "message": "the waiting queue is full: 2 requests wait for admission and "
            "max_waiting_requests is 3, no room for this request's 2; retry later",
            "type": "server_error",
            "param": None,
            "code": "engine_overloaded",
        }
        # Neither choice was queued, nothing was tokenized.
        assert (engine.num_tokenized, engine.submitted) == (0, [])
        assert engine.statistics().num_waiting == 2

        answers: list[httpx.Response] = []

        async def one_more() -> None:
            answers.append(await http.post("/v1/completions", json=body | {"n": 1}))

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(one_more)
            await engine.wait_submitted(1)  # room for one: queued
            assert engine.statistics().num_waiting == 3
            runner.gate.set()
        assert answers[0].status_code == 200, answers[0].text
        for handle in direct:  # nothing queued before was lost
            assert len((await handle.result()).token_ids) == 2


CHECKS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"max_choices": 0}, ValueError, "max_choices must be >= 1, got 0"),
    ({"max_choices": 2.0}, TypeError, "max_choices must be an int, got float 2.0"),
    ({"max_waiting_requests": 0}, ValueError, "max_waiting_requests must be >= 1, got 0"),
    ({"max_waiting_requests": "9"}, TypeError, "max_waiting_requests must be an int"),
]


async def test_the_limits_are_checked_where_they_are_configured() -> None:
    for options, error, message in CHECKS:
        with pytest.raises(error, match=f"^{message}"):
            ServerConfig(**options)  # before build_app() or serve(), which take it whole
    defaults = ServerConfig()
    assert (defaults.max_choices, defaults.max_waiting_requests) == (128, 1024)


async def test_the_limits_come_as_one_server_config() -> None:
    async with limited(config=ServerConfig(max_choices=4)) as (engine, http):
        body = {"model": "toy", "prompt": "hi", "max_tokens": 1, "n": 5}
        error = error_of(await http.post("/v1/completions", json=body), 400)
        assert error["message"].endswith("must be <= 4, got 1 prompts x n=5 = 5")
        assert engine.submitted == []
    async with Engine.open(model="toy", device="cpu") as engine:
        # A field is no keyword of either: the limits are one value, checked where it is built.
        with pytest.raises(TypeError, match=r"^build_app\(\) got an unexpected keyword "
                           r"argument 'max_choices'$"):  # fmt: skip
            build_app(engine, max_choices=4)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match=r"^serve\(\) got an unexpected keyword "
                           r"argument 'max_choices'$"):  # fmt: skip
            # 192.0.2.1 (TEST-NET-1) is on no interface: nothing is ever bound.
            await serve(engine, "192.0.2.1", 0, max_choices=4)  # type: ignore[call-arg]
        given: Any = {"max_choices": 4}
        wrong = r"^config must be a ServerConfig or None, got dict \{'max_choices': 4\}$"
        with pytest.raises(TypeError, match=wrong):
            build_app(engine, config=given)
        with pytest.raises(TypeError, match=wrong):  # before anything is bound
            await serve(engine, "192.0.2.1", 0, config=given)


async def test_max_choices_never_passes_max_waiting_requests() -> None:
    async with limited(config=ServerConfig(max_waiting_requests=4)) as (engine, http):
        body = {"model": "toy", "prompt": "hi", "max_tokens": 1, "n": 5}
        error = error_of(await http.post("/v1/completions", json=body), 400)
        assert error["message"].endswith("must be <= 4, got 1 prompts x n=5 = 5")
        assert engine.submitted == []


def test_the_serve_command_takes_the_limits(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    given = parser.parse_args(["serve", "--max-choices", "8", "--max-waiting-requests", "64"])
    assert (given.max_choices, given.max_waiting_requests) == (8, 64)
    absent = parser.parse_args(["serve"])  # the server's defaults apply
    defaults = ServerConfig()
    assert (absent.max_choices, absent.max_waiting_requests) == (
        defaults.max_choices,
        defaults.max_waiting_requests,
    )
    for flag, value, message in [
        ("--max-choices", "0", "max_choices must be >= 1, got 0"),
        ("--max-waiting-requests", "many", "max_waiting_requests must be an int, got 'many'"),
    ]:
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", f"{flag}={value}"])
        assert f"argument {flag}: {message}" in capsys.readouterr().err
