"""``/v1/responses``: OpenAI's Responses API on the chat service, with stored responses.

A Responses request is parsed into the chat request it asks for
(:class:`~twostroke.engine.server.chat_request.ChatRequest`: its ``input`` items as turns,
``instructions`` as a first system turn, ``text.format`` as its JSON output, its flat function
``tools`` and ``tool_choice``), every refusal naming the Responses field, and run by the chat
service (:mod:`~twostroke.engine.server.chat_service`): the same prompt, sampling parameters,
constraint and tool calls as ``/v1/chat/completions`` computes for the same conversation. The
answer's typed events, whole or as they stream, are folded into Responses output items
(``message`` with ``output_text``, ``function_call`` with ``call_id``, ``name`` and
``arguments``) and, when streamed, the Responses event sequence with sequence numbers
(:mod:`~twostroke.engine.server.response_events`).

A Response is stored (``store``, true by default as OpenAI's) in the server's
:class:`~twostroke.engine.server.response_store.ResponseStore` with every input item of its
context, before its answer (or its stream's last event) goes out, so that a client may name
it at once: ``previous_response_id`` continues from it, as OpenAI defines it (its input
items, then its output items, then the new ``input``; its ``instructions`` are not carried
over), ``GET /v1/responses/{id}`` reads it, ``DELETE`` removes it and ``GET
/v1/responses/{id}/input_items`` lists its input items as OpenAI's paginated list. An id is
checked for its shape before the database is asked. What needs more state than that
(``background: true``, ``conversation``, a stored ``prompt``, an ``item_reference``) is a 400
that says so. Unknown fields are ignored, as on the chat endpoint; known ones this server
cannot honour are a 400 naming them.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from functools import partial
from typing import Any, Literal

import anyio
import attrs
import msgspec
from starlette.requests import Request
from starlette.types import Receive, Send

from twostroke.engine.config import ServerConfig
from twostroke.engine.server import protocol
from twostroke.engine.server.body import read_body
from twostroke.engine.server.chat_request import ChatRequest, FieldNames, OutputFormat, ToolChoice
from twostroke.engine.server.chat_service import ChatService
from twostroke.engine.server.errors import ApiError, invalid_request
from twostroke.engine.server.event_writer import EventWriter
from twostroke.engine.server.response_events import ResponseDraft
from twostroke.engine.server.response_store import (
    ResponseStore,
    ResponseStoreError,
    StoredResponse,
)
from twostroke.engine.server.sse import Disconnected, send_json
from twostroke.engine.server.structured import MAX_TOOLS, tool_specs
from twostroke.engine.surface import EngineSurface
from twostroke.engine.tools.formats import FUNCTION_NAME, FUNCTION_NAME_RULE, ToolCall, ToolSpec
from twostroke.engine.tools.prompt import Turn

__all__ = [
    "MAX_CALL_ID_LENGTH",
    "MAX_INPUT_ITEMS",
    "MAX_LIST_LIMIT",
    "MAX_TEMPERATURE",
    "NAMES",
    "Responses",
    "ResponsesRequest",
    "chat_request",
]

#: The highest ``temperature``, as the Responses API documents it.
MAX_TEMPERATURE = 2.0
#: The most items ``input`` may hold.
MAX_INPUT_ITEMS = 2048
#: The longest ``call_id`` a ``function_call`` or ``function_call_output`` item may carry.
MAX_CALL_ID_LENGTH = 128
#: The most items one page of ``GET /v1/responses/{id}/input_items`` holds (OpenAI's).
MAX_LIST_LIMIT = 100
#: A response id as this server makes them; checked before the database is asked.
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
#: An item id, as ``after`` names one: this server's are a prefix and 32 hex digits.
_ITEM_ID = re.compile(r"[a-z]{1,8}_[0-9a-f]{32}")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_STATELESS = (
    "this server stores responses (previous_response_id), not conversations, prompts or "
    "background runs"
)

logger = logging.getLogger("twostroke.server")


class _Part(msgspec.Struct, kw_only=True):
    """A content part of an input item (only text parts are accepted)."""

    type: str
    text: str | None = None


class _Item(msgspec.Struct, kw_only=True):
    """One item of ``input``: a message, a ``function_call`` or a ``function_call_output``.

    One loose shape for all of them, so that a field missing from its kind is a 400 naming
    the item and the field rather than a decoder's message.
    """

    type: str = "message"
    role: str | None = None
    content: str | list[_Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_Part] | None = None


class _Tool(msgspec.Struct, kw_only=True):
    """One of ``tools``, flat as the Responses API has them: only ``function`` is served."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamedChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` as an object: ``{"type": "function", "name": ...}`` is served."""

    type: str
    name: str | None = None


class _TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class _Text(msgspec.Struct, kw_only=True):
    format: _TextFormat | None = None
    verbosity: str | None = None  # for reasoning models; accepted and ignored


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``: the fields this server reads (others are ignored)."""

    input: str | list[_Item]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: _Text | None = None
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None  # None: true, as OpenAI's default
    # Need more state than stored responses: a 400 that says so.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # Would change the answer, and this server cannot honour them: a 400 naming them.
    reasoning: Any = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None


def _refuse_unsupported(body: ResponsesRequest) -> None:
    """The 400s for stateful fields and for fields this server cannot honour."""
    stateful = [
        ("background", body.background is True),
        ("conversation", body.conversation is not None),
        ("prompt", body.prompt is not None),
    ]
    for field, given in stateful:
        if given:
            shown = "true" if field == "background" else "given"
            raise invalid_request(
                f"{field} ({shown}) is not supported: {_STATELESS}; send the conversation "
                "as input, or continue a stored response with previous_response_id",
                param=field,
                code="unsupported_parameter",
            )
    unsupported = [
        (
            "reasoning",
            body.reasoning is not None,
            "whether and how long a model thinks is its chat template's; a thinking model's "
            "reasoning comes back as a reasoning item",
        ),
        ("include", bool(body.include), f"got {body.include!r}"),
        ("top_logprobs", bool(body.top_logprobs), f"got {body.top_logprobs}"),
        (
            "truncation",
            body.truncation not in (None, "disabled"),
            f"only 'disabled' is, got {body.truncation!r}",
        ),
        ("max_tool_calls", body.max_tool_calls is not None, f"got {body.max_tool_calls}"),
    ]
    for field, given, detail in unsupported:
        if given:
            raise invalid_request(
                f"{field} is not supported by this server ({detail})", param=field
            )


def _text(content: str | list[_Part] | None, where: str) -> str:
    """The text of an item's content or output: a string, or text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise invalid_request(
                f"{where}[{index}]: only text parts (input_text, output_text) are supported, "
                f"got type {part.type!r}",
                param="input",
            )
        texts.append(part.text)
    return "".join(texts)


def _call_id(item: _Item, where: str) -> str:
    call_id = item.call_id
    if not call_id or len(call_id) > MAX_CALL_ID_LENGTH:
        shown = "none" if call_id is None else f"{len(call_id)} characters"
        raise invalid_request(
            f"{where}.call_id must be a string of 1 to {MAX_CALL_ID_LENGTH} characters, "
            f"got {shown}",
            param="input",
        )
    return call_id


#: How a Responses request names its fields.
NAMES = FieldNames(prompt="input", max_tokens="max_output_tokens", format="text.format",
                   schema="text.format.schema", tool="tools[{}]")  # fmt: skip


class _Conversation:
    """The turns of one request, built item by item: a ``function_call`` item joins the
    assistant turn right before it (a response's text and calls are one turn, as chat has
    them) or opens one."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self._calls_from: str | None = None  # the item of the last turn's first call
        self.names: dict[str, str] = {}  # call_id -> the function's name

    def add(self, turn: Turn) -> None:
        self.turns.append(turn)
        self._calls_from = None

    def call(self, call: ToolCall, where: str) -> None:
        last = self.turns[-1] if self.turns else None
        if last is None or last.role != "assistant":
            self.add(Turn("assistant"))
            last = self.turns[-1]
        first = self._calls_from = self._calls_from or where
        if len(last.tool_calls) >= MAX_TOOLS:
            raise invalid_request(
                f"{first} to {where} (the function_call items of one turn) must hold <= "
                f"{MAX_TOOLS} calls, got {len(last.tool_calls) + 1}",
                param="input",
            )
        self.turns[-1] = attrs.evolve(last, tool_calls=(*last.tool_calls, call))


def _function_call(item: _Item, where: str, out: _Conversation) -> ToolCall:
    """A ``function_call`` item as the call it records, checked."""
    call_id = _call_id(item, where)
    if item.name is None or item.arguments is None:
        raise invalid_request(
            f"{where}: a function_call item needs name and arguments", param="input"
        )
    if not FUNCTION_NAME.fullmatch(item.name):
        raise invalid_request(
            f"{where}.name must be {FUNCTION_NAME_RULE}, got {item.name[:80]!r}",
            param="input",
        )
    try:
        json.loads(item.arguments)
    except (ValueError, RecursionError):
        raise invalid_request(
            f"{where}.arguments must be JSON text, got {item.arguments[:80]!r}",
            param="input",
        ) from None
    if call_id in out.names:
        raise invalid_request(f"{where}.call_id {call_id!r} is not unique", param="input")
    out.names[call_id] = item.name
    return ToolCall(call_id, item.name, item.arguments)


def _turns(body: ResponsesRequest) -> tuple[Turn, ...]:
    """``instructions`` and ``input`` as the conversation's turns.

    A ``function_call`` item becomes a call of an assistant turn (see
    :class:`_Conversation`); a ``function_call_output`` a ``tool`` turn with its call's id
    and the function's name.
    """
    out = _Conversation()
    if body.instructions is not None:
        out.add(Turn("system", body.instructions))
    if isinstance(body.input, str):
        out.add(Turn("user", body.input))
        return tuple(out.turns)
    if not body.input:
        raise invalid_request("input must not be empty", param="input")
    if len(body.input) > MAX_INPUT_ITEMS:
        raise invalid_request(
            f"input must hold <= {MAX_INPUT_ITEMS} items, got {len(body.input)}", param="input"
        )
    for index, item in enumerate(body.input):
        where = f"input[{index}]"
        if item.type == "message":
            role = _ROLES.get(item.role or "")
            if role is None:
                raise invalid_request(
                    f"{where}.role must be one of {', '.join(_ROLES)}, got {item.role!r}",
                    param="input",
                )
            out.add(Turn(role, _text(item.content, f"{where}.content")))
        elif item.type == "function_call":
            out.call(_function_call(item, where, out), where)
        elif item.type == "function_call_output":
            call_id = _call_id(item, where)
            if call_id not in out.names:
                raise invalid_request(
                    f"{where}: no function_call with call_id {call_id!r} comes before this "
                    "function_call_output in input",
                    param="input",
                )
            output = _text(item.output, f"{where}.output")
            out.add(Turn("tool", output, tool_call_id=call_id, name=out.names[call_id]))
        elif item.type == "reasoning":
            # A thinking model's earlier reasoning (an output item sent back, or a stored
            # one continued) is not part of the context, as its chat template drops it.
            continue
        elif item.type == "item_reference":
            raise invalid_request(
                f"{where}: item_reference is not supported: {_STATELESS}; send the items "
                "themselves",
                param="input",
                code="unsupported_parameter",
            )
        else:
            raise invalid_request(
                f"{where}.type must be message, function_call, function_call_output or "
                f"reasoning, got {item.type!r}",
                param="input",
            )
    return tuple(out.turns)


def _tools(body: ResponsesRequest) -> tuple[ToolSpec, ...]:
    """``tools``, flat as the Responses API has them, checked."""
    given = []
    for index, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise invalid_request(
                f"tools[{index}].type must be 'function' (the only tools this server "
                f"runs), got {tool.type!r}",
                param=f"tools[{index}].type",
            )
        if tool.name is None:
            raise invalid_request(f"tools[{index}].name is required",
                                  param=f"tools[{index}].name")  # fmt: skip
        given.append((tool.name, tool.description, tool.parameters))
    return tool_specs(given, NAMES)


def _tool_choice(body: ResponsesRequest) -> ToolChoice | None:
    choice = body.tool_choice
    if not isinstance(choice, _NamedChoice):
        return None if choice is None else ToolChoice(choice)
    if choice.type == "function" and choice.name is None:
        raise invalid_request("tool_choice of type 'function' needs name", param="tool_choice")
    if choice.type != "function" or choice.name is None:
        raise invalid_request(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
            f"'name': ...}}, got type {choice.type!r}",
            param="tool_choice",
        )
    return ToolChoice("function", choice.name)


def _output(body: ResponsesRequest) -> OutputFormat | None:
    fmt = None if body.text is None else body.text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputFormat()
    if fmt.name is None or not FUNCTION_NAME.fullmatch(fmt.name):
        shown = "none" if fmt.name is None else repr(fmt.name[:80])
        raise invalid_request(
            f"text.format.name must be {FUNCTION_NAME_RULE}, got {shown}",
            param="text.format.name",
        )
    if fmt.schema is None:
        raise invalid_request("text.format of type json_schema needs schema",
                              param="text.format")  # fmt: skip
    return OutputFormat(fmt.schema)


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request asks for, its errors naming its own fields.

    Raises:
        ApiError: 400 naming the field: a stateful field, one this server cannot honour, or
            an input item, tool or format that is malformed.
    """
    _refuse_unsupported(body)
    turns = _turns(body)
    if body.temperature is not None and not 0 <= body.temperature <= MAX_TEMPERATURE:  # NaN too
        raise invalid_request(
            f"temperature must be in [0, {MAX_TEMPERATURE}], got {body.temperature}",
            param="temperature",
        )
    output = _output(body)
    return ChatRequest(
        NAMES,
        turns,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=_tools(body),
        tool_choice=_tool_choice(body),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        output=output,
        stream=body.stream,
    )


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's fields that a Response repeats."""
    fmt: dict[str, Any] = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        fmt = msgspec.to_builtins(body.text.format)
    choice = body.tool_choice
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {"format": fmt},
        "tool_choice": (
            msgspec.to_builtins(choice) if isinstance(choice, _NamedChoice) else choice or "auto"
        ),
        "tools": [msgspec.to_builtins(tool) for tool in body.tools or ()],
        "truncation": "disabled",
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _response_id(value: str, param: str) -> str:
    """``value`` if it has the shape of this server's response ids (``resp_`` and 32 hex
    digits), checked before any database is asked about it.

    Raises:
        ApiError: 400 ``invalid_value`` naming ``param`` and the value.
    """
    if not _RESPONSE_ID.fullmatch(value):
        raise invalid_request(
            f"{param} must be 'resp_' and 32 lowercase hex digits, as this server's response "
            f"ids are, got {value[:80]!r}",
            param=param,
            code="invalid_value",
        )
    return value


def _parts(content: str | list[_Part] | None, kind: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    return [{"type": part.type, "text": part.text} for part in content or ()]


def _input_items(given: str | list[_Item]) -> list[dict[str, Any]]:
    """A request's own ``input`` as stored input items: OpenAI's item shapes, each with an
    id of this server's (a client's ids are not kept: ``after`` pages by them, and two
    equal ones would make a page ambiguous). Called once ``input`` was checked."""
    if isinstance(given, str):
        return [{"id": _item_id("msg"), "type": "message", "role": "user",
                 "content": _parts(given, "input_text"), "status": "completed"}]  # fmt: skip
    items: list[dict[str, Any]] = []
    for item in given:
        if item.type == "message":
            kind = "output_text" if item.role == "assistant" else "input_text"
            items.append({"id": _item_id("msg"), "type": "message", "role": item.role,
                          "content": _parts(item.content, kind),
                          "status": "completed"})  # fmt: skip
        elif item.type == "function_call":
            items.append({"id": _item_id("fc"), "type": "function_call",
                          "call_id": item.call_id, "name": item.name,
                          "arguments": item.arguments, "status": "completed"})  # fmt: skip
        elif item.type == "reasoning":
            items.append({"id": _item_id("rs"), "type": "reasoning", "summary": [],
                          "content": _parts(item.content, "reasoning_text")})  # fmt: skip
        else:  # function_call_output: the only other kind _turns lets through
            output = item.output if isinstance(item.output, str) else _parts(item.output, "")
            items.append({"id": _item_id("fco"), "type": "function_call_output",
                          "call_id": item.call_id, "output": output,
                          "status": "completed"})  # fmt: skip
    return items


def _continued(body: ResponsesRequest, previous: StoredResponse | None) -> ResponsesRequest:
    """``body`` with the conversation it continues as its ``input``: the previous
    response's input items, its output items, then the body's own ``input``."""
    if previous is None:
        return body
    own = [body.input] if isinstance(body.input, str) else body.input
    before = msgspec.convert([*previous.input_items, *previous.response["output"]], list[_Item])
    items = [_Item(role="user", content=item) if isinstance(item, str) else item for item in own]
    return msgspec.structs.replace(body, input=[*before, *items])


def _page(
    items: list[dict[str, Any]], *, limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """One page of ``items`` as OpenAI's list: ``data``, ``first_id``, ``last_id``,
    ``has_more``.

    Raises:
        ApiError: 400 naming ``after`` when it is no item of the list.
    """
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise invalid_request(f"after names no input item of this response, got {after!r}",
                                  param="after")  # fmt: skip
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }


def _list_query(request: Request) -> tuple[int, str, str | None]:
    """``limit`` (1 to :data:`MAX_LIST_LIMIT`, 20 by default), ``order`` (``asc`` or
    ``desc``, the default, as OpenAI's) and ``after`` of a list's query string.

    Raises:
        ApiError: 400 naming the parameter.
    """
    query = request.query_params
    text = query.get("limit", "20")
    if not (text.isdigit() and len(text) <= 4 and 1 <= int(text) <= MAX_LIST_LIMIT):
        raise invalid_request(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got "
                              f"{text[:80]!r}", param="limit")  # fmt: skip
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request(f"order must be 'asc' or 'desc', got {order[:80]!r}",
                              param="order")  # fmt: skip
    after = query.get("after")
    if after is not None and not _ITEM_ID.fullmatch(after):
        raise invalid_request(f"after must be an item id such as 'msg_' and 32 hex digits, "
                              f"got {after[:80]!r}", param="after")  # fmt: skip
    return int(text), order, after


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.",
                    type="invalid_request_error", param="response_id")  # fmt: skip


def _store_failed(exc: ResponseStoreError) -> ApiError:
    logger.error("%s", exc)
    return ApiError(500, "the response store could not be read or written",
                    type="server_error", code="response_store_failed")  # fmt: skip


class Responses:
    """The ``/v1/responses`` endpoints over one engine and one response store.

    Args:
        engine: The engine surface.
        chat: The chat service that prepares and runs the requests.
        config: The server's limits: a body is read up to its ``max_body_bytes``.
        store: Where responses are stored.
        owner: The namespace of this server's responses in ``store``
            (:func:`~twostroke.engine.server.response_store.owner_of` its API key).
    """

    def __init__(
        self,
        engine: EngineSurface,
        chat: ChatService,
        config: ServerConfig,
        *,
        store: ResponseStore,
        owner: str,
    ) -> None:
        self._engine = engine
        self._chat = chat
        self._config = config
        self._store = store
        self._owner = owner

    async def _stored(self, request: Request) -> tuple[str, StoredResponse]:
        """The response the path names, or its 400 (a malformed id) or 404."""
        wanted = _response_id(request.path_params["response_id"], "response_id")
        try:
            stored = await self._store.get(self._owner, wanted)
        except ResponseStoreError as exc:
            raise _store_failed(exc) from None
        if stored is None:
            raise _not_found(wanted)
        return wanted, stored

    async def retrieve(self, request: Request, receive: Receive, send: Send) -> None:
        """Answer ``GET /v1/responses/{id}``: the stored Response."""
        _, stored = await self._stored(request)
        await send_json(send, 200, stored.response)

    async def input_items(self, request: Request, receive: Receive, send: Send) -> None:
        """Answer ``GET /v1/responses/{id}/input_items``: a page of its input items."""
        limit, order, after = _list_query(request)  # before the database is asked
        _, stored = await self._stored(request)
        page = _page(stored.input_items, limit=limit, order=order, after=after)
        await send_json(send, 200, page)

    async def delete(self, request: Request, receive: Receive, send: Send) -> None:
        """Answer ``DELETE /v1/responses/{id}``: ``{"id", "object", "deleted": true}``."""
        wanted = _response_id(request.path_params["response_id"], "response_id")
        try:
            deleted = await self._store.delete(self._owner, wanted)
        except ResponseStoreError as exc:
            raise _store_failed(exc) from None
        if not deleted:
            raise _not_found(wanted)
        await send_json(send, 200, {"id": wanted, "object": "response", "deleted": True})

    async def _previous(self, body: ResponsesRequest) -> StoredResponse | None:
        """The stored response ``previous_response_id`` names, or its 400."""
        if body.previous_response_id is None:
            return None
        wanted = _response_id(body.previous_response_id, "previous_response_id")
        try:
            previous = await self._store.get(self._owner, wanted)
        except ResponseStoreError as exc:
            raise _store_failed(exc) from None
        if previous is None:  # OpenAI's answer: a 400, not a 404
            raise invalid_request(
                f"Previous response with id '{wanted}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return previous

    async def _keep(self, draft: ResponseDraft, items: list[dict[str, Any]]) -> None:
        """Store the finished response, before its answer goes out (a client may name it
        at once); one the store cannot take is answered with ``store: false``."""
        if not draft.store:
            return
        try:
            with anyio.CancelScope(shield=True):  # the answer is computed: keep it whole
                draft.store = await self._store.put(self._owner, draft.response(), items)
        except ResponseStoreError as exc:
            logger.error("response %s not stored: %s", draft.id, exc)
            draft.store = False  # what a client reads back says so

    async def _kept(
        self, draft: ResponseDraft, items: list[dict[str, Any]], events: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """A stream's last ``events``, once the response is stored: the final object as
        stored (the store may have refused it)."""
        await self._keep(draft, items)
        if events and "response" in events[-1]:
            events[-1]["response"] = draft.response()
        return events

    async def create(self, request: Request, receive: Receive, send: Send) -> None:
        """Answer one ``POST /v1/responses``: a Response object, or its event stream."""
        body = protocol.decode_body(
            await read_body(request, self._config.max_body_bytes), ResponsesRequest
        )
        protocol.check_model(body.model, self._engine.model_name)
        _refuse_unsupported(body)  # before the store is asked
        previous = await self._previous(body)
        asked = chat_request(_continued(body, previous))
        if body.store is not False:  # its next turn continues from its KV
            asked = attrs.evolve(asked, cache_ttl=self._config.responses_cache_ttl)
        items: list[dict[str, Any]] = []
        if body.store is not False:  # the context's items, as stored with the response
            if previous is not None:
                items = [*previous.input_items, *previous.response["output"]]
            items += _input_items(body.input)
        prepared = await self._chat.prepare(asked)
        draft = ResponseDraft(
            self._engine.model_name,
            _echo(body),
            previous_response_id=body.previous_response_id,
            store=body.store is not False,
        )
        async with self._chat.open_run(prepared) as run:
            if not await run.submit(receive):
                return  # the client left while its prompt was prepared: nothing queued
            if body.stream:
                keep = partial(self._kept, draft, items)
                await run.stream(receive, EventWriter(send, draft, before_end=keep))
                return
            events = await run.collect(receive)
            if events is None:
                return
            draft.apply(events)
            draft.end()
            await self._keep(draft, items)
            try:
                await send_json(send, 200, draft.response())
            except OSError as exc:  # the client left between the answer and its sending
                raise Disconnected from exc
