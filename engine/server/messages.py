"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

A Messages request is decoded into typed Structs (bounded as the other bodies are: the body's
bytes by the server's ``max_body_bytes``, its messages, blocks and tools by the limits below)
and parsed into the chat request it asks for
(:class:`~twostroke.engine.server.chat_request.ChatRequest`), every refusal naming the
Messages field: ``system`` as a first system turn, ``text`` blocks as turn text, an
assistant's ``tool_use`` blocks as its calls (``input`` as the arguments' JSON), a user's
``tool_result`` blocks as ``tool`` turns, ``tools`` (``input_schema``) and ``tool_choice``
(``auto``, ``any``, ``tool``, ``none``), ``stop_sequences``. The chat service
(:mod:`~twostroke.engine.server.chat_service`) runs it as it runs ``/v1/responses``: the same
prompt (rendered off the event loop), sampling parameters, constraint and tool calls as
``/v1/chat/completions`` computes for the same conversation. The answer's typed events, whole
or as they stream, are folded into Anthropic content blocks and events
(:mod:`~twostroke.engine.server.message_events`).

``max_tokens`` is required, as Anthropic requires it. ``thinking`` is accepted; a ``thinking`` block
comes back where the server reads the model's reasoning apart (its reasoning parser, see
docs/serving.md), before the answer's blocks, and never otherwise (a block is not invented);
``thinking`` blocks a client sends back in an assistant turn are dropped (as Anthropic drops earlier
turns' thinking from the context). ``cache_control``, ``metadata``, ``service_tier`` and unknown
fields are ignored; ``image`` and ``document`` blocks, and tools of Anthropic's server-side types
(``web_search_...``, ``bash_...``), are a 400 naming them. Errors are in Anthropic's shape
(:func:`~twostroke.engine.server.errors.anthropic_error`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.types import Receive, Send

from twostroke.engine.config import ServerConfig
from twostroke.engine.server import protocol
from twostroke.engine.server.body import read_body
from twostroke.engine.server.chat_request import ChatRequest, FieldNames
from twostroke.engine.server.chat_request import ToolChoice as Choice
from twostroke.engine.server.chat_service import ChatService
from twostroke.engine.server.errors import invalid_request
from twostroke.engine.server.event_writer import EventWriter
from twostroke.engine.server.message_events import PING, MessageDraft
from twostroke.engine.server.protocol import MAX_TOOL_CALL_ID_LENGTH
from twostroke.engine.server.sse import Disconnected, send_json
from twostroke.engine.server.structured import MAX_TOOLS, tool_specs
from twostroke.engine.surface import EngineSurface
from twostroke.engine.tools.formats import FUNCTION_NAME, FUNCTION_NAME_RULE, ToolCall, ToolSpec
from twostroke.engine.tools.prompt import Turn

__all__ = [
    "MAX_BLOCKS",
    "MAX_MESSAGES",
    "MAX_TEMPERATURE",
    "NAMES",
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
    """``thinking``: accepted; thinking blocks come from the server's reasoning parser, not
    from this field (a model thinks as its chat template makes it)."""

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


#: How a Messages request names its fields.
NAMES = FieldNames(prompt="messages", max_tokens="max_tokens", stop="stop_sequences",
                   tool="tools[{}]", parameters="input_schema")  # fmt: skip


class _Conversation:
    """The turns of one request, built block by block."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.blocks = 0
        self.names: dict[str, str] = {}  # a tool_use id -> its tool's name

    def count(self, where: str) -> None:
        self.blocks += 1
        if self.blocks > MAX_BLOCKS:
            raise invalid_request(
                f"{where}: a request may hold <= {MAX_BLOCKS} content blocks in all",
                param="messages",
            )


def _text_blocks(content: str | list[Block] | None, where: str, out: _Conversation) -> str:
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


def _system(body: CountTokensRequest, out: _Conversation) -> None:
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
        out.turns.append(Turn("system", text))


def _tool_use(block: Block, where: str, out: _Conversation) -> ToolCall:
    """A ``tool_use`` block as the call it records, checked."""
    if block.id is None or block.name is None or block.input is None:
        raise invalid_request(f"{where}: a tool_use block needs id, name and input",
                              param="messages")  # fmt: skip
    if not 1 <= len(block.id) <= MAX_TOOL_CALL_ID_LENGTH:
        raise invalid_request(f"{where}.id must be 1 to {MAX_TOOL_CALL_ID_LENGTH} characters, "
                              f"got {len(block.id)}", param="messages")  # fmt: skip
    if block.id in out.names:
        raise invalid_request(f"{where}.id {block.id[:80]!r} is not unique", param="messages")
    if not FUNCTION_NAME.fullmatch(block.name):
        raise invalid_request(f"{where}.name must be {FUNCTION_NAME_RULE}, got "
                              f"{block.name[:80]!r}", param="messages")  # fmt: skip
    out.names[block.id] = block.name
    return ToolCall(block.id, block.name, json.dumps(block.input, ensure_ascii=False))


def _message(index: int, message: Message, out: _Conversation) -> None:
    """One Anthropic message as turns (tool results first, as Anthropic orders a user
    turn's blocks; then its text and calls)."""
    where = f"messages[{index}]"
    if message.role not in _ROLES:
        raise invalid_request(f"{where}.role must be 'user' or 'assistant', got "
                              f"{message.role[:40]!r}", param="messages")  # fmt: skip
    if isinstance(message.content, str):
        out.turns.append(Turn(message.role, message.content))
        return
    texts: list[str] = []
    calls: list[ToolCall] = []
    for number, block in enumerate(message.content):
        at = f"{where}.content[{number}]"
        out.count(at)
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append(_tool_use(block, at, out))
        elif block.type == "tool_result" and message.role == "user":
            call_id = block.tool_use_id
            if call_id is None or call_id not in out.names:
                raise invalid_request(
                    f"{at}: no tool_use block with id {call_id!r} comes before this tool_result",
                    param="messages",
                )
            content = _text_blocks(block.content, f"{at}.content", out)
            out.turns.append(Turn("tool", content, tool_call_id=call_id,
                                  name=out.names[call_id]))  # fmt: skip
        elif block.type in _THINKING and message.role == "assistant":
            continue
        else:
            kinds = "tool_use and thinking" if message.role == "assistant" else "tool_result"
            raise invalid_request(
                f"{at}: a {message.role} message may hold text and {kinds} blocks, got type "
                f"{block.type[:40]!r}",
                param="messages",
            )
    if len(calls) > MAX_TOOLS:
        raise invalid_request(f"{where} may hold <= {MAX_TOOLS} tool_use blocks, got "
                              f"{len(calls)}", param="messages")  # fmt: skip
    if texts or calls or not message.content:
        out.turns.append(Turn(message.role, "".join(texts), tuple(calls)))


def _tools(body: CountTokensRequest) -> tuple[ToolSpec, ...]:
    """``tools``: the client's own (custom) tools, checked."""
    given = []
    for index, tool in enumerate(body.tools or ()):
        if tool.type not in (None, "custom"):
            raise invalid_request(
                f"tools[{index}].type must be 'custom' or absent (this server runs only "
                f"the client's tools), got {tool.type[:40]!r}",
                param=f"tools[{index}].type",
            )
        given.append((tool.name, tool.description, tool.input_schema))
    return tool_specs(given, NAMES)


def _tool_choice(choice: ToolChoice | None) -> tuple[Choice | None, bool]:
    """``tool_choice`` as the chat service takes it, and whether calls may be parallel."""
    if choice is None:
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise invalid_request("tool_choice of type 'tool' needs name", param="tool_choice")
        return Choice("function", choice.name), parallel
    modes: dict[str, Literal["auto", "required", "none"]] = {
        "auto": "auto", "any": "required", "none": "none"}  # fmt: skip
    return Choice(modes[choice.type]), parallel


def chat_request(body: CountTokensRequest) -> ChatRequest:
    """The chat request a Messages request (or a count_tokens one) asks for, its errors
    naming its own fields.

    Raises:
        ApiError: 400 naming the field: a block, tool or parameter that is malformed, or
            past its limit.
    """
    if not body.messages:
        raise invalid_request("messages must not be empty", param="messages")
    if len(body.messages) > MAX_MESSAGES:
        raise invalid_request(f"messages must hold <= {MAX_MESSAGES} messages, got "
                              f"{len(body.messages)}", param="messages")  # fmt: skip
    out = _Conversation()
    _system(body, out)
    for index, message in enumerate(body.messages):
        _message(index, message, out)
    sampling = _sampling(body) if isinstance(body, MessagesRequest) else {}
    tools = _tools(body)
    choice, parallel = _tool_choice(body.tool_choice)
    return ChatRequest(NAMES, tuple(out.turns), tools=tools, tool_choice=choice,
                       parallel_tool_calls=parallel, **sampling)  # fmt: skip


def _sampling(body: MessagesRequest) -> dict[str, Any]:
    if body.max_tokens < 1:
        raise invalid_request(f"max_tokens must be >= 1, got {body.max_tokens}",
                              param="max_tokens")  # fmt: skip
    if body.temperature is not None and not 0 <= body.temperature <= MAX_TEMPERATURE:  # NaN too
        raise invalid_request(
            f"temperature must be in [0, {MAX_TEMPERATURE}], got {body.temperature}",
            param="temperature",
        )
    stop = tuple(body.stop_sequences or ())
    # The engine does not report which stop string matched: kept in the text, where the
    # draft finds it, takes it off and names it (message_events).
    return {"max_tokens": body.max_tokens, "temperature": body.temperature,
            "top_p": body.top_p, "top_k": body.top_k, "stop": stop,
            "include_stop": bool(stop), "stream": body.stream}  # fmt: skip


class Messages:
    """The ``/v1/messages`` endpoints over one engine.

    Args:
        engine: The engine surface.
        chat: The chat service that prepares and runs the requests.
        config: The server's limits: a body is read up to its ``max_body_bytes``.
    """

    def __init__(self, engine: EngineSurface, chat: ChatService, config: ServerConfig) -> None:
        self._engine = engine
        self._chat = chat
        self._config = config

    async def count_tokens(self, request: Request, receive: Receive, send: Send) -> None:
        """Answer one ``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``, the
        tokens of the prompt a Messages request with this body would have."""
        body = protocol.decode_body(
            await read_body(request, self._config.max_body_bytes), CountTokensRequest
        )
        protocol.check_model(body.model, self._engine.model_name)
        prompt = await self._chat.prompt(chat_request(body))
        try:
            tokens = await self._engine.tokenize(prompt)  # in a worker thread
        except (TypeError, ValueError) as exc:  # the template's or the tokenizer's refusal
            raise invalid_request(str(exc), param="messages") from None
        await send_json(send, 200, {"input_tokens": len(tokens)})

    async def create(self, request: Request, receive: Receive, send: Send) -> None:
        """Answer one ``POST /v1/messages``: a Message object, or its event stream."""
        body = protocol.decode_body(
            await read_body(request, self._config.max_body_bytes), MessagesRequest
        )
        protocol.check_model(body.model, self._engine.model_name)
        prepared = await self._chat.prepare(chat_request(body))
        draft = MessageDraft(self._engine.model_name, body.stop_sequences or ())
        async with self._chat.open_run(prepared) as run:
            if not await run.submit(receive):
                return  # the client left while its prompt was prepared: nothing queued
            draft.input_tokens = run.prompt_tokens
            if body.stream:
                await run.stream(receive, EventWriter(send, draft, ping=PING))
                return
            events = await run.collect(receive)
            if events is None:
                return
            draft.apply(events)
            draft.end()
            try:
                await send_json(send, 200, draft.message())
            except OSError as exc:  # the client left between the answer and its sending
                raise Disconnected from exc
