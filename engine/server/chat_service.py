"""The chat service: a prepared chat request run on the engine, its answer as typed events.

``/v1/responses`` and ``/v1/messages`` parse their bodies into a
:class:`~twostroke.engine.server.chat_request.ChatRequest`; :meth:`ChatService.prepare` turns
one into what the engine takes (the constraint of its JSON output and tools, its sampling
parameters, its conversation rendered with the server's tool format, off the event loop),
every refusal naming the endpoint's own field. :meth:`ChatService.open_run` then submits it
and answers with :mod:`~twostroke.engine.server.answer_events`: collected whole
(:meth:`ChatRun.collect`) or streamed to an :class:`AnswerWriter`, the endpoint's writer,
which folds them into its objects and events. Both are read by the same
:class:`~twostroke.engine.server.answer_events.AnswerReader`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
import attrs

from twostroke.engine.config import ServerConfig
from twostroke.engine.errors import EngineError
from twostroke.engine.server.answer_events import AnswerEvent, AnswerReader, Usage
from twostroke.engine.server.chat_request import ChatRequest, OutputFormat
from twostroke.engine.server.errors import ApiError, invalid_request
from twostroke.engine.server.generation import Choice, Submission
from twostroke.engine.server.metrics import ServerMetrics
from twostroke.engine.server.reasoning import ChoiceReasoning, check_no_constraint
from twostroke.engine.server.sse import Disconnected, until_disconnect
from twostroke.engine.server.structured import OutputConstraint, chat_constraint, strict_schema
from twostroke.engine.surface import EngineSurface
from twostroke.engine.text.reasoning import ReasoningFormat
from twostroke.engine.tools.formats import ToolFormat, ToolSpec
from twostroke.engine.tools.prompt import Turn
from twostroke.states.params import SamplingParams
from twostroke.states.prompts import Prompt

__all__ = ["AnswerWriter", "ChatRun", "ChatService", "PreparedChat"]

logger = logging.getLogger("twostroke.server")

#: Renders a conversation with its tools as the engine takes it; the third argument is the
#: field that holds the conversation, which a template's refusal names.
Render = Callable[[list[Turn], Sequence[ToolSpec], str], Awaitable[Prompt]]


@attrs.frozen
class PreparedChat:
    """What a chat request asks of the engine.

    Attributes:
        request: The request, its schemas as the server constrains them.
        prompt: The conversation as the engine takes it (tools rendered in).
        params: The sampling parameters.
        shape: The output's constraint, the field that set it, and how calls are read.
    """

    request: ChatRequest
    prompt: Prompt
    params: SamplingParams
    shape: OutputConstraint


class AnswerWriter(Protocol):
    """An endpoint's streamed answer: consumes the answer's events as they come.

    Every method may raise :class:`~twostroke.engine.server.sse.Disconnected` when a send to
    the client fails.
    """

    async def open(self) -> None:
        """Start the response: its headers and opening events."""

    async def write(self, events: Sequence[AnswerEvent]) -> None:
        """Send what ``events`` add to the answer."""

    async def keepalive(self) -> None:
        """Tell the client and the proxies between that the answer is still coming."""

    async def fail(self, error: ApiError) -> None:
        """End the answer with ``error`` (the stream has started; :meth:`close` follows)."""

    async def close(self) -> None:
        """Finish the answer and end the response."""

    async def cut(self) -> None:
        """End a started answer that the server's shutdown cancelled, in the endpoint's
        own events, shielded and within the time the server gives open responses."""


class ChatService:
    """Prepares chat requests and runs them on one engine.

    Args:
        engine: The engine surface.
        metrics: Where outcomes are counted.
        config: The server's limits: ``keepalive`` (seconds of silence on a stream before
            the writer's keep-alive) and ``strict_schemas`` (close the object schemas of JSON
            outputs and tools: :func:`~twostroke.engine.server.structured.strict_schema`).
        check_room: Refuses ``count`` more engine requests when the waiting queue cannot
            take them (an ``EngineOverloaded``).
        render: Renders a conversation with its tools, off the event loop.
        tool_format: The format the model writes tool calls in.
        reasoning: How a thinking model's reasoning is read apart from its answer
            (:class:`~twostroke.engine.server.answer_events.ThinkingDelta`), or ``None``.
    """

    def __init__(
        self,
        engine: EngineSurface,
        metrics: ServerMetrics,
        config: ServerConfig,
        *,
        check_room: Callable[[int], None],
        render: Render,
        tool_format: ToolFormat,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        self._engine = engine
        self._reasoning = reasoning
        self._metrics = metrics
        self._config = config
        self._check_room = check_room
        self._render = render
        self._tool_format = tool_format

    def _strict(self, request: ChatRequest) -> ChatRequest:
        if not self._config.strict_schemas:
            return request
        tools = tuple(
            spec if spec.parameters is None
            else attrs.evolve(spec, parameters=strict_schema(spec.parameters))
            for spec in request.tools
        )  # fmt: skip
        output = request.output
        if output is not None and output.schema is not None:
            output = OutputFormat(strict_schema(output.schema))
        return attrs.evolve(request, tools=tools, output=output)

    async def prompt(self, request: ChatRequest) -> Prompt:
        """The prompt ``request`` makes, as the engine takes it (its tools rendered in),
        without what it asks of the sampler or the queue (Messages' ``count_tokens``).

        Raises:
            ApiError: a 400 naming the request's field, or the template's refusal.
        """
        request = self._strict(request)
        shape = chat_constraint(request, self._tool_format)
        return await self._render(list(request.turns), shape.tools, request.names.prompt)

    async def prepare(self, request: ChatRequest) -> PreparedChat:
        """What ``request`` asks of the engine, checked from the request alone first.

        Raises:
            ApiError: a 400 naming the request's own field, or the template's refusal.
            EngineOverloaded: no room in the waiting queue (asked before the conversation
                is rendered, and again after).
        """
        request = self._strict(request)
        shape = chat_constraint(request, self._tool_format)
        choice = request.tool_choice
        lazy = shape.tool_calls is not None and request.output is None and (
            choice is None or choice.mode == "auto")  # fmt: skip
        check_no_constraint(self._reasoning, shape.param, lazy=lazy)
        params = _params(request, shape)
        self._check_room(1)  # before a template renders the conversation
        prompt = await self._render(list(request.turns), shape.tools, request.names.prompt)
        self._check_room(1)  # others came in while it rendered
        return PreparedChat(request, prompt, params, shape)

    @contextlib.asynccontextmanager
    async def open_run(self, prepared: PreparedChat) -> AsyncIterator[ChatRun]:
        """A run of ``prepared`` on the engine, settled when the block ends however it ends
        (its engine request cancelled if still open, and its outcome counted once)."""
        run = ChatRun(self._engine, self._metrics, prepared, keepalive=self._config.keepalive,
                      check_room=self._check_room, reasoning=self._reasoning)  # fmt: skip
        try:
            yield run
        finally:
            await run.settle()


def _params(request: ChatRequest, shape: OutputConstraint) -> SamplingParams:
    """The sampling parameters ``request`` asks for: the sampler's own defaults for what it
    leaves out, as the chat path's.

    Raises:
        ApiError: 400 naming the request's field whose value the parameters refuse.
    """
    top_k = request.top_k
    if top_k in (-1, 0):  # vLLM's and OpenAI-style "disabled"
        top_k = None
    fields: dict[str, Any] = {
        "max_tokens": request.max_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_k": top_k,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "stop": request.stop,
        "include_stop_str_in_output": request.include_stop,
        "constraint": shape.constraint,
        "cache_ttl": request.cache_ttl,
    }
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:  # its messages begin with the field's name
        message = str(exc)
        field = message.split(" ", 1)[0]
        if field not in fields:
            raise invalid_request(message) from None
        param = request.names.sampling(field)
        raise invalid_request(param + message[len(field) :], param=param) from None


class ChatRun:
    """One prepared chat request on the engine (:meth:`ChatService.open_run` makes it).

    Each call runs until the client disconnects, whichever comes first: a call that saw
    the client leave returns ``False`` or ``None``, with nothing more to send.
    """

    def __init__(
        self,
        engine: EngineSurface,
        metrics: ServerMetrics,
        prepared: PreparedChat,
        *,
        keepalive: float,
        check_room: Callable[[int], None],
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        names = prepared.request.names
        self._reasoning = None if reasoning is None else ChoiceReasoning(reasoning, engine)
        self._submission = Submission(
            engine,
            metrics,
            prompt_field=names.prompt,
            max_tokens_field=names.max_tokens,
            constraint_field=prepared.shape.param,
        )
        self._metrics = metrics
        self._prepared = prepared
        self._keepalive = keepalive
        self._check_room = check_room

    async def submit(self, receive: Any) -> bool:
        """Prepare the prompt (in the engine's worker thread) and queue it.

        Returns:
            ``False`` if the client left first (nothing was queued).

        Raises:
            ApiError: the engine refused the prompt, naming the request's field.
            EngineOverloaded: no room in the waiting queue.
        """
        prepared = self._prepared
        submit = self._submission.submit
        left, _ = await until_disconnect(
            receive, lambda: submit([prepared.prompt], [prepared.params], self._check_room)
        )
        if not left and self._reasoning is not None:
            # Whether the output starts inside the reasoning is its prompt's tail's to say.
            (choice,) = self._submission.choices
            await self._reasoning.begin(0, choice.handle.prompt_token_ids)
        return not left

    def _reader(self) -> AnswerReader:
        """A reader of the answer: its reasoning apart where the server reads it so."""
        reasoning = None if self._reasoning is None else self._reasoning.parser(0)
        return AnswerReader(self._prepared.shape.tool_calls, reasoning)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens, once submitted (behind a coordinator: once a replica took
        it, else 0)."""
        (choice,) = self._submission.choices
        return len(choice.handle.prompt_token_ids)

    async def collect(self, receive: Any) -> list[AnswerEvent] | None:
        """The whole answer's events, :class:`Usage` last; ``None`` if the client left.

        Raises:
            ApiError: the engine refused the request or its constraint failed partway.
            RequestFailed, EngineDead, EngineClosed: the request failed.
        """
        left, outputs = await until_disconnect(receive, self._submission.collect)
        if left or outputs is None:
            return None
        (output,) = outputs
        events = self._reader().read(output.text, str(output.finish_reason))
        usage = output.usage
        completion_tokens = len(output.token_ids)
        return [*events, Usage(usage.prompt_tokens, completion_tokens, usage.cached_prompt_tokens)]

    async def stream(self, receive: Any, writer: AnswerWriter) -> None:
        """Stream the answer's events to ``writer``, :class:`Usage` last, until it ends or
        the client leaves. A constrained request's stream opens with its first output (or
        keep-alive), so that a constraint the engine refuses once it compiled it is still a
        plain 400; a later error goes to :meth:`AnswerWriter.fail`. Cancelled from outside
        (the server's shutdown), the writer cuts the stream in its own events.

        Raises:
            ApiError: (constrained only) the first thing the engine reported was an error.
            Disconnected: a send to the client failed.
        """
        try:
            await until_disconnect(receive, lambda: self._stream(writer))
        except anyio.get_cancelled_exc_class():
            await writer.cut()
            raise

    async def _stream(self, writer: AnswerWriter) -> None:
        (choice,) = self._submission.choices
        opened = self._prepared.shape.param is None
        if opened:
            await writer.open()
        sent, received = anyio.create_memory_object_stream[list[AnswerEvent] | ApiError](1)
        failure: ApiError | None = None
        disconnected = False
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._pump, choice, sent)
            async with received:
                try:
                    failure, opened = await self._relay(writer, received, opened)
                except Disconnected:  # raised below, outside the task group
                    disconnected = True
                task_group.cancel_scope.cancel()
        if disconnected:
            raise Disconnected
        if not opened:
            if failure is not None:
                raise failure  # nothing was sent: the answer is the error itself
            await writer.open()
        if failure is not None:
            await writer.fail(failure)
        else:
            # The request has ended without error here, so its result is at hand.
            usage = (await choice.handle.result()).usage
            tokens = Usage(usage.prompt_tokens, choice.num_tokens, usage.cached_prompt_tokens)
            await writer.write([tokens])
        await writer.close()

    async def _relay(
        self, writer: AnswerWriter, received: Any, opened: bool
    ) -> tuple[ApiError | None, bool]:
        """Write the pump's events as they come, a keep-alive when none come.

        Opens the answer first if ``opened`` is false, unless the first item is an error.
        Returns the error that ended the stream, if any, and whether the answer is open.
        """
        while True:
            with anyio.move_on_after(self._keepalive) as timer:
                try:
                    item = await received.receive()
                except anyio.EndOfStream:
                    return None, opened
            if not timer.cancelled_caught and isinstance(item, ApiError):
                return item, opened
            if not opened:
                await writer.open()
                opened = True
            if timer.cancelled_caught:
                await writer.keepalive()
            else:
                await writer.write(item)

    async def _pump(self, choice: Choice, sent: Any) -> None:
        """Read the request's deltas into answer events (or one ``ApiError``)."""
        reader = self._reader()
        async with sent:
            last: float | None = None
            try:
                async for delta in choice.handle:
                    now = anyio.current_time()
                    if last is not None:
                        self._metrics.streamed(now - last, len(delta.token_ids))
                    last = now
                    choice.num_tokens += len(delta.token_ids)
                    reason = None if delta.finish_reason is None else str(delta.finish_reason)
                    await sent.send(reader.read(delta.text, reason))
            except anyio.BrokenResourceError:
                return  # the relay stopped: the stream is over
            except Exception as exc:
                error = self._submission.error(exc)
                if error.status >= 500 and not isinstance(exc, EngineError):
                    logger.exception("request %d failed", choice.handle.request_id)
                with contextlib.suppress(anyio.BrokenResourceError):
                    await sent.send(error)

    async def settle(self) -> None:
        """Cancel the request if still open and count its outcome once. Shielded."""
        await self._submission.settle()
