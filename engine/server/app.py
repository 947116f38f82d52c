"""The OpenAI-compatible ASGI application over any engine surface.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``,
``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``
(:mod:`~twostroke.engine.server.responses`), ``POST /v1/files``, ``GET`` and ``DELETE
/v1/files/{id}``, ``GET /v1/files/{id}/content``, ``POST`` and ``GET /v1/batches``, ``GET
/v1/batches/{id}``, ``POST /v1/batches/{id}/cancel`` (:mod:`~twostroke.engine.server.batches`),
``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Anthropic's, :mod:`~twostroke.engine.server.messages`,
whose errors are in Anthropic's shape), ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``; any other path is a 404 that lists
them. Each endpoint is a plain ASGI callable (not a Starlette request/response function)
because it must own the ``receive`` channel once the body is read: that is where a client's
disconnect arrives. A body is read under a size limit (:mod:`~twostroke.engine.server.body`):
a larger one is a 413.

What one request may ask of the engine is checked from its body alone, before any prompt is
tokenized (the limits are a :class:`~twostroke.engine.config.ServerConfig`): at most
``max_choices`` choices (prompts × ``n``, a 400), sampling parameters within
:class:`~twostroke.states.params.SamplingParams`' caps (a 400 naming the field), and room in
the waiting queue for all of its choices (``max_waiting_requests``: a 503 with
``Retry-After``). A request's choices are queued whole or not at all. The prompts then go to
the engine as given: the engine tokenizes each once and checks its length, and a prompt too
long for the context is a 400 in OpenAI's words, from the numbers of the engine's
``RequestRejected`` (the server never tokenizes a prompt itself to check it). Nothing slow
runs on the event loop: a prompt is rendered and tokenized in a worker thread of the engine's
(``EngineSurface.prepare``), a conversation with tools through the chat template's own
``tools`` in one of the server's (:data:`RENDER_THREADS`), and the waiting queue is asked
again for all of a request's choices once they are, right before they are queued.

With an API key, every route wants ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``,
as Anthropic's clients send it) except ``/health`` and ``/metrics``, which stay open for
probes and scrapers.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from twostroke.engine.config import ServerConfig
from twostroke.engine.errors import EngineError, EngineOverloaded
from twostroke.engine.server import protocol
from twostroke.engine.server.batch_store import BatchStore, default_batches_path
from twostroke.engine.server.batches import Batches
from twostroke.engine.server.body import read_body
from twostroke.engine.server.chat_service import ChatService
from twostroke.engine.server.errors import (
    ApiError,
    anthropic_error,
    api_error_from,
    invalid_request,
)
from twostroke.engine.server.generation import (
    ChatFormat,
    CompletionFormat,
    Format,
    Generation,
)
from twostroke.engine.server.guards import ANTHROPIC_PATHS, Guards, ServerShutdown
from twostroke.engine.server.messages import Messages
from twostroke.engine.server.metrics import ServerMetrics
from twostroke.engine.server.reasoning import (
    check_no_constraint,
    checked_template_kwargs,
    server_reasoning_format,
)
from twostroke.engine.server.response_store import ResponseStore, default_store_path, owner_of
from twostroke.engine.server.responses import Responses
from twostroke.engine.server.sse import Disconnected, EventSender, send_json, until_disconnect
from twostroke.engine.server.structured import OutputConstraint, output_constraint, strict_body
from twostroke.engine.surface import EngineSurface
from twostroke.engine.text.chat_template import ChatTemplateKwargsError
from twostroke.engine.text.reasoning import ReasoningFormat
from twostroke.engine.text.tokenizer import ChatTemplateError
from twostroke.engine.tools.formats import (
    GENERIC,
    ToolFormat,
    ToolSpec,
    tokenizer_tool_format,
)
from twostroke.engine.tools.formats import (
    tool_format as named_tool_format,
)
from twostroke.engine.tools.prompt import Turn, render_prompt
from twostroke.engine.tools.template import ToolTemplate, native_template, tool_prompt
from twostroke.states.params import SamplingParams
from twostroke.states.prompts import Prompt

__all__ = ["RENDER_THREADS", "batch_store_of", "build_app", "response_store_of"]

#: Worker threads the server renders conversations with tools in, at most, at once (through
#: the chat template's own ``tools``, to token ids: a template and a tokenizer's work, bounded
#: by the template's limits but not by the engine's, whose threads tokenize the rest). As
#: many as the engine's (``TOKENIZER_THREADS``).
RENDER_THREADS = 2

logger = logging.getLogger("twostroke.server")

_Handler = Callable[[Request, Receive, Send], Awaitable[None]]


class _Endpoint:
    """An ASGI endpoint: authentication, and any error turned into OpenAI's shape (or, for
    Anthropic's routes, Anthropic's: :func:`~twostroke.engine.server.errors.anthropic_error`).
    """

    def __init__(self, handler: _Handler, *, api_key: str | None, anthropic: bool = False) -> None:
        self._handler = handler
        self._api_key = None if api_key is None else api_key.encode()
        self._anthropic = anthropic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        request = Request(scope, receive)
        try:
            self._authenticate(request)
            await self._handler(request, receive, tracked_send)
        except (ClientDisconnect, Disconnected):
            return  # nobody is listening; the engine requests were settled by the handler
        except Exception as exc:
            error = api_error_from(exc)
            if error.status >= 500 and not isinstance(exc, EngineError):
                logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                status, body = anthropic_error(error) if self._anthropic else (
                    error.status, error.body())  # fmt: skip
                with contextlib.suppress(OSError):  # a client that left gets no answer
                    await send_json(tracked_send, status, body, error.headers)

    def _authenticate(self, request: Request) -> None:
        if self._api_key is None:
            return
        given = request.headers.get("authorization")
        if given is None and "x-api-key" in request.headers:  # Anthropic's clients' header
            scheme, token = "bearer", request.headers["x-api-key"]
        else:
            scheme, _, token = (given or "").partition(" ")
        # As bytes: compare_digest refuses str with non-ASCII characters (a 500 it was), and
        # header values arrive as latin-1, so any byte decodes and encodes back as itself.
        token_bytes = token.strip().encode("latin-1")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token_bytes, self._api_key):
            raise ApiError(
                401,
                "Incorrect API key provided: pass it as 'Authorization: Bearer <key>' (or "
                "'x-api-key: <key>').",
                type="invalid_request_error",
                code="invalid_api_key",
            )


class _OpenAI:
    """The handlers, sharing one engine, its metrics and the server's settings and limits."""

    def __init__(
        self,
        engine: EngineSurface,
        metrics: ServerMetrics,
        config: ServerConfig,
        *,
        tool_format: ToolFormat = GENERIC,
        tool_template: ToolTemplate | None = None,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.config = config
        self.max_choices = config.max_choices
        if config.max_waiting_requests is not None:  # more could never be queued
            self.max_choices = min(self.max_choices, config.max_waiting_requests)
        self.tool_format = tool_format
        self.tool_template = tool_template
        self.reasoning = reasoning
        self._rendering = anyio.CapacityLimiter(RENDER_THREADS)

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes)

    async def completions(self, request: Request, receive: Receive, send: Send) -> None:
        body = protocol.decode_body(await self._body(request), protocol.CompletionRequest)
        protocol.check_model(body.model, self.engine.model_name)
        # What the body alone decides is checked before any prompt is tokenized.
        prompts = protocol.completion_prompts(body)
        protocol.check_choices(len(prompts), body.n, self.max_choices)
        shape = output_constraint(strict_body(body) if self.config.strict_schemas else body)
        params = protocol.choice_params(body, shape.constraint)
        fmt = CompletionFormat(self.engine, body.logprobs or 0)
        await self._generate(fmt, list(prompts), params, body, "prompt", shape, receive, send)

    async def chat(self, request: Request, receive: Receive, send: Send) -> None:
        body = protocol.decode_body(await self._body(request), protocol.ChatCompletionRequest)
        protocol.check_model(body.model, self.engine.model_name)
        messages, params, fmt, shape = await self._prepare_chat(body)
        await self._generate(fmt, [messages], params, body, "messages", shape, receive, send)

    async def _prepare_chat(
        self, body: protocol.ChatCompletionRequest
    ) -> tuple[Prompt, list[SamplingParams], ChatFormat, OutputConstraint]:
        """What a chat completion body asks of the engine: its prompt (tools rendered in),
        one sampling parameters per choice, how its answer is written, its constraint.

        Raises:
            ApiError: a 400 for what the body asks wrongly, or the template's refusal.
            EngineOverloaded: no room in the waiting queue for the choices (checked before
                the conversation is rendered).
        """
        # What the body alone decides is checked before the messages are tokenized.
        turns = protocol.chat_turns(body.messages)
        protocol.check_choices(1, body.n, self.max_choices)
        schemas = strict_body(body) if self.config.strict_schemas else body
        shape = output_constraint(schemas, self.tool_format)
        lazy = shape.tool_calls is not None and body.tool_choice in (None, "auto") and (
            body.response_format is None or body.response_format.type == "text")  # fmt: skip
        check_no_constraint(self.reasoning, shape.param, lazy=lazy)
        kwargs = checked_template_kwargs(body.chat_template_kwargs)
        # without max_tokens: what the context leaves
        params = protocol.choice_params(body, shape.constraint)
        self._check_room(len(params))  # before a template renders the conversation
        messages = await self.tool_prompt(turns, shape.tools, template_kwargs=kwargs)
        fmt = ChatFormat(self.engine, body.top_logprobs or 0, shape.tool_calls, self.reasoning)
        return messages, params, fmt, shape

    async def tool_prompt(
        self,
        turns: list[Turn],
        tools: Sequence[ToolSpec],
        field: str = "messages",
        *,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """The conversation as the engine takes it: token ids rendered by the chat
        template's own ``tools`` where the format's template is at hand, else plain
        messages (:func:`~twostroke.engine.tools.template.tool_prompt`); with
        ``template_kwargs`` (checked: :func:`checked_template_kwargs`), token ids the
        engine's tokenizer rendered with them, since a prompt handed to the engine carries
        no template variables.

        The template renders, and its text is tokenized, in a worker thread (at most
        :data:`RENDER_THREADS` at once); plain messages are the body's text rearranged, on
        the loop. Cancelling the caller waits for the thread.

        Raises:
            ApiError: 400 naming ``field`` (the body's field that holds the conversation)
                when the template refuses the conversation; 400 naming
                ``chat_template_kwargs`` where no tokenizer is here to render them with (a
                coordinator's front).
        """
        template = self.tool_template
        try:
            if template is not None:
                render = partial(tool_prompt, self.tool_format, turns, tools, template,
                                 template_kwargs)  # fmt: skip
                return await anyio.to_thread.run_sync(render, limiter=self._rendering)
            messages = render_prompt(self.tool_format, turns, tools)
            if template_kwargs is None:
                return messages
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise invalid_request(
                    "chat_template_kwargs needs the chat template, which this server's "
                    "engine surface does not hold (a coordinator's front): send the "
                    "request without it",
                    param="chat_template_kwargs",
                )
            rendered = partial(tokenizer.apply_chat_template, messages,
                               template_kwargs=template_kwargs)  # fmt: skip
            return await anyio.to_thread.run_sync(rendered, limiter=self._rendering)
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), param=field) from None
        except ChatTemplateKwargsError as exc:
            raise invalid_request(str(exc), param="chat_template_kwargs") from None

    def _check_room(self, count: int) -> None:
        """Refuse ``count`` engine requests if the waiting queue cannot take them all.

        Asked before any prompt is rendered or tokenized, and again right before the
        choices are submitted (:meth:`Generation.submit`): nothing else runs between that
        check and the last submit, so a request's choices are queued whole or not at all.

        Raises:
            EngineOverloaded: the answer is a 503 with ``Retry-After``.
        """
        limit = self.config.max_waiting_requests
        if limit is None:
            return
        waiting = self.engine.statistics().num_waiting
        if waiting + count > limit:
            raise EngineOverloaded(
                f"the waiting queue is full: {waiting} requests wait for admission and "
                f"max_waiting_requests is {limit}, no room for this request's {count}; "
                "retry later"
            )

    async def _tokenize(self, prompt: Any, param: str) -> list[int]:
        try:
            return await self.engine.tokenize(prompt)
        except (TypeError, ValueError) as exc:
            raise invalid_request(str(exc), param=param) from None

    async def _generate(
        self,
        fmt: Format,
        prompts: list[Prompt],
        params: list[SamplingParams],
        body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
        prompt_field: str,
        shape: OutputConstraint,
        receive: Receive,
        send: Send,
    ) -> None:
        self._check_room(len(prompts) * len(params))  # before any prompt is tokenized
        generation = Generation(
            self.engine,
            self.metrics,
            fmt,
            keepalive=self.config.keepalive,
            prompt_field=prompt_field,
            max_tokens_field=protocol.max_tokens_field(body),
            constraint_field=shape.param,
        )
        try:
            submit = partial(generation.submit, prompts, params, self._check_room)
            if (await until_disconnect(receive, submit))[0]:
                return  # the client left while its prompts were prepared: nothing queued
            if body.stream:
                include_usage = body.stream_options is not None and (
                    body.stream_options.include_usage
                )
                sender = EventSender(send)
                await until_disconnect(
                    receive, lambda: generation.stream(sender, include_usage=include_usage)
                )
                return
            disconnected, outputs = await until_disconnect(receive, generation.collect)
            if disconnected or outputs is None:
                return
            answer = await generation.response(outputs)
            try:
                await send_json(send, 200, answer)
            except OSError as exc:  # the client left between the answer and its sending
                raise Disconnected from exc
        finally:
            await generation.settle()

    async def models(self, request: Request, receive: Receive, send: Send) -> None:
        model = {
            "id": self.engine.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "twostroke",
            "max_model_len": self.engine.max_model_len,
            "tool_format": self.tool_format.name,
        }
        await send_json(send, 200, {"object": "list", "data": [model]})

    async def health(self, request: Request, receive: Receive, send: Send) -> None:
        self.engine.check_health()  # EngineDead / EngineClosed become a 503
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]}
        )
        await send({"type": "http.response.body", "body": b""})

    async def prometheus(self, request: Request, receive: Receive, send: Send) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST

        await Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)(
            request.scope, receive, send
        )

    async def tokenize(self, request: Request, receive: Receive, send: Send) -> None:
        body = protocol.decode_body(await self._body(request), protocol.TokenizeRequest)
        protocol.check_model(body.model, self.engine.model_name)
        if (body.prompt is None) == (body.messages is None):
            raise invalid_request("pass exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            messages = await self.tool_prompt(protocol.chat_turns(body.messages), ())
            tokens = await self._tokenize(messages, "messages")
        else:
            tokens = await self._tokenize(body.prompt, "prompt")
        reply = {"count": len(tokens), "max_model_len": self.engine.max_model_len,
                 "tokens": tokens}  # fmt: skip
        await send_json(send, 200, reply)

    async def detokenize(self, request: Request, receive: Receive, send: Send) -> None:
        body = protocol.decode_body(await self._body(request), protocol.DetokenizeRequest)
        protocol.check_model(body.model, self.engine.model_name)
        try:
            text = await self.engine.detokenize(body.tokens)
        except (TypeError, ValueError) as exc:
            raise invalid_request(str(exc), param="tokens") from None
        await send_json(send, 200, {"prompt": text})


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    detail = exc.detail if isinstance(exc, HTTPException) else "Not Found"
    routes = ", ".join(  # the routes that exist, so a wrong path or method says which are right
        f"{method} {route.path}"
        for route in request.app.routes
        if isinstance(route, Route)
        for method in sorted((route.methods or set()) - {"HEAD"})
    )
    error = ApiError(status, f"{detail}: {request.method} {request.url.path}; this server's "
                     f"routes are {routes}", type="invalid_request_error")  # fmt: skip
    if request.url.path.startswith(ANTHROPIC_PATHS):
        status, body = anthropic_error(error)
        return JSONResponse(body, status_code=status)
    return JSONResponse(error.body(), status_code=status)


def build_app(
    engine: EngineSurface,
    *,
    api_key: str | None = None,
    config: ServerConfig | None = None,
    shutdown: ServerShutdown | None = None,
    tool_format: ToolFormat | str | None = None,
    response_store: ResponseStore | None = None,
    batch_store: BatchStore | None = None,
    reasoning_parser: str | None = None,
) -> Starlette:
    """The ASGI application serving ``engine`` with OpenAI's API (and Anthropic's Messages).

    The application does not own the engine: open it first and keep it open while the
    application serves (:func:`~twostroke.engine.server.serve.serve` does both).

    Args:
        engine: An :class:`~twostroke.engine.surface.EngineSurface` (an ``Engine``, or a
            coordinator over replicas).
        api_key: If given, every route but ``/health`` and ``/metrics`` wants
            ``Authorization: Bearer <api_key>`` or ``x-api-key: <api_key>``.
        config: The server's limits, one value (default: ``ServerConfig()``'s), which the
            application's parts read whole. It uses ``max_body_bytes``, ``max_choices``
            (never more than ``max_waiting_requests``), ``max_waiting_requests`` (checked
            against ``statistics().num_waiting``; ``None``: only the engine's own limit, if
            any), ``allowed_hosts`` (``None``: the loopback names; see
            :mod:`~twostroke.engine.server.guards`), ``body_timeout``, ``keepalive``,
            ``strict_schemas`` and the stores' and batches' fields; ``max_connections``,
            ``header_timeout`` and ``shutdown_timeout`` are the HTTP server's, which
            :func:`~twostroke.engine.server.serve.serve` runs.
        shutdown: Lets the server that runs the application end open responses gracefully
            (:func:`~twostroke.engine.server.serve.serve` passes one).
        tool_format: The format the model writes tool calls in
            (:mod:`twostroke.engine.tools`), or its name; ``None``: the one the engine's chat
            template implies (:func:`~twostroke.engine.tools.formats.tokenizer_tool_format`).
            Logged once, and ``/v1/models`` names it.
        response_store: Where ``/v1/responses`` stores responses; the caller closes it
            (:func:`~twostroke.engine.server.serve.serve` does). ``None``: one of
            :func:`response_store_of` ``config``, opened on first use, which
            ``app.state.response_store`` holds for the caller to close.
        batch_store: Where ``/v1/files`` and ``/v1/batches`` keep files, batches and
            answers; the caller closes it. ``None``: one of :func:`batch_store_of`
            ``config``, which ``app.state.batch_store`` holds for the caller to close.
            Batches run in ``app.state.batches.run()``, a task the caller starts in its
            task group (:func:`~twostroke.engine.server.serve.serve` does).
        reasoning_parser: How a thinking model's reasoning is read apart from its answer
            (:mod:`~twostroke.engine.text.reasoning`): one of ``deepseek_r1``, ``qwen3``,
            ``think``, or ``none``; ``None``: ``think`` where the chat template mentions
            ``<think>``, else none. Logged once.

    Every ``POST`` wants ``Content-Type: application/json`` (else a 415).

    Raises:
        TypeError: ``engine`` lacks the engine surface, ``api_key`` is not a string,
            ``config`` is no ``ServerConfig``, or a store or ``tool_format`` is of the wrong
            type.
        ValueError: ``api_key`` is empty.
    """
    if not isinstance(engine, EngineSurface):
        raise TypeError(f"engine must have the engine surface, got {type(engine).__name__}")
    if api_key is not None and not isinstance(api_key, str):
        raise TypeError(f"api_key must be a str or None, got {type(api_key).__name__}")
    if api_key == "":
        raise ValueError("api_key must not be empty, got ''")
    if config is None:
        config = ServerConfig()
    elif not isinstance(config, ServerConfig):
        raise TypeError(
            f"config must be a ServerConfig or None, got {type(config).__name__} {config!r}"
        )
    if isinstance(tool_format, str):
        tool_format = named_tool_format(tool_format)
    chosen = "as named" if tool_format is not None else "from the chat template"
    if tool_format is None:
        tool_format = tokenizer_tool_format(engine.tokenizer)
    if not isinstance(tool_format, ToolFormat):
        raise TypeError(f"tool_format must be a ToolFormat, a str or None, got {tool_format!r}")
    template = native_template(tool_format, engine.tokenizer)
    shown = "through the chat template's tools" if template is not None else "in plain messages"
    logger.info("tool calls in the %s format (%s), tools shown %s", tool_format.name, chosen, shown)
    reasoning = server_reasoning_format(reasoning_parser, engine.tokenizer)
    logger.info("reasoning read apart: %s", "no" if reasoning is None else reasoning.name)
    handlers = _OpenAI(engine, ServerMetrics(engine), config, tool_format=tool_format,
                       tool_template=template, reasoning=reasoning)  # fmt: skip

    if response_store is None:
        response_store = response_store_of(config)
    elif not isinstance(response_store, ResponseStore):
        raise TypeError(
            f"response_store must be a ResponseStore or None, got {type(response_store).__name__}"
        )
    chat = ChatService(
        engine,
        handlers.metrics,
        config,
        check_room=handlers._check_room,
        render=handlers.tool_prompt,
        tool_format=tool_format,
        reasoning=reasoning,
    )
    responses = Responses(engine, chat, config, store=response_store, owner=owner_of(api_key))
    if batch_store is None:
        batch_store = batch_store_of(config)
    elif not isinstance(batch_store, BatchStore):
        raise TypeError(
            f"batch_store must be a BatchStore or None, got {type(batch_store).__name__}"
        )
    batches = Batches(
        batch_store,
        owner_of(api_key),
        # A line is answered as a request is, less the authentication its batch passed.
        {"/v1/chat/completions": _Endpoint(handlers.chat, api_key=None),
         "/v1/completions": _Endpoint(handlers.completions, api_key=None)},
        config,
        model=engine.model_name,
    )  # fmt: skip
    messages = Messages(engine, chat, config)

    def route(path: str, handler: _Handler, method: str, *, secured: bool = True) -> Route:
        endpoint = _Endpoint(handler, api_key=api_key if secured else None,
                             anthropic=path.startswith(ANTHROPIC_PATHS))  # fmt: skip
        return Route(path, endpoint, methods=[method])

    app = Starlette(
        routes=[
            route("/v1/completions", handlers.completions, "POST"),
            route("/v1/chat/completions", handlers.chat, "POST"),
            route("/v1/responses", responses.create, "POST"),
            route("/v1/responses/{response_id}", responses.retrieve, "GET"),
            route("/v1/responses/{response_id}", responses.delete, "DELETE"),
            route("/v1/responses/{response_id}/input_items", responses.input_items, "GET"),
            route("/v1/files", batches.upload, "POST"),
            route("/v1/files/{file_id}", batches.retrieve_file, "GET"),
            route("/v1/files/{file_id}", batches.delete_file, "DELETE"),
            route("/v1/files/{file_id}/content", batches.file_content, "GET"),
            route("/v1/batches", batches.create, "POST"),
            route("/v1/batches", batches.list_batches, "GET"),
            route("/v1/batches/{batch_id}", batches.retrieve, "GET"),
            route("/v1/batches/{batch_id}/cancel", batches.cancel, "POST"),
            route("/v1/messages", messages.create, "POST"),
            route("/v1/messages/count_tokens", messages.count_tokens, "POST"),
            route("/v1/models", handlers.models, "GET"),
            route("/tokenize", handlers.tokenize, "POST"),
            route("/detokenize", handlers.detokenize, "POST"),
            route("/health", handlers.health, "GET", secured=False),
            route("/metrics", handlers.prometheus, "GET", secured=False),
        ],
        exception_handlers={404: _not_found, 405: _not_found},
        middleware=[
            Middleware(
                Guards,
                api_key=api_key is not None,
                config=config,
                shutdown=shutdown,
            )
        ],
    )
    app.state.metrics = handlers.metrics
    app.state.response_store = response_store
    app.state.batch_store = batch_store
    app.state.batches = batches
    return app


def response_store_of(config: ServerConfig) -> ResponseStore:
    """The response store ``config`` asks for (``responses_store`` and its bounds); no I/O:
    the database is opened on first use.

    Raises:
        ValueError: a bound below 1 (``ServerConfig`` refuses those first).
    """
    path = config.responses_store
    return ResponseStore(
        default_store_path() if path is None else path,
        max_count=config.responses_max_count,
        max_bytes=config.responses_max_bytes,
        max_age=config.responses_max_age,
    )


def batch_store_of(config: ServerConfig) -> BatchStore:
    """The batch store ``config`` asks for (``batches_store``, ``batch_store_max_bytes``); no
    I/O: the database is opened on first use."""
    path = config.batches_store
    return BatchStore(
        default_batches_path() if path is None else path, max_bytes=config.batch_store_max_bytes
    )
