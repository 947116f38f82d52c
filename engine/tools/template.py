"""A conversation with tools through the chat template's own ``tools`` variable.

Templates of models trained to call tools (Qwen2.5's and Hermes', Llama 3.1's, Mistral's)
show the tools and the history themselves: the tools through the ``tools`` variable (Qwen2.5
in its system turn, Llama 3.1 in the first user turn, Mistral before the last user turn), an
assistant's calls from its message's ``tool_calls``, each result from a ``tool`` message with
its ``tool_call_id`` (and ``name``). That is the prompt the model was trained on, so where
the format is such a template's (:attr:`~twostroke.engine.tools.formats.ToolFormat.native`)
and the engine's tokenizer can render it (:class:`ToolTemplate`, which
:class:`~twostroke.engine.text.tokenizer.HFTokenizer` is), :func:`tool_prompt` renders the
conversation that way, to token ids. Otherwise (the generic format, a template that never
reads ``tools``, or a coordinator's front, which holds no tokenizer) it writes them into
plain messages (:func:`~twostroke.engine.tools.prompt.render_prompt`).

The messages are OpenAI's (and ``transformers``'): a call's ``function.arguments`` is the
arguments' JSON value, not its text, since the templates write it with ``tojson``; a call
id is the one the client sent, or for a format whose templates take only ids of a fixed
shape (Mistral's: 9 letters and digits) a stable id made from it
(:meth:`~twostroke.engine.tools.formats.ToolFormat.template_call_id`), on the call and on
the result that names it alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from twostroke.engine.tools.formats import ChatTemplated, ToolFormat, ToolSpec
from twostroke.engine.tools.prompt import Turn, render_prompt

__all__ = ["ToolTemplate", "native_template", "template_messages", "tool_prompt"]

_TOOLS_VARIABLE = re.compile(r"\btools\b")


@runtime_checkable
class ToolTemplate(ChatTemplated, Protocol):
    """A tokenizer that renders a conversation with tools through its chat template."""

    def apply_tool_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` and ``tools`` rendered by the chat template (with
        ``template_kwargs`` as more variables), ending with the generation prompt."""
        ...


def native_template(fmt: ToolFormat, tokenizer: object | None) -> ToolTemplate | None:
    """``tokenizer``, where its template renders tools for ``fmt``; else ``None``.

    It does where ``fmt`` is a template's own format, ``tokenizer`` can render tools, and
    its template reads a ``tools`` variable.

    Args:
        fmt: The format the model writes tool calls in.
        tokenizer: An engine's tokenizer (``EngineSurface.tokenizer``), or ``None`` where
            there is none (a coordinator's front holds none).
    """
    if not fmt.native or not isinstance(tokenizer, ToolTemplate):
        return None
    template = tokenizer.chat_template
    if not isinstance(template, str) or not _TOOLS_VARIABLE.search(template):
        return None
    return tokenizer


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text  # shown as the string it is (the server refuses it before)


def template_messages(fmt: ToolFormat, turns: Sequence[Turn]) -> list[dict[str, Any]]:
    """``turns`` as the messages a tool-aware template reads (see the module docstring).

    A tool message without ``name`` gets the name of the call it answers, where an earlier
    assistant message holds that call.
    """
    names: dict[str, str] = {}
    messages: list[dict[str, Any]] = []
    for turn in turns:
        message: dict[str, Any] = {"role": turn.role, "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = [
                {
                    "id": fmt.template_call_id(call.id),
                    "type": "function",
                    "function": {"name": call.name, "arguments": _arguments(call.arguments)},
                }
                for call in turn.tool_calls
            ]
            names.update((call.id, call.name) for call in turn.tool_calls)
        if turn.tool_call_id is not None:
            message["tool_call_id"] = fmt.template_call_id(turn.tool_call_id)
            name = turn.name if turn.name is not None else names.get(turn.tool_call_id)
            if name is not None:
                message["name"] = name
        messages.append(message)
    return messages


def tool_prompt(
    fmt: ToolFormat,
    turns: Sequence[Turn],
    tools: Sequence[ToolSpec] = (),
    template: ToolTemplate | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int] | list[dict[str, str]]:
    """The prompt of a conversation with tools: token ids rendered by ``template``
    (:func:`native_template`), or without one plain messages
    (:func:`~twostroke.engine.tools.prompt.render_prompt`).

    Args:
        fmt: The format the model reads and writes calls in.
        turns: The conversation, oldest first.
        tools: The tools to show (none: the template's ``tools`` is ``None``).
        template: The tokenizer that renders the template's ``tools``, if there is one.
        template_kwargs: More variables for ``template`` (``chat_template_kwargs``); the
            caller renders plain messages with them itself.

    Raises:
        ChatTemplateError: the template refused the conversation (its message says why).
    """
    if template is None:
        return render_prompt(fmt, turns, tools)
    shown = [tool.shown() for tool in tools] if tools else None
    messages = template_messages(fmt, turns)
    if template_kwargs is None:  # a tokenizer that takes no variables renders as it did
        return template.apply_tool_template(messages, shown)
    return template.apply_tool_template(messages, shown, template_kwargs=template_kwargs)
