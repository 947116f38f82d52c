"""A response's choices read for reasoning: where each starts, and its text split as it comes.

The server reads a thinking model's output as vLLM's reasoning parsers do
(:mod:`~twostroke.engine.text.reasoning`): the reasoning apart (``reasoning_content``), the
answer alone as ``content``, tool calls read from the answer. Whether a choice's output starts
inside the reasoning depends on its prompt (Qwen3's template opens ``<think>`` with thinking on
in its thinking models, and closes an empty one with ``enable_thinking`` off), so each choice's
prompt tail is read once, when it is submitted, from the ids the engine tokenized it to.

A JSON output or a tool call the sampler must write (a constraint) would constrain the
reasoning too: the engine's constraints start at the first output token. So a request that
asks for one while a reasoning parser is on is refused (:func:`check_no_constraint`) rather
than answered with a constrained, thoughtless output; tools under ``"auto"`` stay free text
until the model writes a call's trigger, and are served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twostroke.engine.server.errors import invalid_request
from twostroke.engine.surface import EngineSurface
from twostroke.engine.text.chat_template import ChatTemplateKwargsError, check_template_kwargs
from twostroke.engine.text.reasoning import (
    ReasoningDelta,
    ReasoningFormat,
    ReasoningParser,
    ReasoningSplit,
    opens_reasoning,
    reasoning_format,
    split_reasoning,
    template_reasoning_format,
)
from twostroke.engine.tools.formats import ChatTemplated

__all__ = [
    "PROMPT_TAIL_TOKENS",
    "ChoiceReasoning",
    "check_no_constraint",
    "checked_template_kwargs",
    "server_reasoning_format",
]

#: The prompt's last tokens read for an open ``<think>``: the generation prompt's header and
#: the markers fit in far fewer.
PROMPT_TAIL_TOKENS = 32


def server_reasoning_format(name: str | None, tokenizer: object) -> ReasoningFormat | None:
    """The reasoning format a server reads its model's outputs with.

    Args:
        name: ``--reasoning-parser``: a parser's name, ``none`` (off), or ``None``: the
            generic ``think`` where ``tokenizer``'s chat template mentions ``<think>``.
        tokenizer: The engine's tokenizer (``None`` behind a coordinator's front).

    Raises:
        ValueError: ``name`` is no parser's (the message lists them).
    """
    if name == "none":
        return None
    if name is not None:
        return reasoning_format(name)
    template = tokenizer.chat_template if isinstance(tokenizer, ChatTemplated) else None
    return template_reasoning_format(template)


def checked_template_kwargs(
    kwargs: object, field: str = "chat_template_kwargs"
) -> dict[str, Any] | None:
    """A body's ``chat_template_kwargs``, checked
    (:func:`~twostroke.engine.text.chat_template.check_template_kwargs`).

    Raises:
        ApiError: 400 naming ``field`` and the rule it breaks.
    """
    try:
        return check_template_kwargs(kwargs, field)
    except ChatTemplateKwargsError as exc:
        raise invalid_request(str(exc), param=field) from None


def check_no_constraint(fmt: ReasoningFormat | None, param: str | None, *, lazy: bool) -> None:
    """Refuse a constrained output (``param`` set it) while a reasoning parser is on, unless
    the constraint is ``lazy``: tools under ``tool_choice`` ``"auto"`` without a JSON output,
    free text until the model writes the format's trigger (in its answer, as it is read).

    Raises:
        ApiError: 400 naming ``param``.
    """
    if fmt is None or param is None or lazy:
        return
    raise invalid_request(
        f"{param} cannot be combined with the {fmt.name!r} reasoning parser: a constrained "
        f"output must start after the model's {fmt.end}, and constraints start at the first "
        "output token; start the server with --reasoning-parser none to constrain a model "
        "that does not think",
        param=param,
        code="reasoning_constraint",
    )


class ChoiceReasoning:
    """The reasoning of a response's choices, by choice index.

    Args:
        fmt: The markers.
        engine: Where prompt tails are detokenized.
    """

    def __init__(self, fmt: ReasoningFormat, engine: EngineSurface) -> None:
        self.format = fmt
        self._engine = engine
        self._opened: dict[int, bool] = {}
        self._parsers: dict[int, ReasoningParser] = {}

    async def begin(self, index: int, prompt_token_ids: Sequence[int]) -> None:
        """Read choice ``index``'s prompt tail: whether its output starts inside the
        reasoning. A prompt not yet known (a remote replica's) leaves it to the output."""
        opened = self.format.always_open
        if not opened and prompt_token_ids:
            tail = await self._engine.detokenize(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]))
            opened = opens_reasoning(self.format, tail)
        self._opened[index] = opened

    def parser(self, index: int) -> ReasoningParser:
        """A fresh parser of choice ``index``'s output, from where its prompt left it."""
        return self.format.parser(self._opened.get(index, False))

    def split(self, index: int, text: str) -> ReasoningSplit:
        """Choice ``index``'s whole output, split."""
        return split_reasoning(self.format, text, opened=self._opened.get(index, False))

    def feed(self, index: int, text: str, *, finished: bool) -> ReasoningDelta:
        """What choice ``index``'s next piece of output adds to its reasoning and answer;
        with ``finished``, what was held back too."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self.format.parser(self._opened.get(index, False))
        delta = parser.feed(text)
        if not finished:
            return delta
        last = parser.finish()
        return ReasoningDelta(delta.reasoning + last.reasoning, delta.content + last.content)
