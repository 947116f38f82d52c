"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

A Messages request is decoded into typed Structs (bounded as the other bodies are: the body's
bytes by the server's ``max_body_bytes``, its messages, blocks and tools by the limits below)
and translated into the chat completion it asks for: ``system`` into a first system message,
``text`` blocks into message text, an assistant's ``tool_use`` blocks into its ``tool_calls``
(``input`` as the arguments' JSON), a user's ``tool_result`` blocks into ``tool`` messages,
``tools`` (``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``) into
chat's, ``stop_sequences`` into ``stop``. That request runs through the chat machinery
unchanged, as ``/v1/responses`` does: the same prompt (rendered off the event loop), sampling
parameters, constraint and tool calls as ``/v1/chat/completions`` computes for it. The chat
answer, whole or as chunks, is written back as Anthropic content blocks and events
(:mod:`~twostroke.engine.server.message_events`).

``max_tokens`` is required, as Anthropic requires it. ``thinking`` is accepted, and no
``thinking`` block ever comes back: the served models have no reasoning format, and a block
is not invented; ``thinking`` blocks a client sends back in an assistant turn are dropped (as
Anthropic drops earlier turns' thinking from the context). ``cache_control``, ``metadata``,
``service_tier`` and unknown fields are ignored; ``image`` and ``document`` blocks, and tools
of Anthropic's server-side types (``web_search_...``, ``bash_...``), are a 400 naming them.
Errors are in Anthropic's shape (:func:`~twostroke.engine.server.errors.anthropic_error`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Literal

import anyio
import attrs
import msgspec
from starlette.requests import Request
from starlette.types import Receive, Send

from twostroke.engine.server import protocol
from twostroke.engine.server.body import read_body
from twostroke.engine.server.errors import ApiError, invalid_request
from twostroke.engine.server.generation import Generation
from twostroke.engine.server.guards import shutting_down
from twostroke.engine.server.message_events import MessageDraft, MessageEventSender
from twostroke.engine.server.metrics import ServerMetrics
from twostroke.engine.server.responses import PreparedChat
from twostroke.engine.server.sse import Disconnected, send_json, until_disconnect
from twostroke.engine.server.transport import CLOSING_SECONDS
from twostroke.engine.surface import EngineSurface
from twostroke.states.prompts import Prompt

__all__ = [
    "MAX_BLOCKS",
    "MAX_MESSAGES",
    "MAX_TEMPERATURE",
    "CountTokensRequest",
    "Messages",
    "MessagesRequest",
    "chat_request",
]

#: The highest ``temperature``, as the Messages API documents it.
MAX_TEMPERATURE = 1.0
#: The most messages one request may hold.
MAX_MESSAGES = 2048
#: The most content blocks one request may hold, over all its messages and ``system``.
MAX_BLOCKS = 8192
_ROLES = frozenset({"user", "assistant"})
#: Blocks dropped from an assistant turn: thinking is not part of the context.
_THINKING = frozenset({"thinking", "redacted_thinking"})


class Block(msgspec.Struct, kw_only=True):
    """One content block: ``text``, ``tool_use``, ``tool_result``, ``thinking``.

    One loose shape for all of them, so that a field missing from its kind is a 400 naming
    the block and the field rather than a decoder's message.
    """

    type: str
    text: str | None = None
    id: str | None = None  # a tool_use's
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # a tool_result's: the call it answers
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class Tool(msgspec.Struct, kw_only=True):
    """One of ``tools``: a custom tool (Anthropic's server tools have a ``type``)."""

    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, kw_only=True):
    """``thinking``: accepted; no thinking block comes from a model without a reasoning
    format."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: what the prompt of a Messages request is made of."""

    messages: list[Message]
    model: str | None = None
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``: the fields this server reads (others are ignored)."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False


@attrs.frozen
class _Origins:
    """Where each chat message of a translated request came from (``system``,
    ``messages[j]``, the block ``messages[j].content[b]``), and each of its calls' blocks,
    so that an error the chat path words about ``messages[k]`` names the request's own."""

    messages: tuple[str, ...]
    calls: tuple[tuple[str, ...], ...]

    def rename(self, text: str) -> str:
        def call(match: re.Match[str]) -> str:
            message, number = _index(match[1]), _index(match[2])
            blocks = self.calls[message] if message < len(self.calls) else ()
            return blocks[number] if number < len(blocks) else match[0]

        def message(match: re.Match[str]) -> str:
            index = _index(match[1])
            return self.messages[index] if index < len(self.messages) else match[0]

        text = re.sub(r"\bmessages\[(\d+)\]\.tool_calls\[(\d+)\](?:\.function)?", call, text)
        text = re.sub(r"\bmessages\[(\d+)\]", message, text)
        return _rename(text)


def _index(digits: str) -> int:
    """An index in the chat path's message, which may quote a client's text: past 9 digits
    it is past any list (``int()`` refuses more than 4,300 digits)."""
    return int(digits) if len(digits) <= 9 else 10**9


#: The chat path's names of fields, and the Messages API's names of the same fields.
_RENAMES = [
    (re.compile(r"\bstop\b"), "stop_sequences"),
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
    (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
]


def _rename(text: str) -> str:
    for pattern, replacement in _RENAMES:
        text = pattern.sub(replacement, text)
    return text


def _renamed(error: ApiError, origins: _Origins) -> ApiError:
    param = None if error.param is None else _rename(error.param)
    return ApiError(error.status, origins.rename(error.message), type=error.type, param=param,
                    code=error.code, headers=error.headers)  # fmt: skip


class _Translation:
    """The chat messages of one request, built block by block, with their origins."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._origins: list[str] = []
        self._calls: list[list[str]] = []
        self.blocks = 0
        self.names: dict[str, str] = {}  # a tool_use id -> its tool's name

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.messages.append(message)
        self._origins.append(origin)
        self._calls.append([])

    def call(self, call: dict[str, Any], origin: str) -> None:
        self.messages[-1].setdefault("tool_calls", []).append(call)
        self._calls[-1].append(origin)

    def count(self, where: str) -> None:
        self.blocks += 1
        if self.blocks > MAX_BLOCKS:
            raise invalid_request(
                f"{where}: a request may hold <= {MAX_BLOCKS} content blocks in all",
                param="messages",
            )

    def origins(self) -> _Origins:
        return _Origins(tuple(self._origins), tuple(map(tuple, self._calls)))


def _text_blocks(content: str | list[Block] | None, where: str, out: _Translation) -> str:
    """The text of a ``system`` or ``tool_result`` content: a string, or text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for index, block in enumerate(content):
        out.count(f"{where}[{index}]")
        if block.type != "text" or block.text is None:
            raise invalid_request(
                f"{where}[{index}]: only text blocks are supported here, got type "
                f"{block.type[:40]!r}",
                param="messages" if where.startswith("messages") else "system",
            )
        texts.append(block.text)
    return "".join(texts)


def _system(body: CountTokensRequest, out: _Translation) -> None:
    if body.system is None:
        return
    if isinstance(body.system, str):
        text = body.system
    else:  # blocks are paragraphs (Claude Code sends several): kept apart
        text = "\n\n".join(
            _text_blocks([block], f"system[{index}]", out) for index, block in
            enumerate(body.system)
        )  # fmt: skip
    if text:
        out.add({"role": "system", "content": text}, "system")


def _tool_use(block: Block, where: str, out: _Translation) -> dict[str, Any]:
    if block.id is None or block.name is None or block.input is None:
        raise invalid_request(f"{where}: a tool_use block needs id, name and input",
                              param="messages")  # fmt: skip
    if block.id in out.names:
        raise invalid_request(f"{where}.id {block.id[:80]!r} is not unique", param="messages")
    out.names[block.id] = block.name
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {"id": block.id, "type": "function",
            "function": {"name": block.name, "arguments": arguments}}  # fmt: skip


def _message(index: int, message: Message, out: _Translation) -> None:
    """One Anthropic message as chat messages (tool results first, as Anthropic orders a
    user turn's blocks; then its text)."""
    where = f"messages[{index}]"
    if message.role not in _ROLES:
        raise invalid_request(f"{where}.role must be 'user' or 'assistant', got "
                              f"{message.role[:40]!r}", param="messages")  # fmt: skip
    if isinstance(message.content, str):
        out.add({"role": message.role, "content": message.content}, where)
        return
    texts: list[str] = []
    calls: list[tuple[dict[str, Any], str]] = []
    for number, block in enumerate(message.content):
        at = f"{where}.content[{number}]"
        out.count(at)
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append((_tool_use(block, at, out), at))
        elif block.type == "tool_result" and message.role == "user":
            call_id = block.tool_use_id
            if call_id is None or call_id not in out.names:
                raise invalid_request(
                    f"{at}: no tool_use block with id {call_id!r} comes before this tool_result",
                    param="messages",
                )
            content = _text_blocks(block.content, f"{at}.content", out)
            out.add({"role": "tool", "tool_call_id": call_id, "name": out.names[call_id],
                     "content": content}, at)  # fmt: skip
        elif block.type in _THINKING and message.role == "assistant":
            continue
        else:
            kinds = "tool_use and thinking" if message.role == "assistant" else "tool_result"
            raise invalid_request(
                f"{at}: a {message.role} message may hold text and {kinds} blocks, got type "
                f"{block.type[:40]!r}",
                param="messages",
            )
    if texts or calls or not message.content:
        out.add({"role": message.role, "content": "".join(texts) if texts or not calls
                 else None}, where)  # fmt: skip
        for call, at in calls:
            out.call(call, at)


def _tools(body: CountTokensRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in chat's shape (the chat path checks the rest)."""
    fields: dict[str, Any] = {}
    if body.tools is not None:
        tools = []
        for index, tool in enumerate(body.tools):
            if tool.type not in (None, "custom"):
                raise invalid_request(
                    f"tools[{index}].type must be 'custom' or absent (this server runs only "
                    f"the client's tools), got {tool.type[:40]!r}",
                    param=f"tools[{index}].type",
                )
            function: dict[str, Any] = {"name": tool.name}
            if tool.description is not None:
                function["description"] = tool.description
            if tool.input_schema is not None:
                function["parameters"] = tool.input_schema
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = body.tool_choice
    if choice is None:
        return fields
    if choice.type == "tool":
        if choice.name is None:
            raise invalid_request("tool_choice of type 'tool' needs name", param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def chat_request(body: CountTokensRequest) -> protocol.ChatCompletionRequest:
    """The chat completion a Messages request (or a count_tokens one) asks for.

    Raises:
        ApiError: 400 naming the field: a block, tool or parameter that is malformed, or
            past its limit.
    """
    return _translate(body)[0]


def _translate(body: CountTokensRequest) -> tuple[protocol.ChatCompletionRequest, _Origins]:
    """:func:`chat_request`, and where each of its messages came from."""
    if not body.messages:
        raise invalid_request("messages must not be empty", param="messages")
    if len(body.messages) > MAX_MESSAGES:
        raise invalid_request(f"messages must hold <= {MAX_MESSAGES} messages, got "
                              f"{len(body.messages)}", param="messages")  # fmt: skip
    out = _Translation()
    _system(body, out)
    for index, message in enumerate(body.messages):
        _message(index, message, out)
    fields: dict[str, Any] = {"model": body.model, "messages": out.messages}
    if isinstance(body, MessagesRequest):
        fields |= _sampling(body)
    fields |= _tools(body)
    origins = out.origins()
    try:
        return msgspec.convert(fields, protocol.ChatCompletionRequest), origins
    except msgspec.ValidationError as exc:  # a shape the chat path refuses
        raise _renamed(invalid_request(str(exc), param="messages"), origins) from None


def _sampling(body: MessagesRequest) -> dict[str, Any]:
    if body.max_tokens < 1:
        raise invalid_request(f"max_tokens must be >= 1, got {body.max_tokens}",
                              param="max_tokens")  # fmt: skip
    if body.temperature is not None and not 0 <= body.temperature <= MAX_TEMPERATURE:  # NaN too
        raise invalid_request(
            f"temperature must be in [0, {MAX_TEMPERATURE}], got {body.temperature}",
            param="temperature",
        )
    fields: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": body.stream}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.stop_sequences:
        # The engine does not report which stop string matched: kept in the text, where
        # the draft finds it, takes it off and names it (message_events).
        fields |= {"stop": body.stop_sequences, "include_stop_str_in_output": True}
    return fields


async def _end_cut_stream(sender: MessageEventSender) -> None:
    """End a started stream that the server's shutdown cancelled with Anthropic's ``error``
    event (not chat's ``[DONE]``), under a shield, within the time the server gives open
    responses to end; one that has not started is left to the server's 503."""
    if not sender.started or sender.ended:
        return
    error = shutting_down("the request did not finish within the grace period")
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSING_SECONDS):
        with contextlib.suppress(Disconnected):
            await sender.fail(error.body())


class Messages:
    """The ``/v1/messages`` endpoints over one engine.

    Args:
        engine: The engine surface.
        metrics: Where outcomes are counted (the chat path's counters).
        keepalive: Seconds of silence on a stream before a ``ping`` event goes out.
        max_body_bytes: The largest body read.
        check_room: Refuses ``count`` more engine requests when the waiting queue cannot
            take them (an ``EngineOverloaded``: Anthropic's 529).
        prepare_chat: The chat path: what a chat completion body asks of the engine, or its
            400 (``/v1/responses`` shares it).
        chat_prompt: The chat path's prompt for a chat completion body, as the engine takes
            it (tools rendered in, off the event loop), for ``count_tokens``.
    """

    def __init__(
        self,
        engine: EngineSurface,
        metrics: ServerMetrics,
        *,
        keepalive: float,
        max_body_bytes: int,
        check_room: Callable[[int], None],
        prepare_chat: Callable[[protocol.ChatCompletionRequest], Awaitable[PreparedChat]],
        chat_prompt: Callable[[protocol.ChatCompletionRequest], Awaitable[Prompt]],
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._keepalive = keepalive
        self._max_body_bytes = max_body_bytes
        self._check_room = check_room
        self._prepare_chat = prepare_chat
        self._chat_prompt = chat_prompt

    async def count_tokens(self, request: Request, receive: Receive, send: Send) -> None:
        """Answer one ``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``, the
        tokens of the prompt a Messages request with this body would have."""
        body = protocol.decode_body(
            await read_body(request, self._max_body_bytes), CountTokensRequest
        )
        protocol.check_model(body.model, self._engine.model_name)
        translated, origins = _translate(body)
        try:
            prompt = await self._chat_prompt(translated)
            tokens = await self._engine.tokenize(prompt)  # in a worker thread
        except ApiError as exc:
            raise _renamed(exc, origins) from None
        except (TypeError, ValueError) as exc:  # the template's or the tokenizer's refusal
            raise invalid_request(str(exc), param="messages") from None
        await send_json(send, 200, {"input_tokens": len(tokens)})

    async def create(self, request: Request, receive: Receive, send: Send) -> None:
        """Answer one ``POST /v1/messages``: a Message object, or its event stream."""
        body = protocol.decode_body(await read_body(request, self._max_body_bytes), MessagesRequest)
        protocol.check_model(body.model, self._engine.model_name)
        translated, origins = _translate(body)
        try:
            chat = await self._prepare_chat(translated)
        except ApiError as exc:
            raise _renamed(exc, origins) from None
        self._check_room(1)  # before the prompt is tokenized
        shape = chat.shape
        generation = Generation(
            self._engine,
            self._metrics,
            chat.format,
            keepalive=self._keepalive,
            prompt_field="messages",
            max_tokens_field="max_tokens",
            constraint_field=None if shape.param is None else _rename(shape.param),
        )
        draft = MessageDraft(self._engine.model_name, body.stop_sequences or ())
        try:
            submit = partial(generation.submit, [chat.messages], chat.params, self._check_room)
            try:
                if (await until_disconnect(receive, submit))[0]:
                    return  # the client left while its prompt was prepared: nothing queued
            except ApiError as exc:
                raise _renamed(exc, origins) from None
            (choice,) = generation.choices
            draft.input_tokens = len(choice.handle.prompt_token_ids)
            if body.stream:
                sender = MessageEventSender(send, draft)
                try:
                    await until_disconnect(
                        receive, lambda: generation.stream(sender, include_usage=True)
                    )
                except anyio.get_cancelled_exc_class():
                    await _end_cut_stream(sender)
                    raise
                return
            disconnected, outputs = await until_disconnect(receive, generation.collect)
            if disconnected or outputs is None:
                return
            draft.chunk(await generation.response(outputs))
            draft.end()
            try:
                await send_json(send, 200, draft.message())
            except OSError as exc:  # the client left between the answer and its sending
                raise Disconnected from exc
        finally:
            await generation.settle()
