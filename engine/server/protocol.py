"""The OpenAI API's request bodies as typed values, and their translation to the engine's.

Bodies are decoded by msgspec straight into the Structs below: a field of the wrong type is a
400 that names the field, unknown fields are ignored (as OpenAI's clients expect). Values are
then checked by :class:`~twostroke.states.params.SamplingParams` itself, whose messages name
the field and the rule. Parameters the engine cannot honour are rejected with a 400 naming
them rather than silently ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import msgspec

from twostroke.engine.server.errors import ApiError, invalid_request
from twostroke.engine.tools.formats import (
    FUNCTION_NAME,
    FUNCTION_NAME_RULE,
    GENERIC,
    ToolCall,
    ToolFormat,
    ToolSpec,
)
from twostroke.engine.tools.prompt import Turn, render_prompt
from twostroke.states.constraints import Constraint
from twostroke.states.params import MAX_LOGPROBS, SamplingParams
from twostroke.states.validators import is_int

__all__ = [
    "MAX_N",
    "MAX_TOOLS",
    "MAX_TOOL_CALL_ID_LENGTH",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "FunctionDefinition",
    "JsonSchemaFormat",
    "NamedToolChoice",
    "ResponseFormat",
    "StructuredOutputs",
    "TokenizeRequest",
    "Tool",
    "chat_messages",
    "chat_turns",
    "check_choices",
    "check_model",
    "choice_params",
    "completion_prompts",
    "decode_body",
    "max_tokens_field",
]

#: The most tools one chat request may offer, and the most calls one message may hold
#: (OpenAI's own limit is 128).
MAX_TOOLS = 128
#: The most choices (``n``) one request may ask for.
MAX_N = 128
#: The longest id of a tool call in a message (OpenAI's are 29 to 40 characters).
MAX_TOOL_CALL_ID_LENGTH = 256
_SEED_MODULUS = 2**63
_T = TypeVar("_T")
_SEED_STRIDE = 0x9E37_79B9_7F4A_7C15  # the golden-ratio increment of splitmix64


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # the output is constrained either way
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs`` extra field: exactly one of the constraints."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options this server cannot honour: a 400 naming them, never ignored.
    whitespace_pattern: str | None = None
    structural_tag: Any = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    """One of ``tools``: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming a function: ``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"]
    function: FunctionName


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields that completions and chat completions share (vLLM's extras included)."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # accepted and ignored, as OpenAI documents it
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    priority: int = 0  # vLLM's: lower runs first (SamplingParams.priority)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older extra fields, replaced by ``structured_outputs``: refused, never ignored.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``."""

    prompt: str | list[Any]
    max_tokens: int | None = None  # SamplingParams' default (16) when not given
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class MessageToolCall(msgspec.Struct, kw_only=True):
    """One of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers


class ChatCompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # neither given: as many as the context leaves
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI's default
    # vLLM's: more variables for the chat template (Qwen3's ``enable_thinking``)
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: a prompt or chat messages."""

    model: str | None = None
    prompt: str | list[Any] | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")


def decode_body(body: bytes, kind: type[_T]) -> _T:
    """Decode and type-check a JSON request body.

    Raises:
        ApiError: 400 for malformed JSON, JSON nested deeper than the decoder recurses
            (Python's recursion limit, about 1,000 levels), or a field of the wrong type
            (``param`` names it).
    """
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        raise invalid_request(str(exc), param=match.group(1) if match else None) from None
    except msgspec.DecodeError as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec raises it past the recursion limit: "[[[[...]]]]"
        raise invalid_request(
            "the request body is nested too deeply: JSON may nest at most about 1,000 levels"
        ) from None


def check_choices(num_prompts: int, n: int, limit: int) -> None:
    """Refuse a request for more than ``limit`` choices (prompts × ``n``), before any work.

    Args:
        num_prompts: The prompts of the request (1 for a chat).
        n: Choices per prompt, as the request asks.
        limit: The most choices in all (the server's ``max_choices``).

    Raises:
        ApiError: 400 naming ``n`` (or ``prompt``, when ``n`` is 1) for too many.
    """
    if not 1 <= n <= MAX_N:
        raise invalid_request(f"n must be in [1, {MAX_N}], got {n}", param="n")
    total = num_prompts * n
    if total > limit:
        raise invalid_request(
            f"the choices of a request (prompts x n) must be <= {limit}, got {num_prompts} "
            f"prompts x n={n} = {total}",
            param="n" if n > 1 else "prompt",
            code="too_many_choices",
        )


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: text, token ids, or a list of either.

    Raises:
        ApiError: 400 naming ``prompt`` for any other shape.
    """
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(item, str) for item in prompt):
        return list(prompt)
    if prompt and all(_is_token_ids(item) for item in prompt):
        return [list(item) for item in prompt]
    if prompt and all(is_int(item) for item in prompt):
        return [list(prompt)]
    raise invalid_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids, and must not be empty",
        param="prompt",
    )


def _is_token_ids(item: object) -> bool:
    return isinstance(item, list) and bool(item) and all(is_int(i) for i in item)


def _text(index: int, content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise invalid_request(
                f"messages[{index}]: only text content parts are supported, got type {part.type!r}",
                param="messages",
            )
        texts.append(part.text)
    return "".join(texts)


def _tool_calls(index: int, message: ChatMessage) -> tuple[ToolCall, ...]:
    """An assistant message's calls, each checked: an id, a function's name, JSON arguments."""
    calls = message.tool_calls or []
    where = f"messages[{index}].tool_calls"
    if calls and message.role != "assistant":
        raise invalid_request(
            f"{where} is only for assistant messages, got role {message.role[:40]!r}",
            param="messages",
        )
    if len(calls) > MAX_TOOLS:
        raise invalid_request(f"{where} must hold <= {MAX_TOOLS} calls, got {len(calls)}",
                              param="messages")  # fmt: skip
    checked = []
    for number, call in enumerate(calls):
        if not 1 <= len(call.id) <= MAX_TOOL_CALL_ID_LENGTH:
            raise invalid_request(
                f"{where}[{number}].id must be 1 to {MAX_TOOL_CALL_ID_LENGTH} characters, "
                f"got {len(call.id)}",
                param="messages",
            )
        name = call.function.name
        if not FUNCTION_NAME.fullmatch(name):
            raise invalid_request(
                f"{where}[{number}].function.name must be {FUNCTION_NAME_RULE}, got {name[:80]!r}",
                param="messages",
            )
        try:
            json.loads(call.function.arguments)
        except (ValueError, RecursionError):
            raise invalid_request(
                f"{where}[{number}].function.arguments must be JSON text, got "
                f"{call.function.arguments[:80]!r}",
                param="messages",
            ) from None
        checked.append(ToolCall(call.id, name, call.function.arguments))
    return tuple(checked)


def chat_turns(messages: Sequence[ChatMessage]) -> list[Turn]:
    """Chat messages as turns: text parts joined, tool calls and tool results checked.

    Raises:
        ApiError: 400 naming ``messages`` for an empty list, a part that is not text, a
            ``tool_calls`` on a message that is not an assistant's (or past
            :data:`~twostroke.engine.server.structured.MAX_TOOLS` calls, an id that is empty
            or longer than :data:`MAX_TOOL_CALL_ID_LENGTH`, a name that is not a function's,
            arguments that are not JSON text), a ``tool`` message without ``tool_call_id``
            or a ``tool_call_id`` on another.
    """
    if not messages:
        raise invalid_request("messages must not be empty", param="messages")
    turns = []
    for index, message in enumerate(messages):
        call_id = message.tool_call_id
        if message.role == "tool" and not call_id:
            raise invalid_request(
                f"messages[{index}] of role 'tool' needs tool_call_id (the call it answers)",
                param="messages",
            )
        if call_id is not None and message.role != "tool":
            raise invalid_request(
                f"messages[{index}].tool_call_id is only for tool messages, got role "
                f"{message.role[:40]!r}",
                param="messages",
            )
        if call_id is not None and len(call_id) > MAX_TOOL_CALL_ID_LENGTH:
            raise invalid_request(
                f"messages[{index}].tool_call_id must be <= {MAX_TOOL_CALL_ID_LENGTH} "
                f"characters, got {len(call_id)}",
                param="messages",
            )
        turns.append(
            Turn(
                message.role,
                _text(index, message.content),
                _tool_calls(index, message),
                call_id,
                message.name,
            )
        )
    return turns


def chat_messages(
    messages: Sequence[ChatMessage],
    fmt: ToolFormat = GENERIC,
    tools: Sequence[ToolSpec] = (),
) -> list[dict[str, str]]:
    """Chat messages as the engine's chat template takes them: :func:`chat_turns` rendered
    in the tool format ``fmt`` with ``tools`` shown
    (:func:`~twostroke.engine.tools.prompt.render_prompt`); plain messages stay as they are.

    Raises:
        ApiError: 400 naming ``messages`` (see :func:`chat_turns`).
    """
    return render_prompt(fmt, chat_turns(messages), tools)


def max_tokens_field(request: CompletionRequest | ChatCompletionRequest) -> str:
    """The body's field that sets the most tokens to generate (OpenAI's error names it).

    A chat completion takes ``max_tokens`` or, newer, ``max_completion_tokens``.
    """
    if isinstance(request, ChatCompletionRequest) and request.max_tokens is None:
        return "max_completion_tokens"
    return "max_tokens"


def choice_params(
    request: CompletionRequest | ChatCompletionRequest, constraint: Constraint | None = None
) -> list[SamplingParams]:
    """One :class:`SamplingParams` per choice (``n`` of them), seeds derived from ``seed``.

    Choice 0 samples with ``seed`` itself; choice ``i`` with a seed derived from it, so that
    the same request gives the same ``n`` answers and the answers differ from each other.
    Without a ``max_tokens``, a completion gets ``SamplingParams``' default and a chat
    completion as many tokens as the context leaves (``max_tokens=None``; vLLM does the same):
    the engine knows the prompt's length once it has tokenized it, the server never does.
    Every choice carries ``constraint`` (from the body's structured-output fields:
    :func:`~twostroke.engine.server.structured.output_constraint`).

    Raises:
        ApiError: 400 naming the field for a value out of range or an unsupported parameter.
    """
    _reject_unsupported(request)
    if not 1 <= request.n <= MAX_N:
        raise invalid_request(f"n must be in [1, {MAX_N}], got {request.n}", param="n")
    chat = isinstance(request, ChatCompletionRequest)
    fields: dict[str, Any] = {}
    if isinstance(request, ChatCompletionRequest):
        logprobs = _chat_logprobs(request)
        most = request.max_tokens
        fields["max_tokens"] = most if most is not None else request.max_completion_tokens
    else:
        logprobs = request.logprobs
        if request.max_tokens is not None:
            fields["max_tokens"] = request.max_tokens
    renamed = {
        "logprobs": "top_logprobs" if chat else "logprobs",
        "max_tokens": max_tokens_field(request),
    }
    top_k = request.top_k
    if top_k is not None and top_k in (-1, 0):  # vLLM's and OpenAI-style "disabled"
        top_k = None
    fields |= {
        "min_tokens": request.min_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_k": top_k,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "min_p": request.min_p,
        "stop": () if request.stop is None else request.stop,
        "stop_token_ids": request.stop_token_ids or (),
        "ignore_eos": request.ignore_eos,
        "repetition_penalty": request.repetition_penalty,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logprobs": logprobs,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "priority": request.priority,
        "constraint": constraint,
    }
    seeds = _choice_seeds(request.seed, request.n)
    try:
        return [SamplingParams(seed=seed, **fields) for seed in seeds]
    except (TypeError, ValueError) as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        if field not in fields:
            raise invalid_request(message) from None
        param = renamed.get(field, field)
        raise invalid_request(param + message[len(field) :], param=param) from None


def _choice_seeds(seed: int | None, n: int) -> list[int | None]:
    if seed is None:
        return [None] * n
    if not 0 <= seed < _SEED_MODULUS:
        raise invalid_request(f"seed must be in [0, 2**63), got {seed}", param="seed")
    return [(seed + index * _SEED_STRIDE) % _SEED_MODULUS for index in range(n)]


def _chat_logprobs(request: ChatCompletionRequest) -> int | None:
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if not request.logprobs:
        return None
    top = request.top_logprobs or 0
    if not 0 <= top <= MAX_LOGPROBS:
        raise invalid_request(
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs"
        )
    return top


def _reject_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 for parameters that would change the answer but that the engine cannot honour."""
    if request.logit_bias:
        raise _unsupported("logit_bias")
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise _unsupported("echo")
        if request.suffix:
            raise _unsupported("suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise _unsupported("best_of", "other than n")


def _unsupported(param: str, detail: str = "") -> ApiError:
    suffix = f" {detail}" if detail else ""
    return invalid_request(f"{param}{suffix} is not supported by this server", param=param)


def check_model(requested: str | None, served: str) -> None:
    """Raise a 404 if the request names a model that this server does not serve."""
    if requested is not None and requested != served:
        raise ApiError(
            404,
            f"The model `{requested}` does not exist (this server serves `{served}`).",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )
