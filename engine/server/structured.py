"""A request's structured-output fields as one constraint, and tool calls as OpenAI answers them.

A body may constrain its output through one of: ``response_format`` (OpenAI's
``json_object`` and ``json_schema``), ``structured_outputs`` (vLLM's extra field: ``json``,
``regex``, ``choice``, ``grammar`` or ``json_object``), or, on chat completions, ``tools``
with ``tool_choice`` ``"required"`` or a named function. :func:`output_constraint` turns
them into one :data:`~twostroke.states.constraints.Constraint` and remembers the field that
set it, so that a refusal (the constraint's own size checks here, the backend's
:class:`~twostroke.states.errors.ConstraintRejected` when the engine compiles it, however
late it arrives) is a 400 naming that field.

A tool call is answered as OpenAI does: the output is constrained to the function's
arguments (a named function) or to ``{"name", "arguments"}`` of one of the tools
(``"required"``), and the answer carries it as ``message.tool_calls`` with
``finish_reason`` ``"tool_calls"``. ``tool_choice="auto"`` would need the model to choose
between text and a call in its own format (a parser per model family): it is refused.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import attrs

from twostroke.engine.errors import ConstraintFailed
from twostroke.engine.server.errors import ApiError, invalid_request
from twostroke.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    Tool,
)
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
    "constraint_error",
    "constraint_failure",
    "output_constraint",
]

#: The most tools one chat request may offer (OpenAI's own limit is 128).
MAX_TOOLS = 128
#: A function's name, as OpenAI allows it.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The parameters of a function that declares none: an object of any content.
_NO_PARAMETERS: dict[str, Any] = {"type": "object"}
_CODE = "constraint_rejected"


@attrs.frozen
class ToolCalls:
    """How a constrained output becomes OpenAI's ``tool_calls``.

    Attributes:
        name: The function's name when ``tool_choice`` named it (the output is its
            arguments); ``None`` for ``"required"`` (the output is ``{"name", "arguments"}``).
    """

    name: str | None

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The output as a list of one tool call, or ``None`` if it is not complete JSON.

        An output cut short by ``max_tokens`` is not: the answer then carries it as text.
        """
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is None:
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return None
            name = value["name"]
            arguments = json.dumps(value.get("arguments", {}), ensure_ascii=False)
        else:
            name, arguments = self.name, text  # the arguments as the model wrote them
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        ]


@attrs.frozen
class OutputConstraint:
    """What a body asks of its output's shape.

    Attributes:
        constraint: The constraint every choice carries, if any.
        param: The body's field that set it (errors name it).
        tool_calls: How the output is answered, when it is a tool call.
    """

    constraint: Constraint | None = None
    param: str | None = None
    tool_calls: ToolCalls | None = None


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


def output_constraint(request: CompletionRequest | ChatCompletionRequest) -> OutputConstraint:
    """The constraint a body asks for through any of its fields (at most one of them).

    Raises:
        ApiError: 400 naming the field: more than one field constrains the output, a field
            is malformed or past its size limit, vLLM's older ``guided_*`` fields, or a tool
            choice this server cannot honour (``tool_choice`` ``"auto"``, or ``tools``
            without a ``tool_choice``).
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
    if isinstance(request, ChatCompletionRequest):
        tools = _tools(request)
        if tools is not None:
            found.append(tools)
    if len(found) > 1:
        fields = [_top_field(str(each.param)) for each in found]
        raise invalid_request(
            f"the output may be constrained by one field only, got {' and '.join(fields)}",
            param=fields[1],
        )
    return found[0] if found else OutputConstraint()


def _response_format(request: CompletionRequest | ChatCompletionRequest) -> OutputConstraint:
    fmt = request.response_format
    assert fmt is not None
    if fmt.type == "json_object":
        return OutputConstraint(AnyJsonObject(), "response_format")
    param = "response_format.json_schema"
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise invalid_request(
            "response_format of type json_schema needs json_schema.schema", param=param
        )
    param += ".schema"
    return OutputConstraint(_make(param, JsonSchema, fmt.json_schema.schema), param)


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


def _tools(request: ChatCompletionRequest) -> OutputConstraint | None:
    tools, choice = request.tools or [], request.tool_choice
    if choice == "none" or (choice is None and not tools):
        return None  # tools, if any, are not called (OpenAI's "none")
    if choice is None or choice == "auto":
        raise invalid_request(
            "tool_choice 'auto' (the default with tools) is not supported by this server: "
            "pass 'required', a named function ({'type': 'function', 'function': {'name': "
            "...}}) or 'none'",
            param="tool_choice",
        )
    if not tools:
        raise invalid_request(f"tool_choice {_describe(choice)} needs tools", param="tools")
    if len(tools) > MAX_TOOLS:
        raise invalid_request(f"tools must hold <= {MAX_TOOLS}, got {len(tools)}", param="tools")
    names = _check_names(tools)
    if request.stream:
        raise invalid_request(
            "stream is not supported with tool_choice 'required' or a named function: "
            "ask without stream",
            param="stream",
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise invalid_request(
                f"tool_choice names function {name!r}, which is not one of tools "
                f"({', '.join(names)})",
                param="tool_choice",
            )
        index = names.index(name)
        param = f"tools[{index}].function.parameters"
        schema = tools[index].function.parameters or _NO_PARAMETERS
        return OutputConstraint(_make(param, JsonSchema, schema), param, ToolCalls(name))
    # "required": one call of any of the tools, as {"name": ..., "arguments": ...}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": tool.function.parameters or _NO_PARAMETERS,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return OutputConstraint(_make("tools", JsonSchema, schema), "tools", ToolCalls(None))


def _check_names(tools: list[Tool]) -> list[str]:
    names = []
    for index, tool in enumerate(tools):
        name = tool.function.name
        if not _FUNCTION_NAME.fullmatch(name):
            raise invalid_request(
                f"tools[{index}].function.name must be 1 to 64 letters, digits, underscores "
                f"or dashes, got {name[:80]!r}",
                param=f"tools[{index}].function.name",
            )
        if name in names:
            raise invalid_request(
                f"tools[{index}].function.name {name!r} is not unique",
                param=f"tools[{index}].function.name",
            )
        names.append(name)
    return names


def _top_field(param: str) -> str:
    """The body's own field of a nested one: ``tools`` for ``tools[0].function.parameters``."""
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def _describe(choice: object) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"naming {choice.function.name!r}"
    return repr(choice)
