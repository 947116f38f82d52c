"""A chat request as the server's chat service takes it, whichever endpoint it came from.

``/v1/responses`` and ``/v1/messages`` each parse their own body into one
:class:`ChatRequest`: the conversation in the engine's chat form (:class:`Turn`\\ s whose tool
calls are checked), the sampling parameters, the tools and the tool choice, the output's
format, the stop strings, the token limit and whether to stream. The request carries its
endpoint's :class:`FieldNames`, so that an error found later (a sampling parameter out of
range, a tool's schema the backend refuses, a prompt too long for the context) is born
naming the endpoint's own field: Responses says ``max_output_tokens`` and ``text.format``,
Messages says ``stop_sequences`` and ``tools[0].input_schema``.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from twostroke.engine.tools.formats import ToolSpec
from twostroke.engine.tools.prompt import Turn

__all__ = ["ChatRequest", "FieldNames", "OutputFormat", "ToolChoice"]


@attrs.frozen
class FieldNames:
    """How one endpoint names the fields of a chat request, for its errors.

    Attributes:
        prompt: The field that holds the conversation (``input``, ``messages``).
        max_tokens: The field that set the most tokens to generate.
        stop: The field that holds the stop strings.
        format: The field that asks for a JSON output (``text.format``).
        schema: The field that holds that output's schema (``text.format.schema``).
        tool: A tool's field, ``{}`` its index (``tools[{}]``, ``tools[{}].function``).
        parameters: A tool's field that holds its arguments' schema (``input_schema``).
    """

    prompt: str
    max_tokens: str
    stop: str = "stop"
    format: str = "response_format"
    schema: str = "response_format.json_schema.schema"
    tool: str = "tools[{}].function"
    parameters: str = "parameters"

    def tool_field(self, index: int, field: str) -> str:
        """Tool ``index``'s ``field`` as the endpoint names it (``tools[0].name``)."""
        return f"{self.tool.format(index)}.{field}"

    def tool_parameters(self, index: int) -> str:
        """Tool ``index``'s schema field as the endpoint names it."""
        return self.tool_field(index, self.parameters)

    def sampling(self, field: str) -> str:
        """A :class:`~twostroke.states.params.SamplingParams` field as the endpoint names it
        (its refusals begin with the field's name)."""
        return {"max_tokens": self.max_tokens, "stop": self.stop}.get(field, field)


@attrs.frozen
class OutputFormat:
    """A JSON output: any object (``schema`` ``None``) or one that a schema allows.

    Attributes:
        schema: The JSON schema the output must validate against, if any.
    """

    schema: dict[str, Any] | None = None


@attrs.frozen
class ToolChoice:
    """Which tools the model may or must call.

    Attributes:
        mode: ``auto`` (text or calls), ``required`` (calls only), ``none`` (the tools are
            neither shown nor called), ``function`` (one call of the function named).
        function: The function ``function`` names.
    """

    mode: Literal["auto", "required", "none", "function"] = "auto"
    function: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.mode == "function") != (self.function is not None):
            raise ValueError(
                f"a tool choice names a function exactly when its mode is 'function', got "
                f"mode {self.mode!r} and function {self.function!r}"
            )

    def describe(self) -> str:
        """The choice as an error shows it."""
        return f"naming {self.function!r}" if self.mode == "function" else repr(self.mode)


@attrs.frozen
class ChatRequest:
    """One chat request, as an endpoint's parser prepared it.

    Attributes:
        names: How the endpoint names its fields.
        turns: The conversation, its tool calls checked.
        max_tokens: The most tokens to generate (``None``: what the context leaves).
        temperature: ``None``: the sampler's default.
        top_p: ``None``: the sampler's default.
        top_k: ``None``: no top-k cut.
        stop: Strings that end the output.
        include_stop: Keep the stop string that ended the output in its text (Messages
            names the one that matched, which the engine does not report).
        tools: The functions the model may call.
        tool_choice: How it may call them (``None``: ``auto`` with tools, no calls without).
        parallel_tool_calls: Whether one answer may hold several calls.
        output: A JSON output the answer's text must be, if one is asked for.
        stream: Whether the answer is streamed.
        cache_ttl: Seconds the conversation's KV stays pinned in the prefix cache once
            answered (``SamplingParams.cache_ttl``): a stored Response's, for the turn
            that continues it.
    """

    names: FieldNames
    turns: tuple[Turn, ...]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    output: OutputFormat | None = None
    stream: bool = False
    cache_ttl: float = 0.0
