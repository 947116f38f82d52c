"""Server test helpers: a real server on a loopback port, and an engine the tests can watch."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import anyio
import attrs
import httpx
import pytest
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from prometheus_client.parser import text_string_to_metric_families

from twostroke.engine import Engine, EngineStatistics, RequestHandle, RequestOutput
from twostroke.engine.config import ServerConfig
from twostroke.engine.handle import create_request_handle
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.engine.server import serve
from twostroke.engine.surface import EngineSurface
from twostroke.states.params import SamplingParams

API_KEY = "sk-test"

#: The ``openai`` client leaves a stream's async generators suspended after ``[DONE]`` (it
#: breaks out of them without ``aclose()``); asyncio finalizes them quietly, trio warns when
#: the garbage collector does. A client-side quirk, not the server's: ignored for those only.
OPENAI_STREAMS_ON_TRIO = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\..*' was garbage collected"
    ":ResourceWarning"
)


#: The TLS context of every client these tests make. They speak plain HTTP to 127.0.0.1, but
#: an ``httpx`` or ``openai`` client made without a context loads the system's CA certificates
#: into one of its own: 30-45 ms of CPU per client, ~270 clients in this folder (its tests
#: took 110-111 CPU s with them, 94-99 with one context, 2 AVX2 cores, load average 1-1.6).
CLIENT_TLS = ssl.create_default_context()


def http_client(base_url: str, **options: Any) -> httpx.AsyncClient:
    """An ``httpx`` client of a test server, with the tests' one TLS context."""
    return httpx.AsyncClient(base_url=base_url, verify=CLIENT_TLS, **options)


def openai_client(base_url: str, **options: Any) -> AsyncOpenAI:
    """The official client of a test server's ``/v1``, without retries (a retry would hide a
    failed request), on the HTTP client it makes by default but with the tests' TLS context."""
    return AsyncOpenAI(
        base_url=base_url,
        max_retries=0,
        http_client=DefaultAsyncHttpxClient(verify=CLIENT_TLS),
        **options,
    )


class ObservedEngine:
    """The engine surface of a real engine, with hooks a test can wait on or break.

    ``prepared`` gets every prompt of a ``prepare`` call, ``submitted`` every (prompt,
    params) pair, the prompt as the server asked for it (what it gave ``prepare``, whose
    ids it then submits), and ``tokenized`` every prompt of a ``tokenize`` call;
    ``on_submit`` (if set) is called with each submitted pair; ``failure`` (if set) is
    raised by every call, as from a dead engine. With ``refuse_later``, a
    request the engine refuses (``TypeError``, ``ValueError``, ``RequestRejected``) is
    refused through its handle instead, as a coordinator's process or ray replica reports it.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.prepared: list[Any] = []
        # What prepare returned (kept alive, so the id stays its), and what it was given.
        self._asked: dict[int, tuple[Any, Any]] = {}
        self.submitted: list[tuple[Any, SamplingParams]] = []
        self.tokenized: list[Any] = []
        self.refuse_later = False
        self.on_submit: Callable[[Any, SamplingParams], None] | None = None
        self.failure: BaseException | None = None
        self._changed = anyio.Event()

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (the server reads its chat template's tool format)."""
        return self.engine.tokenizer

    async def prepare(self, prompt: Any) -> Any:
        self._check()
        self.prepared.append(prompt)
        try:
            ready = await self.engine.prepare(prompt)
        except (TypeError, ValueError):
            if not self.refuse_later:
                raise
            return prompt  # submit refuses it, through the handle
        self._asked[id(ready)] = (ready, prompt)
        return ready

    def submit(self, prompt: Any, params: SamplingParams | None = None) -> RequestHandle:
        self._check()
        try:
            handle = self.engine.submit(prompt, params)
        except (TypeError, ValueError) as exc:
            if not self.refuse_later:
                raise
            writer, handle = create_request_handle(-1, (), lambda _: None)
            writer.fail(exc)
            return handle
        ready, asked = self._asked.get(id(prompt), (None, prompt))
        asked = asked if ready is prompt else prompt
        self.submitted.append((asked, params or SamplingParams()))
        if self.on_submit is not None:
            self.on_submit(asked, params or SamplingParams())
        self._changed.set()
        self._changed = anyio.Event()
        return handle

    async def wait_submitted(self, count: int) -> None:
        """Wait until ``count`` requests have been submitted in all."""
        while len(self.submitted) < count:
            await self._changed.wait()

    async def generate(self, prompt: Any, params: SamplingParams | None = None) -> RequestOutput:
        self._check()
        return await self.engine.generate(prompt, params)

    def stream(
        self, prompt: Any, params: SamplingParams | None = None
    ) -> AbstractAsyncContextManager[RequestHandle]:
        self._check()
        return self.engine.stream(prompt, params)

    async def tokenize(self, prompt: Any) -> list[int]:
        self._check()
        self.tokenized.append(prompt)
        return await self.engine.tokenize(prompt)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        self._check()
        return await self.engine.detokenize(token_ids)

    async def wait_idle(self) -> None:
        await self.engine.wait_idle()

    def check_health(self) -> None:
        self._check()
        self.engine.check_health()

    def statistics(self) -> EngineStatistics:
        return self.engine.statistics()


@attrs.frozen
class Served:
    """A running server: its engine (observed), its address and clients for it."""

    engine: ObservedEngine
    base_url: str
    client: AsyncOpenAI
    http: httpx.AsyncClient

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of ``/metrics``, keyed by name and sorted labels."""
        reply = await self.http.get("/metrics")
        assert reply.status_code == 200, reply.text
        samples = {}
        for family in text_string_to_metric_families(reply.text):
            for sample in family.samples:
                samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
        return samples

    async def metric(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": self.engine.model_name, **labels}.items())))
        return (await self.metrics())[key]


@asynccontextmanager
async def served(
    *,
    runner: ToyRunner | None = None,
    api_key: str | None = API_KEY,
    server_config: ServerConfig | None = None,
    check_clean: bool = True,
    serve_options: dict[str, Any] | None = None,
    tokenizer: Any = None,
    **config: Any,
) -> AsyncIterator[Served]:
    """A toy engine served on 127.0.0.1 (a free port), with an ``openai`` client for it.

    ``server_config`` goes to :func:`serve` as its ``config`` (the server's defaults where
    absent), ``serve_options`` as its other keywords; ``tokenizer`` replaces the toy runner's
    byte tokenizer. When the block ends normally the engine must be idle with every KV block
    free.
    """
    engine_context = (
        Engine.open(
            runner=runner,
            tokenizer=tokenizer if tokenizer is not None else ByteTokenizer(),
            device="cpu",
            model_name="toy",
            **config,
        )
        if runner is not None
        else Engine.open(model="toy", device="cpu", **config)
    )
    async with engine_context as real_engine:
        engine = ObservedEngine(real_engine)
        assert isinstance(engine, EngineSurface)
        async with anyio.create_task_group() as task_group:
            port = await task_group.start(
                partial(
                    serve,
                    engine,
                    port=0,
                    api_key=api_key,
                    config=server_config,
                    **(serve_options or {}),
                )
            )
            base_url = f"http://127.0.0.1:{port}"
            headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
            async with (
                # A connect timeout far above openai's 5 s: the load tests open 200
                # connections at once on a machine that may be busy with other jobs, and
                # each test bounds its own time.
                openai_client(
                    f"{base_url}/v1",
                    api_key=api_key or "unused",
                    timeout=httpx.Timeout(60.0, connect=30.0),
                ) as client,
                http_client(base_url, headers=headers) as http,
            ):
                yield Served(engine, base_url, client, http)
                if check_clean:
                    with anyio.fail_after(20):
                        await real_engine.wait_idle()
                    real_engine.check_invariants()
                    stats = real_engine.statistics()
                    # (A stored response's blocks stay pinned for its next turn.)
                    free = stats.num_free_blocks + stats.num_pinned_blocks
                    assert free == stats.num_blocks, stats
            task_group.cancel_scope.cancel()
