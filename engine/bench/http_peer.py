"""Any OpenAI-compatible HTTP endpoint as a benchmark system (``--endpoint URL``).

``twostroke serve`` and ``vllm serve`` are then measured the same way, as a client sees them:
each request of the workload is sent at its arrival time as a streamed ``/v1/completions``
call with the workload's token ids as the prompt, greedy, EOS ignored, usage asked for. TTFT is
the first chunk that carries text, ITL the gaps between such chunks, and the output token
count is the server's own usage figure. The prompts must be the served model's token ids, so
``--model`` must name the model the endpoint serves.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import anyio
import attrs

from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import BenchRequest, Workload

__all__ = ["EndpointDriver", "parse_endpoint"]


def parse_endpoint(spec: str) -> EndpointDriver:
    """``[NAME=]URL`` (``--endpoint``) as a driver; the name defaults to ``http:HOST:PORT``.

    Raises:
        ValueError: the URL is not ``http://`` or ``https://`` with a host.
    """
    name, sep, url = spec.partition("=")
    if not sep or "://" in name:
        name, url = "", spec
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--endpoint must be [NAME=]http(s)://HOST[:PORT][/v1], got {spec!r}")
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return EndpointDriver(name=name or f"http:{parts.netloc}", base_url=base)


@attrs.define  # not frozen: SystemDriver declares a plain `name` attribute
class EndpointDriver:
    """Runs a workload against an OpenAI-compatible server that is already running.

    Attributes:
        name: The system's name in the report.
        base_url: The API root, ending in ``/v1``.
        api_key: Sent as ``Authorization: Bearer`` when set.
        timeout: Seconds a single request may take.
    """

    name: str
    base_url: str
    api_key: str | None = None
    timeout: float = 600.0

    def _client(self) -> Any:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        return httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers(), timeout=self.timeout, limits=limits
        )

    def check(self) -> str | None:
        """``None`` if the endpoint answers ``GET /models``, else why not."""
        try:
            import httpx
        except ImportError:
            return "httpx is not installed (pip install 'twostroke[bench]')"
        try:
            reply = httpx.get(f"{self.base_url}/models", timeout=10, headers=self._headers())
        except httpx.HTTPError as error:
            return f"{self.base_url} does not answer: {type(error).__name__}: {error}"
        if reply.status_code != 200:
            return f"GET {self.base_url}/models answered {reply.status_code}"
        return None

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Send every request at its arrival time; report a client's view of the timings."""
        return anyio.run(self._run, workload)

    async def _run(self, workload: Workload) -> SystemResult:
        if workload.num_with_tools:  # tools want the chat endpoint; this sends token ids
            return SystemResult.unavailable(
                self.name, "requests that offer tools need /v1/chat/completions, which takes "
                "messages, not the workload's token ids",
            )  # fmt: skip
        async with self._client() as client:
            models = (await client.get("/models")).raise_for_status().json()
            served = models["data"][0]["id"]
            timings: list[RequestTiming | None] = [None] * len(workload.requests)
            start = anyio.current_time()

            async def one(index: int, request: BenchRequest) -> None:
                await anyio.sleep_until(start + workload.arrival(index))
                timings[index] = await _stream(client, served, request, start)

            async with anyio.create_task_group() as task_group:
                for index, request in enumerate(workload.requests):
                    task_group.start_soon(one, index, request)
            wall = anyio.current_time() - start
        done = [timing for timing in timings if timing is not None]
        return SystemResult(
            name=self.name,
            available=True,
            wall_seconds=wall,
            timings=tuple(done),
            extra={"endpoint": self.base_url, "served_model": served},
        )


async def _stream(client: Any, model: str, request: BenchRequest, start: float) -> RequestTiming:
    """One streamed completion; times are seconds since ``start``."""
    body = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.json_schema is not None:  # vLLM's field, which twostroke's server takes too
        body["structured_outputs"] = {"json": json.loads(request.json_schema)}
    arrived = anyio.current_time() - start
    chunk_times: list[float] = []
    output_tokens = 0
    end = arrived
    async with client.stream("POST", "/completions", json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            raise RuntimeError(f"the endpoint answered {reply.status_code}: {reply.text[:200]}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = anyio.current_time() - start
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            if event.get("usage"):
                output_tokens = int(event["usage"]["completion_tokens"])
            if any(choice.get("text") for choice in event.get("choices") or ()):
                chunk_times.append(now)
                end = now
    if not chunk_times or output_tokens < 1:
        raise RuntimeError("the endpoint streamed no text or reported no usage")
    # A server may send more text chunks than tokens (held-back text); ITL counts chunks.
    chunk_times = chunk_times[:output_tokens]
    chunk_times[-1] = end
    return RequestTiming(
        prompt_tokens=len(request.prompt_token_ids),
        output_tokens=output_tokens,
        start=arrived,
        first_token=chunk_times[0],
        end=end,
        chunk_times=tuple(chunk_times),
    )
