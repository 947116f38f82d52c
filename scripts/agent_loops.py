"""The default tool loop of each agent library, against ``twostroke serve`` and a real model.

Not a test: the check behind issue 36's acceptance point "the default tool loop of each
library finishes: a tool call, the tool's result, then a text answer" (the outcomes are in
docs/structured-output.md, "Tools and agents"). The test suite drives the same protocol with
the OpenAI SDK against a scripted toy (tests/engine/server/test_tools.py); this script drives
it with each library's own loop, its own request shapes, against SmolLM2-135M.

None of the libraries is a dependency of twostroke, and they do not all fit in one
environment (instructor 1.17 pins ``jiter<0.15``; every openai >= 3.50, which pydantic-ai
2.78 requires, needs ``jiter>=0.16``), so they live in side venvs (ignored by git) and the
server runs from the project's own ``.venv``::

    python3.11 -m venv .venv-agents
    .venv-agents/bin/pip install openai openai-agents langchain langchain-openai langgraph \\
        litellm 'pydantic-ai-slim[openai]'   # langchain for create_agent
    .venv-agents/bin/python scripts/agent_loops.py

    python3.11 -m venv .venv-agents/instructor
    .venv-agents/instructor/bin/pip install instructor
    .venv-agents/instructor/bin/python scripts/agent_loops.py --loops instructor

The script starts ``twostroke serve`` itself (``--twostroke``; default ``.venv/bin/twostroke``)
on a free loopback port, waits (bounded) until ``/v1/models`` answers, and stops and reaps it
on the way out, whatever happens. The libraries talk to it through a small recording proxy on
another loopback port, which passes each request's and answer's body through unchanged (the
answer re-framed as chunked) and keeps each request's body and each error's answer, so that a
failure shows the exact request the library sent (``--record FILE`` writes them all).

Each loop offers one function tool, ``get_weather(city)``, which returns a fixed sentence.
Under ``tool_choice`` "auto" a 135M model often answers in text, which is the model's choice,
not the protocol's; so each loop runs "auto" first, the tool asked for by name, and where the
model answers in text, again with the tool forced on the first turn, each library's own way of
saying so, later turns "auto" (``--forced-only`` runs only this one). A line per run:

* ``PASS``: the model called the tool, the loop ran it, a later request carried its result,
  and the loop ended on a text answer;
* ``TEXT``: the model answered in text without calling;
* ``CUT``: the calls and the result went through, but the final text outran ``--max-tokens``
  and the library raises for that (openai-agents on an "incomplete" response);
* ``LOOP``: the calls and the results went through, but the model called again on every turn
  up to ``MAX_TURNS`` (a loop the script writes; a library's own limit raises: ``FAIL``);
* ``FAIL``: an error (an HTTP status the server answered, a library's exception), or a loop
  that ended without a text answer.

Everything is bounded: ``--max-tokens`` per request, greedy sampling, a timeout on every
client, no retries, at most ``MAX_TURNS`` model turns per loop; the whole run takes about three
minutes on two shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT = "Sunny, 21 degrees Celsius in Oslo."
PROMPT = "Use the get_weather tool for Oslo, then tell me the weather there."
INSTRUCTIONS = "You answer questions about the weather. Call the get_weather tool to find it."
TIMEOUT = 90.0
MAX_TURNS = 4
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NAMED: dict[str, Any] = {"type": "function", "function": {"name": "get_weather"}}


# --- what a run saw ---------------------------------------------------------------------


@dataclass
class Exchange:
    """One request through the proxy: what the library sent, what the server answered."""

    method: str
    path: str
    body: Any
    status: int
    error: str | None = None  # the answer's body, for a status >= 400


@dataclass
class Run:
    """One loop's run: the tool's executions, the exchanges, the final text answer."""

    loop: str
    choice: str
    calls: list[str] = field(default_factory=list)
    answer: str | None = None
    error: str | None = None
    cut: str | None = None  # the library's error for an answer cut at max_tokens
    exchanges: list[Exchange] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def result_sent(self) -> bool:
        """Whether a request carried the tool's result back to the model."""
        return any(RESULT in json.dumps(e.body) for e in self.exchanges if e.body is not None)

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "FAIL"
        if self.calls and self.answer and (self.result_sent or self.loop in ALWAYS_FORCED):
            return "PASS"  # instructor's extraction has no result to send: the call is all
        if not self.calls and (self.answer is not None or self.cut is not None):
            return "TEXT"
        if self.cut is not None and self.result_sent:
            return "CUT"
        if self.calls and self.result_sent and self.answer is None:
            return "LOOP"  # the model called again on every turn, up to MAX_TURNS
        return "FAIL"

    def line(self) -> str:
        answer = "-" if self.answer is None else repr(self.answer[:100])
        statuses = ",".join(
            f"{e.path.removeprefix('/v1/')} {e.status}"
            for e in self.exchanges
            if e.method == "POST"
        )
        text = (
            f"{self.verdict:4} {self.loop:30} tool_choice={self.choice:6} "
            f"calls={self.calls or '-'} result_sent={self.result_sent} "
            f"http=[{statuses}] {self.seconds:.1f}s\n     answer: {answer}"
        )
        if self.cut is not None:
            text += f"\n     cut at max_tokens, which the library raises for: {self.cut}"
        if self.error is not None:
            text += f"\n     error: {self.error}"
            for exchange in self.exchanges:
                if exchange.error is not None:
                    sent = json.dumps(exchange.body)[:2000]
                    text += (
                        f"\n     {exchange.method} {exchange.path} -> {exchange.status}: "
                        f"{exchange.error[:500]}\n     sent: {sent}"
                    )
        return text


class Cut(Exception):
    """A library's error for a text answer cut at ``max_tokens`` (its rule, not the server's)."""


class Tool:
    """``get_weather``'s body, shared by every library's wrapper: it records each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, city: str) -> str:
        self.calls.append(f"get_weather(city={city!r})")
        return RESULT

    def from_json(self, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = {}
        city = parsed.get("city", "") if isinstance(parsed, dict) else ""
        return self(str(city))


# --- the server and the proxy -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when this script dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def served(twostroke: str, model: str | None, startup: float) -> Iterator[str]:
    """``twostroke serve`` as a child process; yields its base URL; stops and reaps it."""
    port = free_port()
    command = [twostroke, "serve", "--host", "127.0.0.1", "--port", str(port)]
    if model is not None:
        command += ["--model", model]
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + startup
            while True:
                if child.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(
                        f"twostroke serve exited ({child.returncode}):\n{log.read()}"
                    )
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as answer:
                        if answer.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"twostroke serve did not answer in {startup:.0f} s")
                time.sleep(0.5)
            yield base
        finally:
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()


class Recorder:
    """A loopback proxy that forwards requests unchanged and records them per run."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                recorder.forward(self)

            def do_POST(self) -> None:
                recorder.forward(self)

            def do_DELETE(self) -> None:
                recorder.forward(self)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hung up
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
        headers = {
            k: v
            for k, v in handler.headers.items()
            if k.lower() not in ("host", "connection", "content-length", "transfer-encoding")
        }
        upstream = http.client.HTTPConnection(*self.upstream, timeout=TIMEOUT)
        try:
            upstream.request(handler.command, handler.path, body=raw or None, headers=headers)
            answer = upstream.getresponse()
            exchange = Exchange(handler.command, handler.path, body, answer.status)
            with self._lock:
                self.exchanges.append(exchange)
            handler.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in ("connection", "content-length", "transfer-encoding"):
                    handler.send_header(key, value)
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            kept = bytearray()
            while piece := answer.read1(65536):
                if answer.status >= 400:
                    kept += piece
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
            if answer.status >= 400:
                exchange.error = kept.decode("utf-8", "replace")
        finally:
            upstream.close()

    def __enter__(self) -> Recorder:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def take(self) -> list[Exchange]:
        with self._lock:
            taken, self.exchanges = self.exchanges, []
        return taken


# --- the loops ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    base_url: str  # the proxy's, with /v1
    model: str
    max_tokens: int


#: A loop: (target, tool, forced) -> the final text answer. ``forced``: the first turn
#: calls get_weather (each library's own way of saying so); later turns are "auto".
Loop = Callable[[Target, Tool, bool], str | None]


def openai_chat(target: Target, tool: Tool, forced: bool) -> str | None:
    """The OpenAI SDK's chat loop as its docs write it: append the message, then results."""
    from openai import OpenAI

    client: Any = OpenAI(base_url=target.base_url, api_key="x", timeout=TIMEOUT, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    for turn in range(MAX_TURNS):
        extra = {"tool_choice": NAMED} if forced and turn == 0 else {}
        completion = client.chat.completions.create(
            model=target.model,
            messages=messages,
            tools=[WEATHER_TOOL],
            max_tokens=target.max_tokens,
            temperature=0,
            **extra,
        )
        message = completion.choices[0].message
        if not message.tool_calls:
            text: str | None = message.content
            return text
        messages.append(message)
        for call in message.tool_calls:
            result = tool.from_json(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def openai_chat_stream(target: Target, tool: Tool, forced: bool) -> str | None:
    """The same loop streamed, each turn through ``chat.completions.stream``'s accumulator.

    The accumulator raises ``LengthFinishReasonError`` for an answer cut at ``max_tokens``
    (the SDK's rule, whatever the server); the completion it carries is the answer.
    """
    from openai import LengthFinishReasonError, OpenAI

    client: Any = OpenAI(base_url=target.base_url, api_key="x", timeout=TIMEOUT, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    for turn in range(MAX_TURNS):
        extra = {"tool_choice": NAMED} if forced and turn == 0 else {}
        try:
            with client.chat.completions.stream(
                model=target.model,
                messages=messages,
                tools=[WEATHER_TOOL],
                max_tokens=target.max_tokens,
                temperature=0,
                **extra,
            ) as stream:
                completion: Any = stream.get_final_completion()
        except LengthFinishReasonError as exc:
            completion = exc.completion
        message = completion.choices[0].message
        if not message.tool_calls:
            text: str | None = message.content
            return text
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        for call in message.tool_calls:
            result = tool.from_json(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def _langchain_tool(tool: Tool) -> Any:
    from langchain_core.tools import tool as as_tool

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return tool(city)

    return as_tool(get_weather)


def _chat_openai(target: Target, streaming: bool = False) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=target.base_url,
        api_key="x",
        model=target.model,
        max_tokens=target.max_tokens,
        temperature=0,
        timeout=TIMEOUT,
        max_retries=0,
        streaming=streaming,
    )


def langchain_bind_tools(
    target: Target, tool: Tool, forced: bool, streaming: bool = False
) -> str | None:
    """langchain-openai's loop: ``bind_tools``, ``invoke``, ``ToolMessage`` for each call."""
    from langchain_core.messages import ToolMessage

    weather = _langchain_tool(tool)
    llm = _chat_openai(target, streaming)
    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    for turn in range(MAX_TURNS):
        bound = llm.bind_tools(
            [weather], tool_choice="get_weather" if forced and turn == 0 else None
        )
        if streaming:  # the chunks added up, as langchain's docs accumulate a stream
            reply: Any = None
            for chunk in bound.stream(messages):
                reply = chunk if reply is None else reply + chunk
        else:
            reply = bound.invoke(messages)
        if not reply.tool_calls:
            return str(reply.content)
        messages.append(reply)
        for call in reply.tool_calls:
            messages.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
    return None


def langchain_bind_tools_stream(target: Target, tool: Tool, forced: bool) -> str | None:
    """The same loop streamed: ``bound.stream`` and its ``AIMessageChunk`` sums (the
    ``tool_call_chunks`` merged by index)."""
    return langchain_bind_tools(target, tool, forced, streaming=True)


def langchain_agent(target: Target, tool: Tool, forced: bool) -> str | None:
    """langchain's ``create_agent`` (LangGraph's prebuilt ``create_react_agent`` before it)."""
    weather = _langchain_tool(tool)
    llm = _chat_openai(target)
    inputs = {"messages": [{"role": "user", "content": PROMPT}]}
    config = {"recursion_limit": 2 * MAX_TURNS + 1}
    try:
        from langchain.agents import create_agent
        from langchain.agents.middleware import wrap_model_call
    except ImportError:
        from langgraph.prebuilt import create_react_agent

        def dynamic(state: Any, runtime: Any) -> Any:
            first = not any(m.type == "tool" for m in state["messages"])
            choice = "get_weather" if forced and first else None
            return llm.bind_tools([weather], tool_choice=choice)

        graph = create_react_agent(dynamic if forced else llm, [weather])
    else:

        def first_turn_calls(request: Any, handler: Any) -> Any:
            if not any(m.type == "tool" for m in request.messages):
                request = request.override(tool_choice="get_weather")
            return handler(request)

        middleware = [wrap_model_call(first_turn_calls)] if forced else []
        graph = create_agent(llm, [weather], middleware=middleware)
    state = graph.invoke(inputs, config=config)
    last = state["messages"][-1]
    return None if getattr(last, "tool_calls", None) else str(last.content)


def litellm_loop(target: Target, tool: Tool, forced: bool) -> str | None:
    """litellm's loop as its docs write it (the message appended, results with ``name``)."""
    import litellm

    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    for turn in range(MAX_TURNS):
        extra = {"tool_choice": NAMED} if forced and turn == 0 else {}
        response = litellm.completion(
            model=f"openai/{target.model}",
            api_base=target.base_url,
            api_key="x",
            messages=messages,
            tools=[WEATHER_TOOL],
            max_tokens=target.max_tokens,
            temperature=0,
            timeout=TIMEOUT,
            num_retries=0,
            **extra,
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return str(message.content)
        messages.append(message)
        for call in message.tool_calls:
            messages.append({
                "role": "tool",
                "tool_call_id": call.id,
                "name": call.function.name,
                "content": tool.from_json(call.function.arguments),
            })  # fmt: skip
    return None


def pydantic_ai_loop(target: Target, tool: Tool, forced: bool) -> str | None:
    """pydantic-ai's ``Agent.run_sync`` with an ``@agent.tool_plain`` function."""
    from dataclasses import dataclass as plain_dataclass

    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    @plain_dataclass  # misc: AbstractCapability is Any where pydantic-ai is not installed
    class FirstStepCalls(AbstractCapability[None]):  # type: ignore[misc,unused-ignore]
        """tool_choice on the first step only (pydantic-ai refuses a static 'required')."""

        def get_model_settings(self) -> Any:
            return lambda ctx: {"tool_choice": ["get_weather"]} if ctx.run_step <= 1 else {}

    client = AsyncOpenAI(base_url=target.base_url, api_key="x", timeout=TIMEOUT, max_retries=0)
    model = OpenAIChatModel(target.model, provider=OpenAIProvider(openai_client=client))
    agent = Agent(
        model,
        instructions=INSTRUCTIONS,
        model_settings={"max_tokens": target.max_tokens, "temperature": 0},
        capabilities=[FirstStepCalls()] if forced else [],
    )

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return tool(city)

    agent.tool_plain(get_weather)
    result = agent.run_sync(PROMPT, usage_limits=UsageLimits(request_limit=MAX_TURNS))
    return str(result.output)


def _openai_agents(
    target: Target, tool: Tool, forced: bool, api: str, streamed: bool = False
) -> str | None:
    from agents import (
        Agent,
        ModelBehaviorError,
        ModelSettings,
        RunConfig,
        Runner,
        function_tool,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: The city.
        """
        return tool(city)

    settings = ModelSettings(
        max_tokens=target.max_tokens,
        temperature=0,
        tool_choice="get_weather" if forced else None,  # reset after the call (the default)
    )
    agent = Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=target.model,
        model_settings=settings,
    )
    # Before the RunConfig: its model provider reads the default API when it is made.
    set_default_openai_api(api)  # type: ignore[arg-type]
    set_tracing_disabled(True)
    run_config = RunConfig(tracing_disabled=True)

    async def run() -> Any:
        # The client is made and closed inside the loop that uses it (a client left to the
        # garbage collector closes its connections on a loop already closed).
        async with AsyncOpenAI(
            base_url=target.base_url, api_key="x", timeout=TIMEOUT, max_retries=0
        ) as client:
            set_default_openai_client(client, use_for_tracing=False)
            if not streamed:
                return await Runner.run(agent, PROMPT, max_turns=MAX_TURNS, run_config=run_config)
            running = Runner.run_streamed(agent, PROMPT, max_turns=MAX_TURNS,
                                          run_config=run_config)  # fmt: skip
            async for _ in running.stream_events():
                pass
            return running

    try:
        result = asyncio.run(run())
    except ModelBehaviorError as exc:  # the Responses API's "incomplete": max_output_tokens
        if "max_output_tokens" in str(exc):
            raise Cut(str(exc)) from exc
        raise
    return str(result.final_output)


def openai_agents_responses(target: Target, tool: Tool, forced: bool) -> str | None:
    """openai-agents' ``Runner.run`` with its defaults: the Responses API."""
    return _openai_agents(target, tool, forced, "responses")


def openai_agents_responses_stream(target: Target, tool: Tool, forced: bool) -> str | None:
    """openai-agents' ``Runner.run_streamed`` (its events drained), the Responses API."""
    return _openai_agents(target, tool, forced, "responses", streamed=True)


def openai_agents_chat(target: Target, tool: Tool, forced: bool) -> str | None:
    """openai-agents' ``Runner.run`` over chat completions (``set_default_openai_api``)."""
    return _openai_agents(target, tool, forced, "chat_completions")


def instructor_extraction(target: Target, tool: Tool, forced: bool) -> str | None:
    """instructor's default mode (TOOLS): one extraction, a forced call of the model's type."""
    import instructor
    from openai import OpenAI
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        summary: str

    client = instructor.from_openai(
        OpenAI(base_url=target.base_url, api_key="x", timeout=TIMEOUT, max_retries=0)
    )
    weather = client.chat.completions.create(
        model=target.model,
        response_model=Weather,
        messages=[{"role": "user", "content": f"The weather report: {RESULT} Extract it."}],
        max_tokens=target.max_tokens,
        temperature=0,
        max_retries=1,
    )
    tool.calls.append(f"Weather({weather.model_dump_json()})")
    return repr(weather)


LOOPS: dict[str, Loop] = {
    "openai-chat": openai_chat,
    "openai-chat-stream": openai_chat_stream,
    "langchain-bind-tools": langchain_bind_tools,
    "langchain-bind-tools-stream": langchain_bind_tools_stream,
    "langchain-agent": langchain_agent,
    "litellm": litellm_loop,
    "pydantic-ai": pydantic_ai_loop,
    "openai-agents-responses": openai_agents_responses,
    "openai-agents-responses-stream": openai_agents_responses_stream,
    "openai-agents-chat": openai_agents_chat,
    "instructor": instructor_extraction,
}
#: Loops that force their call by design: run once, and a call is what they pass on.
ALWAYS_FORCED = {"instructor"}
#: The package each loop imports first (a loop whose package is missing is skipped).
PACKAGES = {
    "openai-chat": "openai",
    "openai-chat-stream": "openai",
    "langchain-bind-tools": "langchain_openai",
    "langchain-bind-tools-stream": "langchain_openai",
    "langchain-agent": "langchain_openai",
    "litellm": "litellm",
    "pydantic-ai": "pydantic_ai",
    "openai-agents-responses": "agents",
    "openai-agents-responses-stream": "agents",
    "openai-agents-chat": "agents",
    "instructor": "instructor",
}
VERSIONED = ["openai", "openai-agents", "langchain", "langchain-openai", "langchain-core",
             "langgraph", "litellm", "pydantic-ai-slim", "instructor"]  # fmt: skip


def run_loop(name: str, target: Target, recorder: Recorder, forced: bool) -> Run:
    tool = Tool()
    choice = "forced" if forced or name in ALWAYS_FORCED else "auto"
    run = Run(name, choice)
    recorder.take()
    start = time.monotonic()
    try:
        run.answer = LOOPS[name](target, tool, forced)
    except Cut as exc:
        run.cut = str(exc)[:300]
    except Exception as exc:  # a library's error, reported with what the server answered
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        run.error = f"{type(exc).__name__}: {str(exc)[:600]}{where}"
    run.seconds = time.monotonic() - start
    run.calls = tool.calls
    run.exchanges = recorder.take()
    return run


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in VERSIONED:
        with contextlib.suppress(PackageNotFoundError):
            found.append(f"{package} {version(package)}")
    return ", ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--twostroke", default=str(ROOT / ".venv" / "bin" / "twostroke"))
    parser.add_argument("--model", default=None, help="default: twostroke serve's (SmolLM2)")
    parser.add_argument("--loops", nargs="+", choices=sorted(LOOPS), default=sorted(LOOPS))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--startup-timeout", type=float, default=120.0)
    parser.add_argument("--forced-only", action="store_true", help="skip the 'auto' runs")
    parser.add_argument("--record", type=Path, help="write every run's requests here (JSON)")
    args = parser.parse_args()
    # litellm fetches its model price list from the internet at import unless told not to.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    print(f"python {sys.version.split()[0]}; {versions()}", flush=True)
    wanted = [name for name in LOOPS if name in args.loops]
    runs: list[Run] = []
    with served(args.twostroke, args.model, args.startup_timeout) as base, Recorder(base) as rec:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as answer:
            model = json.load(answer)["data"][0]["id"]
        print(f"twostroke serve at {base} (proxy {rec.base}), model {model!r}", flush=True)
        target = Target(f"{rec.base}/v1", model, args.max_tokens)
        for name in wanted:
            if importlib.util.find_spec(PACKAGES[name]) is None:
                print(f"SKIP {name:28} ({PACKAGES[name]} is not installed here)", flush=True)
                continue
            # "auto" first; if the model answers in text, the tool forced on turn one.
            stages = [False, True]
            if args.forced_only or name in ALWAYS_FORCED:
                stages = [True]
            for forced in stages:
                run = run_loop(name, target, rec, forced)
                runs.append(run)
                print(run.line(), flush=True)
                if run.verdict != "TEXT":
                    break
    if args.record is not None:
        record = [{"loop": run.loop, "tool_choice": run.choice,
                   "verdict": run.verdict, "exchanges": [asdict(e) for e in run.exchanges]}
                  for run in runs]  # fmt: skip
        args.record.write_text(json.dumps(record, indent=1))
    outcomes: dict[str, list[str]] = {}
    for run in runs:
        outcomes.setdefault(run.loop, []).append(f"{run.choice} {run.verdict}")
    print("summary:")
    for loop, verdicts in outcomes.items():
        print(f"  {loop:30} {', '.join(verdicts)}")
    sys.exit(1 if any(run.verdict == "FAIL" for run in runs) else 0)


if __name__ == "__main__":
    main()
