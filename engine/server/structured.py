"""A request's structured-output fields as one constraint, and tool calls as OpenAI answers them.

A body may constrain its output through one of: ``response_format`` (OpenAI's
``json_object`` and ``json_schema``), ``structured_outputs`` (vLLM's extra field: ``json``,
``regex``, ``choice``, ``grammar`` or ``json_object``), or, on chat completions, ``tools``
with ``tool_choice`` ``"required"`` or a named function. :func:`output_constraint` turns
them into one :data:`~twostroke.states.constraints.Constraint` and remembers the field that
set it, so that a refusal (the constraint's own size checks here, the backend's
:class:`~twostroke.states.errors.ConstraintRejected` when the engine compiles it, however
late it arrives) is a 400 naming that field.

Tools are answered as OpenAI does, in the server's tool format
(:mod:`twostroke.engine.tools`): with ``tool_choice`` ``"auto"`` (the default when tools are
given) the output is free text under a lazy constraint that, once the model writes the
format's trigger, allows only calls of the tools; ``"required"`` allows calls only, a named
function one call of it; ``"none"`` neither shows the tools nor constrains anything. Calls
are answered as ``message.tool_calls`` with ``finish_reason`` ``"tool_calls"``
(:class:`ToolCalls`), also when the token limit cut a later call (which is dropped:
:meth:`ToolCalls.finish_reason`). ``response_format`` with tools constrains the text branch
of ``"auto"`` and is ignored with ``"required"`` or a named function (no text answer is
possible); ``structured_outputs`` with tools is refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs
import msgspec

from twostroke.engine.errors import ConstraintFailed
from twostroke.engine.server.chat_request import ChatRequest, FieldNames, OutputFormat, ToolChoice
from twostroke.engine.server.errors import ApiError, invalid_request
from twostroke.engine.server.protocol import (
    MAX_TOOLS,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
)
from twostroke.engine.structured.schemas import strict
from twostroke.engine.tools.formats import (
    FUNCTION_NAME,
    FUNCTION_NAME_RULE,
    GENERIC,
    ToolFormat,
    ToolSpec,
)
from twostroke.engine.tools.grammar import tool_constraint
from twostroke.engine.tools.parser import ParsedOutput, parse_output
from twostroke.states.constraints import (
    AnyJsonObject,
    Choice,
    Constraint,
    Grammar,
    JsonSchema,
    Regex,
)
from twostroke.states.errors import ConstraintRejected

__all__ = [
    "MAX_TOOLS",
    "OutputConstraint",
    "ToolCalls",
    "chat_constraint",
    "constraint_error",
    "constraint_failure",
    "format_constraint",
    "output_constraint",
    "strict_body",
    "strict_schema",
    "tool_specs",
    "tools_constraint",
]

#: How a chat completion body names its fields.
_CHAT_NAMES = FieldNames(prompt="messages", max_tokens="max_tokens")

#: The parameters of a function that declares none: an object of any content.
_NO_PARAMETERS: dict[str, Any] = {"type": "object"}
_CODE = "constraint_rejected"


@attrs.frozen
class ToolCalls:
    """How an output with tools becomes OpenAI's answer.

    Attributes:
        format: The format the model writes calls in.
    """

    format: ToolFormat

    def read(self, text: str) -> ParsedOutput:
        """The output as text and calls (:func:`~twostroke.engine.tools.parser.parse_output`)."""
        return parse_output(self.format, text)

    @staticmethod
    def finish_reason(parsed: ParsedOutput, reason: str) -> str:
        """The answer's ``finish_reason``: ``"tool_calls"`` where at least one call is
        complete, the engine's ``reason`` (``"length"``, ``"stop"``) where none is.

        Also where the token limit cut a later call (which is dropped): the complete calls
        are the answer an agent loop acts on, and ``"length"`` would lose them to the
        clients that treat it as a failed answer (the ``openai`` SDK's ``parse()`` and
        ``stream()`` helpers raise ``LengthFinishReasonError`` on it; openai-agents raises on
        the Responses API's ``"incomplete"``, which follows from this reason). That the limit
        was reached stays visible: ``usage.completion_tokens`` equals it.
        """
        return "tool_calls" if parsed.calls else reason

    @staticmethod
    def content(parsed: ParsedOutput) -> str | None:
        """The answer's ``content``: the text before the calls, ``None`` where there is none
        and a call was begun (complete or cut; a stream's opening delta says ``None`` too),
        never any of the format's text around calls."""
        if parsed.calls or not parsed.complete:
            return parsed.content or None
        return parsed.content


@attrs.frozen
class OutputConstraint:
    """What a body asks of its output's shape.

    Attributes:
        constraint: The constraint every choice carries, if any.
        param: The body's field that set it (errors name it).
        tool_calls: How the output is answered, when it may hold tool calls.
        tools: The tools the model is shown (none for ``tool_choice`` ``"none"``).
    """

    constraint: Constraint | None = None
    param: str | None = None
    tool_calls: ToolCalls | None = None
    tools: tuple[ToolSpec, ...] = ()


def constraint_error(param: str | None, exc: BaseException) -> ApiError:
    """The 400 for a constraint refused at ``param``: by its own checks or by the backend."""
    reason = exc.reason if isinstance(exc, ConstraintRejected) else str(exc)
    name = param or "constraint"
    return invalid_request(f"{name}: {reason}", param=name, code=_CODE)


def constraint_failure(param: str | None, exc: ConstraintFailed) -> ApiError:
    """The 400 for a constraint whose backend gave up partway through the output (a limit
    it breaks only there, named with its value, or a dead end)."""
    name = param or "constraint"
    return invalid_request(f"{name}: {exc.reason}", param=name, code="constraint_failed")


def _make(param: str, make: Any, *args: Any) -> Constraint:
    """``make(*args)``, its ``TypeError`` / ``ValueError`` a 400 naming ``param``."""
    try:
        constraint: Constraint = make(*args)
    except (TypeError, ValueError) as exc:
        raise constraint_error(param, exc) from None
    return constraint


def output_constraint(
    request: CompletionRequest | ChatCompletionRequest, tool_format: ToolFormat = GENERIC
) -> OutputConstraint:
    """The constraint a body asks for through any of its fields.

    ``response_format`` and ``structured_outputs`` exclude each other, and so do
    ``structured_outputs`` and tools; ``response_format`` with tools constrains the text
    branch of ``"auto"`` and is ignored otherwise (see the module docstring).

    Args:
        request: The body.
        tool_format: The format the model writes tool calls in.

    Raises:
        ApiError: 400 naming the field: more than one field constrains the output, a field
            is malformed or past its size limit, vLLM's older ``guided_*`` fields, or a tool
            choice that cannot be honoured (``"required"`` or a named function without
            tools, a name that is none of them).
    """
    for old in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(request, old) is not None:
            raise invalid_request(
                f"{old} is not supported by this server: use structured_outputs "
                f"(vLLM's current field)",
                param=old,
            )
    found: list[OutputConstraint] = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        found.append(_response_format(request))
    if request.structured_outputs is not None:
        found.append(_structured_outputs(request))
    if len(found) > 1:
        fields = [_top_field(str(each.param)) for each in found]
        raise invalid_request(
            f"the output may be constrained by one field only, got {' and '.join(fields)}",
            param=fields[1],
        )
    text = found[0] if found else None
    if isinstance(request, ChatCompletionRequest):
        tools = _tools(request, tool_format, text)
        if tools is not None:
            return tools
    return text or OutputConstraint()


def _response_format(request: CompletionRequest | ChatCompletionRequest) -> OutputConstraint:
    fmt = request.response_format
    assert fmt is not None
    if fmt.type == "json_object":
        return format_constraint(OutputFormat(), _CHAT_NAMES)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise invalid_request(
            "response_format of type json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    return format_constraint(OutputFormat(fmt.json_schema.schema), _CHAT_NAMES)


def _structured_outputs(request: CompletionRequest | ChatCompletionRequest) -> OutputConstraint:
    given = request.structured_outputs
    assert given is not None
    for option in ("whitespace_pattern", "structural_tag"):
        if getattr(given, option) is not None:
            raise invalid_request(
                f"structured_outputs.{option} is not supported by this server",
                param=f"structured_outputs.{option}",
            )
    makers: dict[str, Any] = {
        "json": JsonSchema,
        "regex": Regex,
        "choice": Choice,
        "grammar": Grammar,
        "json_object": lambda _: AnyJsonObject(),
    }
    chosen = [
        name
        for name in makers
        if getattr(given, name) not in (None, False)  # json_object: false asks for nothing
    ]
    if len(chosen) != 1:
        raise invalid_request(
            "structured_outputs must set exactly one of json, regex, choice, grammar and "
            f"json_object, got {len(chosen)}" + (f" ({', '.join(chosen)})" if chosen else ""),
            param="structured_outputs",
        )
    (name,) = chosen
    param = f"structured_outputs.{name}"
    return OutputConstraint(_make(param, makers[name], getattr(given, name)), param)


def _tools(
    request: ChatCompletionRequest, tool_format: ToolFormat, text: OutputConstraint | None
) -> OutputConstraint | None:
    given = request.tools or []
    specs = tool_specs(
        [(tool.function.name, tool.function.description, tool.function.parameters)
         for tool in given], _CHAT_NAMES,
    )  # fmt: skip
    choice = request.tool_choice
    typed = None
    if isinstance(choice, NamedToolChoice):
        typed = ToolChoice("function", choice.function.name)
    elif choice is not None:
        typed = ToolChoice(choice)
    parallel = request.parallel_tool_calls is not False
    return tools_constraint(specs, typed, parallel, text, tool_format, _CHAT_NAMES)


def tool_specs(
    given: Sequence[tuple[str, str | None, dict[str, Any] | None]], names: FieldNames
) -> tuple[ToolSpec, ...]:
    """The tools a body offers, each ``(name, description, parameters)``, as specs, their
    names checked first so that a refusal names the endpoint's own field.

    Raises:
        ApiError: 400 naming ``tools`` past :data:`MAX_TOOLS`, or a tool's name field for a
            name that is not a function's or not unique.
    """
    if len(given) > MAX_TOOLS:
        raise invalid_request(f"tools must hold <= {MAX_TOOLS}, got {len(given)}", param="tools")
    seen: list[str] = []
    for index, (name, _, _) in enumerate(given):
        field = names.tool_field(index, "name")
        if not FUNCTION_NAME.fullmatch(name):
            raise invalid_request(
                f"{field} must be {FUNCTION_NAME_RULE}, got {name[:80]!r}",
                param=field,
            )
        if name in seen:
            raise invalid_request(f"{field} {name!r} is not unique", param=field)
        seen.append(name)
    return tuple(ToolSpec(name, description, parameters)
                 for name, description, parameters in given)  # fmt: skip


def tools_constraint(
    specs: Sequence[ToolSpec],
    choice: ToolChoice | None,
    parallel: bool,
    text: OutputConstraint | None,
    tool_format: ToolFormat,
    names: FieldNames,
) -> OutputConstraint | None:
    """The constraint and the answer's reading for ``specs`` called as ``choice`` asks (see
    the module docstring), or ``None`` where no call is possible.

    Args:
        specs: The tools (:func:`tool_specs`).
        choice: How they may be called (``None``: ``auto``).
        parallel: Whether one answer may hold several calls.
        text: The constraint of the answer's text, if any (a JSON output's).
        tool_format: The format the model writes tool calls in.
        names: How the body names its fields, for errors.

    Raises:
        ApiError: 400 for a choice that cannot be honoured (``required`` or a function
            without tools, a function that is none of them), a schema the backend refuses
            (naming the tool's own field), or a grammar past its limits.
    """
    mode = "auto" if choice is None else choice.mode
    if not specs:
        if choice is not None and mode in ("required", "function"):
            raise invalid_request(f"tool_choice {choice.describe()} needs tools", param="tools")
        return None  # "auto" or "none" without tools: nothing to call
    if mode == "none":
        return None  # the tools are neither shown nor called (OpenAI's "none")
    if text is not None and text.param is not None and text.param.startswith("structured_"):
        raise invalid_request(
            "the output may be constrained by one field only, got structured_outputs and "
            "tools: use response_format with tools",
            param="tools",
        )
    for index, spec in enumerate(specs):
        if spec.parameters is not None:  # checked here, so that a refusal names the tool
            _make(names.tool_parameters(index), JsonSchema, spec.parameters)
    param, function = "tools", None
    if choice is not None and choice.function is not None:
        function = choice.function
        known = [spec.name for spec in specs]
        if function not in known:
            raise invalid_request(
                f"tool_choice names function {function!r}, which is not one of tools "
                f"({', '.join(known)})",
                param="tool_choice",
            )
        param = names.tool_parameters(known.index(function))
        parallel = False  # one call of the function named
    answer = None
    if mode == "auto" and text is not None:
        assert isinstance(text.constraint, JsonSchema | AnyJsonObject)  # a JSON output's
        answer = text.constraint
    try:
        grammar = tool_constraint(
            tool_format,
            specs,
            "required" if mode == "required" else "auto",
            function=function,
            parallel=parallel,
            text=answer,
        )
    except (TypeError, ValueError) as exc:  # past the grammar's limits (size, rules)
        raise constraint_error("tools", exc) from None
    return OutputConstraint(grammar, param, ToolCalls(tool_format), tuple(specs))


def format_constraint(output: OutputFormat, names: FieldNames) -> OutputConstraint:
    """The constraint of a JSON output: any object, or one its schema allows.

    Raises:
        ApiError: 400 naming the schema's field when the backend refuses the schema.
    """
    if output.schema is None:
        return OutputConstraint(AnyJsonObject(), names.format)
    return OutputConstraint(_make(names.schema, JsonSchema, output.schema), names.schema)


def chat_constraint(request: ChatRequest, tool_format: ToolFormat) -> OutputConstraint:
    """What a prepared chat request asks of its output's shape: a JSON output, tools, both
    (the JSON output is then the text branch of ``auto``), or nothing.

    Raises:
        ApiError: 400 naming the request's own field (see :func:`tools_constraint`).
    """
    names = request.names
    text = None if request.output is None else format_constraint(request.output, names)
    tools = tools_constraint(request.tools, request.tool_choice, request.parallel_tool_calls,
                             text, tool_format, names)  # fmt: skip
    return tools or text or OutputConstraint()


def _top_field(param: str) -> str:
    """The body's own field of a nested one: ``tools`` for ``tools[0].function.parameters``."""
    return re.split(r"[.\[]", param, maxsplit=1)[0]


_Body = TypeVar("_Body", CompletionRequest, ChatCompletionRequest)


def strict_body(body: _Body) -> _Body:
    """``body`` with its ``response_format`` schema and its tools' ``parameters`` strict
    (:func:`~twostroke.engine.structured.schemas.strict`: an object subschema with
    ``properties`` and no ``additionalProperties`` closed), the server's default
    (``ServerConfig.strict_schemas``); ``structured_outputs.json`` is vLLM's field, taken as
    sent. Every output the strict schema allows validates against the schema as sent."""
    fmt = body.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema is not None:
        schema = msgspec.structs.replace(
            fmt.json_schema, schema=strict_schema(fmt.json_schema.schema)
        )
        body = msgspec.structs.replace(
            body, response_format=msgspec.structs.replace(fmt, json_schema=schema)
        )
    if isinstance(body, ChatCompletionRequest) and body.tools:
        tools = [
            tool
            if tool.function.parameters is None
            else msgspec.structs.replace(
                tool,
                function=msgspec.structs.replace(
                    tool.function, parameters=strict_schema(tool.function.parameters)
                ),
            )
            for tool in body.tools
        ]
        body = msgspec.structs.replace(body, tools=tools)
    return body


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` made strict (see :func:`strict_body`); one nested past any limit as sent,
    for :class:`JsonSchema` to refuse naming the rule."""
    try:
        return strict(schema)
    except RecursionError:  # nested past any limit: JsonSchema refuses it, naming the rule
        return schema
