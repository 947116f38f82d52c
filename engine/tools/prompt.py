"""A conversation with tools as the plain messages a chat template takes.

The engine renders chat messages of ``{"role", "content"}`` through the model's template. A
conversation with tools holds more: the tools offered, the calls an assistant made, the
results tools gave. A template that knows tools renders them itself
(:mod:`twostroke.engine.tools.template`); for any other, :func:`render_prompt` writes them in
the format's own syntax, inside those plain messages, so that any template renders them and
the model reads its own calls back in the syntax it is asked to write:

* the tools, as a system block listing each as JSON between ``<tools>`` tags, with the call
  syntax (Hermes' and Qwen2.5's wording). It opens the first system message, or is one;
* an assistant's calls, right after its text, each as the model writes one
  (:meth:`~twostroke.engine.tools.formats.ToolFormat.call_text`);
* a tool's result, as a message of the format's ``result_role`` (``tool``; ``user`` for a
  format whose templates take no other role, where consecutive results share one message so
  roles still alternate), wrapped in ``<tool_response>`` tags unless the template wraps it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs

from twostroke.engine.tools.formats import ToolCall, ToolFormat, ToolSpec

__all__ = ["Turn", "render_prompt", "tools_block"]


@attrs.frozen
class Turn:
    """One message of a conversation that may hold tool calls and results.

    Attributes:
        role: ``system``, ``user``, ``assistant``, ``tool`` (or another role the template
            takes).
        content: Its text (an assistant that only called tools has ``""``).
        tool_calls: An assistant's calls.
        tool_call_id: The call a tool message answers.
        name: The tool's name, on a tool message.
    """

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


def tools_block(fmt: ToolFormat, tools: Sequence[ToolSpec]) -> str:
    """The system block that shows ``tools`` and how to call them."""
    listed = "\n".join(json.dumps(tool.shown(), ensure_ascii=False) for tool in tools)
    example = (
        fmt.call_text("<function-name>", "<args-json-object>")
        .replace('"<function-name>"', "<function-name>")
        .replace('"<args-json-object>"', "<args-json-object>")
    )
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        f"as follows:\n{example}"
    )


def _arguments(call: ToolCall) -> object:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments  # shown as the string it is (the server refuses it before)


def render_prompt(
    fmt: ToolFormat, turns: Sequence[Turn], tools: Sequence[ToolSpec] = ()
) -> list[dict[str, str]]:
    """``turns`` and ``tools`` as ``{"role", "content"}`` messages (see the module docstring).

    Args:
        fmt: The format the model reads and writes calls in.
        turns: The conversation, oldest first.
        tools: The tools to show (none: no tools block, as for ``tool_choice`` ``"none"``).

    Returns:
        The messages, ready for :meth:`~twostroke.engine.engine.Engine.submit`.
    """
    messages: list[dict[str, str]] = []
    for turn in turns:
        if turn.role == "tool":
            result = turn.content
            if fmt.wrap_results:
                result = f"<tool_response>\n{result}\n</tool_response>"
            last = messages[-1] if messages else None
            if fmt.result_role == "user" and last is not None and last.get("_results") == "1":
                last["content"] += "\n" + result  # one user turn for consecutive results
            else:
                messages.append({"role": fmt.result_role, "content": result, "_results": "1"})
            continue
        content = turn.content
        if turn.tool_calls:
            calls = [(call.name, _arguments(call)) for call in turn.tool_calls]
            content += fmt.calls_text(calls)  # as the model wrote them: its text, then calls
        messages.append({"role": turn.role, "content": content})
    rendered = [{"role": m["role"], "content": m["content"]} for m in messages]
    if tools:
        block = tools_block(fmt, tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{block}"
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered
