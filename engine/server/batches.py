"""OpenAI's Batch API, run online: ``/v1/files`` and ``/v1/batches`` over the serving engine.

A client uploads a JSONL file (``POST /v1/files``, ``purpose: "batch"``), one request a line
(``{"custom_id", "method": "POST", "url", "body"}``), and creates a batch of it (``POST
/v1/batches``: ``input_file_id``, ``endpoint`` ``/v1/chat/completions`` or
``/v1/completions``, ``completion_window: "24h"``). The batch's lines run on the same engine
that serves interactive traffic, in its idle capacity: each is answered by the endpoint's own
handler (the same msgspec body types, limits and answers), at the worst priority
(:data:`BATCH_PRIORITY`), at most ``batch_max_in_flight`` lines at once. When they are all
answered, the answers become an output file (status 200) and an error file (any other
status, and the lines refused before they ran), in OpenAI's batch output format: ``{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.

**Lifecycle.** ``validating`` (every line checked; a bad one is answered in the error file,
never a 500) → ``in_progress`` → ``finalizing`` (the files written) → ``completed``; a batch
whose input file is gone or holds no line is ``failed``; ``POST /v1/batches/{id}/cancel``
makes it ``cancelling``, then ``cancelled`` with the lines answered so far; one not done 24
hours after it was created is ``expired`` likewise. The lines not run of a cancelled or
expired batch are in its error file (``batch_cancelled``, ``batch_expired``).

**The bound on interactive traffic.** A batch line's engine requests rank ``1000 * N`` steps
(``N``: ``priority_aging_steps``, 64) behind an interactive one that arrives at the same step
(the scheduler's rank ``(priority * N + step, arrival)``), so a waiting batch request is
admitted before a waiting interactive one only once it has waited 64,000 steps longer, and
the runner keeps at most ``batch_max_in_flight`` lines (each at most ``max_choices`` engine
requests) submitted at once. Together: an interactive request waits at most as if that many
more requests had arrived before it (the engine's ``step_bound`` with that many more; each
batch request ends within its ``max_tokens``), and batch requests never fill the waiting
queue (``max_waiting_requests``) or the KV pool ahead of interactive traffic, whose requests
a decoding one preempts first (the largest rank).

**Durable.** Files, batches and each answered line are rows of the batch store
(:mod:`~twostroke.engine.server.batch_store`) as soon as they exist: a server restarted on
the same store resumes every open batch, keeping the lines answered and running the rest
again. :meth:`Batches.run` is the one task that runs batches, one at a time in the order
they were created; it lives in the server's task group
(:func:`~twostroke.engine.server.serve.serve` starts it), and cancelling it (the server's
shutdown) cancels the lines in flight and leaves the batch to resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import attrs
import msgspec
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Send

from twostroke.engine.config import ServerConfig
from twostroke.engine.server import protocol
from twostroke.engine.server.batch_store import BatchStore, BatchStoreError
from twostroke.engine.server.body import body_too_large, read_body
from twostroke.engine.server.errors import ApiError, invalid_request
from twostroke.engine.server.sse import send_json
from twostroke.states.params import MAX_PRIORITY

__all__ = ["BATCH_ENDPOINTS", "BATCH_PRIORITY", "COMPLETION_WINDOW", "Batches"]

#: The ``priority`` of every engine request of a batch: the worst there is, so interactive
#: requests (0 unless they say otherwise) are admitted first (see the module's docstring).
BATCH_PRIORITY = MAX_PRIORITY
#: The endpoints a batch may run, and the body type each line's ``body`` must be.
BATCH_ENDPOINTS: Mapping[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": protocol.ChatCompletionRequest,
    "/v1/completions": protocol.CompletionRequest,
}
#: The only completion window (OpenAI's): a batch not done this long after its creation
#: expires.
COMPLETION_WINDOW = "24h"
_WINDOW_SECONDS = 24 * 3600
#: Bytes a multipart upload may add around its file (boundaries, part headers, purpose).
_MULTIPART_OVERHEAD = 64 * 1024
#: Seconds before a line the engine's queue had no room for is tried again.
_RETRY_SECONDS = 1.0
#: OpenAI's bounds on ``metadata``: 16 pairs, keys of 64 characters, values of 512.
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512
_FILE_ID = re.compile(r"file-[0-9a-f]{32}")
_BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")
_CUSTOM_ID_CHARS = 512

logger = logging.getLogger("twostroke.server")


class _CreateBatch(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # the SDK's; output files never expire


class _Line(msgspec.Struct):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


@attrs.frozen
class _Request:
    """A valid line of a batch: its place in the file, its id and the body to run."""

    index: int
    custom_id: str
    body: bytes


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def _derived_file_id(batch_id: str, kind: str) -> str:
    # The same id each time a batch is finalized, so finalizing again after a restart
    # replaces its output file instead of leaving an orphan.
    return "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:32]


def _not_found(kind: str, given: str) -> ApiError:
    return ApiError(
        404, f"No {kind} found with id '{given[:100]}'.", type="invalid_request_error", code=None
    )


def _store_failed(exc: BatchStoreError) -> ApiError:
    return ApiError(500, f"{exc}", type="server_error", code="batch_store_failed")


def _line_error(index: int, custom_id: str | None, code: str, message: str) -> bytes:
    return msgspec.json.encode(
        {
            "id": _new_id("batch_req_"),
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": f"line {index + 1}: {message}"},
        }
    )


def validate_lines(
    content: bytes, endpoint: str, max_line_bytes: int
) -> tuple[list[_Request], list[tuple[int, bool, bytes]]]:
    """Check every line of a batch's input file.

    A blank line is skipped. A line is refused when it is longer than ``max_line_bytes``
    (the endpoint's ``max_body_bytes``), is not a JSON object of ``custom_id``, ``method``,
    ``url`` and ``body``, repeats an earlier line's ``custom_id``, is not a ``POST`` to the
    batch's ``endpoint``, asks to ``stream``, or has a body the endpoint's body type refuses.

    Returns:
        The valid lines, with :data:`BATCH_PRIORITY` set in their bodies, and an error
        record (line, ``False``, output line) for each refused one.
    """
    body_type = BATCH_ENDPOINTS[endpoint]
    valid: list[_Request] = []
    refused: list[tuple[int, bool, bytes]] = []
    seen: set[str] = set()
    for index, raw in enumerate(content.split(b"\n")):
        if not raw.strip():
            continue

        def refuse(code: str, message: str, custom_id: str | None = None) -> None:
            refused.append((index, False, _line_error(index, custom_id, code, message)))  # noqa: B023

        if len(raw) > max_line_bytes:
            refuse(
                "line_too_large",
                f"a line may have at most {max_line_bytes} bytes, this one has {len(raw)}",
            )
            continue
        try:
            line = msgspec.json.decode(raw, type=_Line)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            refuse(
                "invalid_json",
                f"not a batch request object ({{custom_id, method, url, body}}): {exc}",
            )
            continue
        custom_id = line.custom_id
        if not custom_id or len(custom_id) > _CUSTOM_ID_CHARS:
            refuse(
                "invalid_custom_id",
                f"custom_id must have 1 to {_CUSTOM_ID_CHARS} characters, got {len(custom_id)}",
                custom_id[:_CUSTOM_ID_CHARS],
            )
            continue
        if custom_id in seen:
            refuse(
                "duplicate_custom_id",
                f"custom_id {custom_id!r} is on an earlier line "
                "too; each must be unique in its batch",
                custom_id,
            )
            continue
        seen.add(custom_id)
        if line.method != "POST":
            refuse("invalid_method", f"method must be 'POST', got {line.method[:20]!r}", custom_id)
            continue
        if line.url != endpoint:
            refuse(
                "invalid_url",
                f"url must be the batch's endpoint {endpoint!r}, got {line.url[:100]!r}",
                custom_id,
            )
            continue
        if line.body.get("stream") not in (None, False):
            refuse(
                "invalid_request",
                "stream is not allowed in a batch: each answer is one line of the output file",
                custom_id,
            )
            continue
        body = msgspec.json.encode(line.body | {"priority": BATCH_PRIORITY})
        try:
            protocol.decode_body(body, body_type)
        except ApiError as exc:
            refuse("invalid_request", f"body: {exc.message}", custom_id)
            continue
        valid.append(_Request(index, custom_id, body))
    return valid, refused


class Batches:
    """The handlers of ``/v1/files`` and ``/v1/batches``, and the task that runs batches.

    Args:
        store: Where files, batches and answers are kept; the caller closes it.
        owner: The namespace of this server's API key
            (:func:`~twostroke.engine.server.response_store.owner_of`).
        endpoints: The ASGI endpoint of each path of :data:`BATCH_ENDPOINTS`, which
            answers a line as it answers a request (errors in OpenAI's shape, no
            authentication).
        config: The server's limits: ``batch_max_file_bytes`` (the largest upload, in
            bytes), ``batch_max_lines`` (the most lines of an upload),
            ``batch_max_in_flight`` (the most lines of batches submitted to the engine at
            once) and ``max_body_bytes`` (the largest line, as the endpoints' largest body).
        model: The served model's name (each batch's ``model``).
        clock: Seconds since the epoch (``time.time``).
    """

    def __init__(
        self,
        store: BatchStore,
        owner: str,
        endpoints: Mapping[str, ASGIApp],
        config: ServerConfig,
        *,
        model: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.owner = owner
        self.endpoints = endpoints
        self.config = config
        self.model = model
        self._clock = clock
        self._wake = anyio.Event()
        # Held by every read-modify-write of a batch's record (the runner's and a cancel's).
        self._lock = anyio.Lock()
        self._running: tuple[str, anyio.CancelScope] | None = None

    def _now(self) -> int:
        return int(self._clock())

    # --- files ------------------------------------------------------------------------------

    async def upload(self, request: Request, receive: Receive, send: Send) -> None:
        """``POST /v1/files``: a multipart form of ``purpose`` (``batch``) and ``file``."""
        limit = self.config.batch_max_file_bytes + _MULTIPART_OVERHEAD
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise body_too_large(limit, f"and the request declares Content-Length: {declared}")

        async def bounded() -> AsyncGenerator[bytes, None]:
            size = 0
            async with contextlib.aclosing(request.stream()) as stream:
                async for chunk in stream:
                    size += len(chunk)
                    if size > limit:
                        raise body_too_large(limit, f"and the body sent at least {size} bytes")
                    yield chunk

        parser = MultiPartParser(request.headers, bounded(), max_files=1, max_fields=4)
        try:
            form = await parser.parse()
        except MultiPartException as exc:
            raise invalid_request(
                f"the upload is not a valid multipart form: {exc.message}"
            ) from None
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise invalid_request(
                    f"purpose must be 'batch' (the only one this server keeps), got "
                    f"{str(purpose)[:50]!r}",
                    param="purpose",
                )
            if upload is None or isinstance(upload, str):
                raise invalid_request("file must be a file part of the form", param="file")
            content = await upload.read()
            filename = (upload.filename or "upload.jsonl")[:255]
        finally:
            await form.close()
        if len(content) > self.config.batch_max_file_bytes:
            raise invalid_request(
                f"file may have at most {self.config.batch_max_file_bytes} bytes "
                f"(batch_max_file_bytes), got {len(content)}",
                param="file",
            )
        lines = content.count(b"\n") + (not content.endswith(b"\n"))
        if lines > self.config.batch_max_lines:
            raise invalid_request(
                f"file may have at most {self.config.batch_max_lines} lines "
                f"(batch_max_lines), got {lines}",
                param="file",
            )
        record = {
            "id": _new_id("file-"),
            "object": "file",
            "bytes": len(content),
            "created_at": self._now(),
            "filename": filename,
            "purpose": "batch",
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        try:
            stored = await self.store.put_file(self.owner, record, content)
        except BatchStoreError as exc:
            raise _store_failed(exc) from None
        if not stored:
            raise invalid_request(
                f"the server's files would pass {self.store.max_bytes} bytes "
                "(batch_store_max_bytes): delete files to make room",
                param="file",
                code="storage_full",
            )
        await send_json(send, 200, record)

    async def _file(self, request: Request) -> tuple[str, dict[str, Any]]:
        file_id = request.path_params["file_id"]
        if not _FILE_ID.fullmatch(file_id):  # refused before the database is asked
            raise _not_found("file", file_id)
        try:
            record = await self.store.file(self.owner, file_id)
        except BatchStoreError as exc:
            raise _store_failed(exc) from None
        if record is None:
            raise _not_found("file", file_id)
        return file_id, record

    async def retrieve_file(self, request: Request, receive: Receive, send: Send) -> None:
        """``GET /v1/files/{file_id}``: the file object."""
        await send_json(send, 200, (await self._file(request))[1])

    async def file_content(self, request: Request, receive: Receive, send: Send) -> None:
        """``GET /v1/files/{file_id}/content``: the file's bytes."""
        file_id, _ = await self._file(request)
        try:
            content = await self.store.file_content(self.owner, file_id)
        except BatchStoreError as exc:
            raise _store_failed(exc) from None
        if content is None:  # deleted between the two reads
            raise _not_found("file", file_id)
        headers = [
            (b"content-type", b"application/octet-stream"),
            (b"content-length", str(len(content)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    async def delete_file(self, request: Request, receive: Receive, send: Send) -> None:
        """``DELETE /v1/files/{file_id}``: a batch that has not read it yet fails."""
        file_id, _ = await self._file(request)
        try:
            await self.store.delete_file(self.owner, file_id)
        except BatchStoreError as exc:
            raise _store_failed(exc) from None
        await send_json(send, 200, {"id": file_id, "object": "file", "deleted": True})

    # --- batches ----------------------------------------------------------------------------

    async def create(self, request: Request, receive: Receive, send: Send) -> None:
        """``POST /v1/batches``."""
        body = protocol.decode_body(
            await read_body(request, self.config.max_body_bytes), _CreateBatch
        )
        if body.endpoint not in BATCH_ENDPOINTS:
            raise invalid_request(
                f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, "
                f"got {body.endpoint[:100]!r}",
                param="endpoint",
            )
        if body.completion_window != COMPLETION_WINDOW:
            raise invalid_request(
                f"completion_window must be {COMPLETION_WINDOW!r}, got "
                f"{body.completion_window[:20]!r}",
                param="completion_window",
            )
        metadata = body.metadata or {}
        if len(metadata) > _METADATA_PAIRS or any(
            len(key) > _METADATA_KEY or len(value) > _METADATA_VALUE
            for key, value in metadata.items()
        ):
            raise invalid_request(
                f"metadata may have at most {_METADATA_PAIRS} pairs, keys of "
                f"{_METADATA_KEY} characters and values of {_METADATA_VALUE}",
                param="metadata",
            )
        if not _FILE_ID.fullmatch(body.input_file_id):
            raise invalid_request(
                f"No file found with id '{body.input_file_id[:100]}'.", param="input_file_id"
            )
        try:
            file = await self.store.file(self.owner, body.input_file_id)
            if file is None or file["purpose"] != "batch":
                raise invalid_request(
                    f"input_file_id must name an uploaded file of purpose 'batch', got "
                    f"'{body.input_file_id}'",
                    param="input_file_id",
                )
            now = self._now()
            record: dict[str, Any] = {
                "id": _new_id("batch_"),
                "object": "batch",
                "endpoint": body.endpoint,
                "errors": None,
                "input_file_id": body.input_file_id,
                "completion_window": COMPLETION_WINDOW,
                "status": "validating",
                "output_file_id": None,
                "error_file_id": None,
                "created_at": now,
                "in_progress_at": None,
                "expires_at": now + _WINDOW_SECONDS,
                "finalizing_at": None,
                "completed_at": None,
                "failed_at": None,
                "expired_at": None,
                "cancelling_at": None,
                "cancelled_at": None,
                "request_counts": {"total": 0, "completed": 0, "failed": 0},
                "metadata": body.metadata,
                "model": self.model,
            }
            await self.store.put_batch(self.owner, record)
        except BatchStoreError as exc:
            raise _store_failed(exc) from None
        self._wake.set()
        await send_json(send, 200, record)

    async def _batch(self, request: Request) -> dict[str, Any]:
        batch_id = request.path_params["batch_id"]
        if not _BATCH_ID.fullmatch(batch_id):  # refused before the database is asked
            raise _not_found("batch", batch_id)
        try:
            record = await self.store.batch(self.owner, batch_id)
        except BatchStoreError as exc:
            raise _store_failed(exc) from None
        if record is None:
            raise _not_found("batch", batch_id)
        return record

    async def retrieve(self, request: Request, receive: Receive, send: Send) -> None:
        """``GET /v1/batches/{batch_id}``."""
        await send_json(send, 200, await self._batch(request))

    async def cancel(self, request: Request, receive: Receive, send: Send) -> None:
        """``POST /v1/batches/{batch_id}/cancel``: ``cancelling``, then ``cancelled``."""
        async with self._lock:
            record = await self._batch(request)
            if record["status"] in ("validating", "in_progress"):
                record |= {"status": "cancelling", "cancelling_at": self._now()}
                try:
                    await self.store.put_batch(self.owner, record)
                except BatchStoreError as exc:
                    raise _store_failed(exc) from None
                if self._running is not None and self._running[0] == record["id"]:
                    self._running[1].cancel()
                self._wake.set()
            elif record["status"] != "cancelling":
                raise invalid_request(
                    f"a batch of status {record['status']!r} cannot be cancelled",
                    code="batch_not_cancellable",
                )
        await send_json(send, 200, record)

    async def list_batches(self, request: Request, receive: Receive, send: Send) -> None:
        """``GET /v1/batches``: ``limit`` 1 to 100 (20), ``after`` a batch id; newest first."""
        query = request.query_params
        limit_text, after = query.get("limit", "20"), query.get("after")
        if not (limit_text.isdigit() and 1 <= int(limit_text) <= 100):
            raise invalid_request(
                f"limit must be an integer from 1 to 100, got {limit_text[:20]!r}", param="limit"
            )
        if after is not None and not _BATCH_ID.fullmatch(after):
            raise invalid_request(f"after must be a batch id, got {after[:100]!r}", param="after")
        try:
            page, more = await self.store.batches(self.owner, limit=int(limit_text), after=after)
        except BatchStoreError as exc:
            raise _store_failed(exc) from None
        await send_json(
            send,
            200,
            {
                "object": "list",
                "data": page,
                "has_more": more,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
            },
        )

    # --- the runner -------------------------------------------------------------------------

    async def run(self) -> None:
        """Run every open batch, oldest first, then wait for more; never returns.

        Start it in the server's task group. Cancelling it cancels the lines in flight
        (their engine requests too); what was answered is kept, and a server started on the
        same store resumes the batch.
        """
        while True:
            wake = self._wake = anyio.Event()  # made before the read: no wake-up is lost
            try:
                for owner, batch_id in await self.store.open_batches():
                    await self._run_batch(owner, batch_id)
            except BatchStoreError:  # the server serves on; the next batch or cancel retries
                logger.exception("batches paused: the batch store failed")
            await wake.wait()

    async def _update(self, batch_id: str, owner: str, **fields: Any) -> dict[str, Any]:
        async with self._lock:
            record = await self.store.batch(None, batch_id)
            assert record is not None, batch_id  # batches are never deleted
            if fields.get("status") == "in_progress" and record["status"] != "validating":
                # Cancelled meanwhile: the status a cancel set stays.
                fields = {
                    name: value
                    for name, value in fields.items()
                    if name not in ("status", "in_progress_at")
                }
            record |= fields
            await self.store.put_batch(owner, record)
            return record

    async def _run_batch(self, owner: str, batch_id: str) -> None:
        record = await self.store.batch(None, batch_id)
        assert record is not None, batch_id
        if record["status"] in ("validating", "in_progress"):
            content = await self.store.file_content(owner, record["input_file_id"])
            if content is None or not content.strip():
                reason = "was deleted" if content is None else "holds no line"
                await self._update(
                    batch_id,
                    owner,
                    status="failed",
                    failed_at=self._now(),
                    errors={
                        "object": "list",
                        "data": [
                            {
                                "code": "invalid_file",
                                "param": "input_file_id",
                                "line": None,
                                "message": f"the input file {record['input_file_id']} {reason}",
                            }
                        ],
                    },
                )
                return
            valid, refused = await anyio.to_thread.run_sync(
                validate_lines, content, record["endpoint"], self.config.max_body_bytes
            )
            await self.store.put_results(batch_id, refused)
            total = {"total": len(valid) + len(refused), "completed": 0, "failed": 0}
            record = await self._update(
                batch_id,
                owner,
                status="in_progress",
                in_progress_at=record["in_progress_at"] or self._now(),
                request_counts=total,
            )
            if record["status"] == "in_progress":
                answered = await self.store.answered(batch_id)
                todo = [line for line in valid if line.index not in answered]
                with anyio.CancelScope() as scope:
                    self._running = (batch_id, scope)
                    try:
                        await self._run_lines(owner, batch_id, record, todo)
                    finally:
                        self._running = None
            await self._close_unanswered(batch_id, valid)
        await self._finalize(owner, batch_id)

    async def _run_lines(
        self, owner: str, batch_id: str, record: dict[str, Any], todo: list[_Request]
    ) -> None:
        endpoint = self.endpoints[record["endpoint"]]
        seats = anyio.Semaphore(self.config.batch_max_in_flight)

        async def answer(line: _Request) -> None:
            try:
                while True:
                    status, body = await _call(endpoint, record["endpoint"], line.body)
                    error = body.get("error") if isinstance(body, dict) else None
                    if (
                        status != 503
                        or not isinstance(error, dict)
                        or (error.get("code") != "engine_overloaded")
                    ):
                        break
                    await anyio.sleep(_RETRY_SECONDS)  # no room in the queue: not an answer
                output = msgspec.json.encode(
                    {
                        "id": _new_id("batch_req_"),
                        "custom_id": line.custom_id,
                        "response": {
                            "status_code": status,
                            "request_id": secrets.token_hex(16),
                            "body": body,
                        },
                        "error": None,
                    }
                )
                await self.store.put_results(batch_id, [(line.index, status == 200, output)])
            finally:
                seats.release()

        async with anyio.create_task_group() as task_group:
            for line in todo:
                await seats.acquire()
                if self._clock() >= record["expires_at"]:
                    seats.release()
                    await self._update(batch_id, owner, status="expired", expired_at=self._now())
                    break
                task_group.start_soon(answer, line)

    async def _close_unanswered(self, batch_id: str, valid: list[_Request]) -> None:
        """Answer in the error file the lines of a cancelled or expired batch not run."""
        record = await self.store.batch(None, batch_id)
        assert record is not None
        if record["status"] not in ("cancelling", "expired"):
            return
        code = "batch_expired" if record["status"] == "expired" else "batch_cancelled"
        answered = await self.store.answered(batch_id)
        await self.store.put_results(
            batch_id,
            [
                (
                    line.index,
                    False,
                    _line_error(
                        line.index,
                        line.custom_id,
                        code,
                        f"not run: the batch was {record['status']}",
                    ),
                )
                for line in valid
                if line.index not in answered
            ],
        )

    async def _finalize(self, owner: str, batch_id: str) -> None:
        record = await self.store.batch(None, batch_id)
        assert record is not None
        ending = {"cancelling": "cancelled", "expired": "expired"}.get(
            record["status"], "completed"
        )
        if ending == "completed" and record["status"] != "finalizing":
            await self._update(batch_id, owner, status="finalizing", finalizing_at=self._now())
        output, errors = await self.store.results(batch_id)
        ids: dict[str, str | None] = {}
        for kind, content in (("output", output), ("error", errors)):
            ids[kind] = None
            if content:
                ids[kind] = _derived_file_id(batch_id, kind)
                await self.store.put_file(
                    owner,
                    {
                        "id": ids[kind],
                        "object": "file",
                        "bytes": len(content),
                        "created_at": self._now(),
                        "filename": f"{batch_id}_{kind}.jsonl",
                        "purpose": "batch_output",
                        "status": "processed",
                        "expires_at": None,
                        "status_details": None,
                    },
                    content,
                    bounded=False,
                )
        await self._update(
            batch_id,
            owner,
            status=ending,
            **{f"{ending}_at": self._now()},
            output_file_id=ids["output"],
            error_file_id=ids["error"],
        )


async def _call(endpoint: ASGIApp, path: str, body: bytes) -> tuple[int, Any]:
    """Answer ``body`` with ``endpoint`` as an HTTP request to ``path`` would be: its status
    and its JSON body. The caller never disconnects, so it waits for the whole answer."""
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()  # the caller never leaves; cancelled when it is done
        raise AssertionError("unreachable")

    status = 500
    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "http_version": "1.1",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": None,
        "server": None,
    }
    await endpoint(scope, receive, send)
    try:
        return status, msgspec.json.decode(b"".join(chunks))
    except msgspec.DecodeError:
        return status, {"error": {"message": "the answer was not JSON", "type": "server_error"}}
