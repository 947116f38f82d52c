"""The Batch API through the official client: files, batches, their output and error files,
cancel, a batch resumed by a new server on the same store, hostile lines, and interactive
requests admitted before a batch's."""

from __future__ import annotations

import io
import json
import pathlib
import threading
from typing import Any

import anyio
import httpx
import openai
import pytest

from twostroke.engine.config import ServerConfig
from twostroke.engine.runners.toy import ToyRunner
from twostroke.engine.server.batch_store import MEMORY
from twostroke.engine.server.batches import BATCH_PRIORITY

from .conftest import served

pytestmark = pytest.mark.anyio

STORE = ServerConfig(batches_store=MEMORY)
CHAT = "/v1/chat/completions"


def line(custom_id: str, prompt: str, *, url: str = CHAT, **body: Any) -> dict[str, Any]:
    if url == CHAT:
        body = {"model": "toy", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 3} | body  # fmt: skip
    else:
        body = {"model": "toy", "prompt": prompt, "max_tokens": 3} | body
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(*lines: dict[str, Any] | bytes) -> bytes:
    return b"".join(
        (item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in lines
    )


async def upload(client: openai.AsyncOpenAI, content: bytes) -> str:
    file = await client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    assert (file.object, file.purpose, file.bytes) == ("file", "batch", len(content))
    return file.id


async def finished(client: openai.AsyncOpenAI, batch_id: str) -> Any:
    """The batch once it ended, polled as a client would (each poll is a checkpoint)."""
    with anyio.fail_after(30):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "cancelled", "expired"):
                return batch
            await anyio.sleep(0.01)  # a poll interval, not a wait for a result


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    content = await client.files.content(file_id)
    return [json.loads(text) for text in content.text.splitlines()]


async def test_a_batch_runs_through_the_official_client_from_upload_to_output() -> None:
    async with served(server_config=STORE) as server:
        client = server.client
        content = jsonl(line("a", "Hello"), line("b", "Bye", max_tokens=2))
        file_id = await upload(client, content)
        assert (await client.files.retrieve(file_id)).id == file_id
        assert (await client.files.content(file_id)).read() == content
        batch = await client.batches.create(
            input_file_id=file_id, endpoint=CHAT, completion_window="24h",
            metadata={"job": "nightly"},
        )  # fmt: skip
        assert (batch.status, batch.endpoint, batch.metadata) == ("validating", CHAT,
                                                                  {"job": "nightly"})  # fmt: skip
        done = await finished(client, batch.id)
        assert done.status == "completed"
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (2, 2)
        assert done.error_file_id is None
        assert done.in_progress_at is not None
        assert done.finalizing_at is not None
        assert done.completed_at is not None
        output = await lines_of(client, done.output_file_id)
        assert [item["custom_id"] for item in output] == ["a", "b"]
        for item in output:
            assert item["error"] is None
            assert item["id"].startswith("batch_req_")
            assert item["response"]["status_code"] == 200
            assert item["response"]["body"]["object"] == "chat.completion"
        assert output[1]["response"]["body"]["usage"]["completion_tokens"] <= 2
        # Each line ran at the batch's priority, through the chat endpoint's handler.
        assert [params.priority for _, params in server.engine.submitted] == [BATCH_PRIORITY] * 2
        page = await client.batches.list(limit=1)
        assert [item.id for item in page.data] == [batch.id]
        deleted = await client.files.delete(file_id)
        assert deleted.deleted is True
        with pytest.raises(openai.NotFoundError, match="No file found"):
            await client.files.retrieve(file_id)


async def test_hostile_lines_are_answered_in_the_error_file_and_the_rest_run() -> None:
    async with served(
        server_config=ServerConfig(batches_store=MEMORY, max_body_bytes=4096)
    ) as server:
        client = server.client
        content = jsonl(
            line("ok", "Hi"),
            b"{not json",
            line("ok", "again"),  # a repeated custom_id
            line("get", "Hi") | {"method": "GET"},
            line("url", "Hi", url="/v1/completions"),  # not the batch's endpoint
            line("stream", "Hi", stream=True),
            line("typed", "Hi", max_tokens="many"),
            line("big", "x" * 5000),
            line("model", "Hi", model="gpt-4"),  # valid, and answered with a 404
            b"[]",
            line("", "Hi"),
        )
        file_id = await upload(client, content)
        batch = await client.batches.create(
            input_file_id=file_id, endpoint=CHAT, completion_window="24h"
        )
        done = await finished(client, batch.id)
        assert done.status == "completed"
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed,
                done.request_counts.failed) == (11, 1, 10)  # fmt: skip
        output = await lines_of(client, done.output_file_id)
        assert [item["custom_id"] for item in output] == ["ok"]
        errors = await lines_of(client, done.error_file_id)
        codes = [(item["custom_id"], (item["error"] or {}).get("code")) for item in errors]
        assert codes == [
            (None, "invalid_json"), ("ok", "duplicate_custom_id"), ("get", "invalid_method"),
            ("url", "invalid_url"), ("stream", "invalid_request"), ("typed", "invalid_request"),
            (None, "line_too_large"), ("model", None), (None, "invalid_json"),
            ("", "invalid_custom_id"),
        ]  # fmt: skip
        messages = [(item["error"] or {}).get("message", "") for item in errors]
        assert messages[0].startswith("line 2: not a batch request object")
        assert "line 7: body: Expected `int | null`, got `str` - at `$.max_tokens`" in messages[5]
        assert "a line may have at most 4096 bytes" in messages[6]
        assert errors[7]["response"]["status_code"] == 404
        assert errors[7]["response"]["body"]["error"]["code"] == "model_not_found"
        assert len(server.engine.submitted) == 1


async def test_bad_requests_for_files_and_batches_are_400s_naming_the_field() -> None:
    async with served(
        server_config=ServerConfig(batches_store=MEMORY, batch_max_lines=2)
    ) as server:
        client = server.client
        with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
            await client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="vision")
        with pytest.raises(
            openai.BadRequestError, match=r"at most 2 lines \(batch_max_lines\), got 3"
        ):
            await client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n{}\n{}")), purpose="batch")
        file_id = await upload(client, jsonl(line("a", "Hi")))
        for fields, message in [
            ({"endpoint": "/v1/embeddings"}, "endpoint must be one of"),
            ({"completion_window": "1h"}, "completion_window must be '24h', got '1h'"),
            ({"input_file_id": "file-" + "0" * 32}, "must name an uploaded file"),
        ]:
            given = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
            with pytest.raises(openai.BadRequestError, match=message):
                await client.batches.create(**(given | fields))  # type: ignore[arg-type]
        for wanted in ("batch_1", "batch_' OR 1=1 --", "x" * 5000):
            reply = await server.http.get(f"/v1/batches/{wanted}")
            assert reply.status_code == 404, reply.text
        # Without a multipart form, or (below) without an Authorization header: refused.
        reply = await server.http.post("/v1/files", json={"purpose": "batch"})
        assert reply.status_code == 415
    async with served(api_key=None, server_config=STORE) as server:
        # A multipart form as a page could post it, in one piece (a refusal closes the
        # connection, which a body sent in pieces would meet half-sent).
        form = httpx.Request("POST", "http://x", data={"purpose": "batch"},
                             files={"file": ("a.jsonl", b"{}\n")})  # fmt: skip
        headers = {"content-type": form.headers["content-type"]}
        reply = await server.http.post("/v1/files", content=form.read(), headers=headers)
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["code"] == "missing_authorization"
        headers |= {"authorization": "Bearer any"}  # any value: the server has no key
        reply = await server.http.post("/v1/files", content=form.read(), headers=headers)
        assert reply.status_code == 200, reply.text


class GatedToyRunner(ToyRunner):
    """A toy runner whose steps wait (in the engine's worker thread) until the gate opens,
    and which records the prompt of each request as it is admitted (its first prefill)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.gate = threading.Event()
        self.admitted: list[bytes] = []

    def execute(self, plan: Any) -> Any:
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        for row in plan.requests:
            if row.start == 0:
                self.admitted.append(bytes(row.token_ids[:12]))
        return super().execute(plan)


async def test_a_cancelled_batch_keeps_what_was_answered() -> None:
    runner = GatedToyRunner()
    config = ServerConfig(batches_store=MEMORY, batch_max_in_flight=1)
    async with served(runner=runner, server_config=config, max_num_seqs=1) as server:
        client = server.client
        file_id = await upload(client, jsonl(*(line(f"n{index}", f"p{index}")
                                               for index in range(3))))  # fmt: skip
        batch = await client.batches.create(
            input_file_id=file_id, endpoint=CHAT, completion_window="24h"
        )
        await server.engine.wait_submitted(1)  # the first line waits in the gated step
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling"
        runner.gate.set()
        done = await finished(client, batch.id)
        with pytest.raises(openai.BadRequestError, match="of status 'cancelled' cannot be"):
            await client.batches.cancel(batch.id)
        assert len(server.engine.submitted) == 1  # batch_max_in_flight held the others back
    assert (done.status, done.cancelled_at is not None) == ("cancelled", True)
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.failed) == (3, 3)
    async with served(server_config=STORE) as server:  # the store was in memory: gone
        with pytest.raises(openai.NotFoundError):
            await server.client.batches.retrieve(batch.id)


async def test_a_batch_interrupted_by_a_restart_resumes_keeping_its_answers(
    tmp_path: pathlib.Path,
) -> None:
    # One line at a time; the second is long (3,000 steps of at least 3 ms): the first
    # server ends while it runs, and a new server on the same file finishes the batch.
    path = str(tmp_path / "state" / "batches.sqlite3")
    config = ServerConfig(batches_store=path, batch_max_in_flight=1)
    long = {"max_tokens": 3000, "ignore_eos": True}
    content = jsonl(line("n0", "p0"), line("n1", "p1", **long), line("n2", "p2"))
    async with served(runner=ToyRunner(latency=0.003), server_config=config,
                      check_clean=False) as server:  # fmt: skip
        client = server.client
        file_id = await upload(client, content)
        batch = await client.batches.create(
            input_file_id=file_id, endpoint=CHAT, completion_window="24h"
        )
        await server.engine.wait_submitted(2)  # the first line was answered, and stored
        counts = (await client.batches.retrieve(batch.id)).request_counts
    assert counts is not None
    assert (counts.total, counts.completed) == (3, 1)
    async with served(server_config=config) as server:  # a new server, a new engine
        done = await finished(server.client, batch.id)
        rerun = [prompt[0]["content"] for prompt, _ in server.engine.submitted]
        output = await lines_of(server.client, done.output_file_id)
    assert done.status == "completed"
    assert [item["custom_id"] for item in output] == ["n0", "n1", "n2"]
    assert rerun == ["p1", "p2"]  # the first line's answer was kept; the others ran again
    assert len(output[1]["response"]["body"]["choices"][0]["message"]["content"]) > 0
    assert oct((await anyio.Path(path).stat()).st_mode & 0o777) == "0o600"


async def test_interactive_requests_are_admitted_before_waiting_batch_ones() -> None:
    # One seat, taken by an interactive request whose step waits at the gate; two batch
    # lines are submitted, then an interactive request: it is admitted before both.
    runner = GatedToyRunner()
    async with served(runner=runner, server_config=STORE, max_num_seqs=1) as server:
        client = server.client
        async with anyio.create_task_group() as group:
            group.start_soon(partial_completion, client, "first")
            await server.engine.wait_submitted(1)
            lines = [line(name, f"batch-{name}", url="/v1/completions") for name in "ab"]
            file_id = await upload(client, jsonl(*lines))
            batch = await client.batches.create(
                input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
            )
            await server.engine.wait_submitted(3)
            group.start_soon(partial_completion, client, "second")
            await server.engine.wait_submitted(4)
            runner.gate.set()
        assert (await finished(client, batch.id)).status == "completed"
    assert [prompt[:6] for prompt in runner.admitted] == [
        b"first", b"second", b"batch-", b"batch-"]  # fmt: skip


async def partial_completion(client: openai.AsyncOpenAI, prompt: str) -> None:
    await client.completions.create(model="toy", prompt=prompt, max_tokens=2)
