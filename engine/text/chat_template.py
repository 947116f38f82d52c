"""Chat templates rendered as ``transformers`` renders them, within bounds.

A chat template is a program that comes with the model: a GGUF file's
``tokenizer.chat_template`` runs on every chat request. Jinja's sandbox keeps it from
touching the process, but not from running for ever: two nested ``range(100000)`` loops are
10^10 iterations, and ``"x" * 10**10`` or a string doubled in a loop fill the memory. Every
render here is therefore bounded by :class:`TemplateLimits`, counted as it runs:

* **loop iterations**: every ``{% for %}`` iterates through a counting wrapper (the parse
  tree is rewritten once, when the template compiles), and every call (a macro, a
  recursive ``loop(...)``, a method) counts one;
* **output characters**: the rendered text as it streams out, every ``~`` concatenation,
  and every ``*``, ``+``, ``**`` and ``%`` (intercepted at run time, so never folded at
  compile time) and padding method or filter, checked *before* the result is built;
* **seconds**: the rendering thread's CPU time (``time.thread_time``: a machine loaded by
  other work does not trip it), checked cooperatively in the counting hooks.

A render that crosses one raises :class:`TemplateBoundExceeded`, which names the bound and
its value; the tokenizer turns it into a ``ChatTemplateError`` (a 400 from the server), and
a template that crosses one on a short conversation refuses the model at load
(:meth:`~twostroke.engine.text.tokenizer.HFTokenizer.from_pretrained`).

The environment is the one ``transformers`` builds for chat templates: a sandbox with
``trim_blocks`` and ``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now``, the ``{% generation %}`` tag and a ``tojson`` that keeps non-ASCII text.
"""

from __future__ import annotations

import functools
import json
import operator
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import TYPE_CHECKING, Any

import attrs

from twostroke.engine.errors import EngineError

if TYPE_CHECKING:
    import jinja2

__all__ = [
    "DEFAULT_TEMPLATE_LIMITS",
    "MAX_TEMPLATE_KWARGS",
    "MAX_TEMPLATE_KWARGS_CHARS",
    "ChatTemplateKwargsError",
    "TemplateBoundExceeded",
    "TemplateLimits",
    "check_template_kwargs",
    "compile_chat_template",
    "render",
    "render_chat",
]

#: Checking the clock is a system call: once every this many counted steps.
_CLOCK_EVERY = 256
_NUMBER = re.compile(r"\d+")
_LOOP_FILTER = "twostroke_counted_loop"
#: ``str`` methods whose integer arguments are the length of what they build.
_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


def _positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{attribute.name} must be a number > 0, got {value!r}")


@attrs.frozen
class TemplateLimits:
    """How far one rendering of a chat template may go.

    The defaults are far above what a real template needs (SmolLM2's renders a message in
    a few iterations and microseconds; a conversation is at most ``max_model_len`` messages)
    and low enough that a hostile template costs a worker thread about a second.

    Attributes:
        max_loop_iterations: Loop iterations and calls, summed over the whole rendering.
        max_output_chars: Characters of the rendered text, and of any one string or list
            the template builds.
        max_seconds: CPU seconds of the rendering thread.
    """

    max_loop_iterations: int = attrs.field(default=1_000_000, validator=_positive)
    max_output_chars: int = attrs.field(default=4 * 1024 * 1024, validator=_positive)
    max_seconds: float = attrs.field(default=2.0, validator=_positive)


#: The bounds every tokenizer renders its chat template within unless told otherwise.
DEFAULT_TEMPLATE_LIMITS = TemplateLimits()


class TemplateBoundExceeded(Exception):
    """A rendering crossed one of its :class:`TemplateLimits`; the message names it."""


class _Budget:
    """What one rendering has spent: the counting hooks charge it (one per thread)."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.iterations = 0
        self.started = time.thread_time()

    def step(self) -> None:
        self.iterations += 1
        limit = self.limits.max_loop_iterations
        if self.iterations > limit:
            raise TemplateBoundExceeded(
                f"a chat template may run at most max_loop_iterations = {limit} loop "
                f"iterations and calls, got {self.iterations}"
            )
        if self.iterations % _CLOCK_EVERY == 0:
            self.check_time()

    def check_time(self) -> None:
        spent = time.thread_time() - self.started
        if spent > self.limits.max_seconds:
            raise TemplateBoundExceeded(
                f"a chat template may run at most max_seconds = {self.limits.max_seconds} "
                f"CPU seconds, got {spent:.2f}"
            )

    def check_size(self, size: int, what: str) -> None:
        limit = self.limits.max_output_chars
        if size > limit:
            raise TemplateBoundExceeded(
                f"a chat template may build at most max_output_chars = {limit} characters "
                f"({what}), got {size}"
            )


_BUDGET: ContextVar[_Budget | None] = ContextVar("twostroke_template_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # a compiled template used outside render()
        raise TemplateBoundExceeded("a chat template must be rendered through render()")
    return budget


def _size(value: object) -> int | None:
    return len(value) if isinstance(value, str | list | tuple) else None


def _checked_binop(symbol: str, left: Any, right: Any) -> Any:
    """``left <symbol> right``, refused before a result past the bound is built."""
    budget = _budget()
    if symbol == "*":
        for sequence, count in ((left, right), (right, left)):
            length = _size(sequence)
            if length is not None and isinstance(count, int):
                budget.check_size(length * max(count, 0), f"a sequence times {count}")
    elif symbol == "+":
        left_size, right_size = _size(left), _size(right)
        if left_size is not None and right_size is not None:
            budget.check_size(left_size + right_size, "a sum of sequences")
    elif symbol == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            # The result's digits: what it costs to build and to print.
            budget.check_size(right * left.bit_length() // 3, f"{left} ** {right}")
    elif symbol == "%" and isinstance(left, str):
        _widths_checked("% formatting", left, right)
    return _BINOPS[symbol](left, right)


_BINOPS: dict[str, Callable[[Any, Any], Any]] = {
    "*": operator.mul,
    "+": operator.add,
    "**": operator.pow,
    "%": operator.mod,
}


def _counted_loop(iterable: Iterable[Any]) -> Iterator[Any]:
    """What every ``{% for %}`` iterates: ``iterable``, one step charged per item."""
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


def _checked_parts(parts: tuple[Any, ...]) -> tuple[Any, ...]:
    """A ``~`` concatenation's parts, refused if their text would be past the bound."""
    _budget().check_size(sum(len(str(part)) for part in parts), "a concatenation")
    return parts


def _numbers_checked(name: str, args: Iterable[Any]) -> None:
    budget = _budget()
    for arg in args:
        if isinstance(arg, int):
            budget.check_size(arg, f"the width given to {name}")


def _widths_checked(name: str, form: str, values: object) -> None:
    """The widths and precisions a format string asks for (its numbers; with a ``*``, the
    values' ints too), refused past the bound before the text is built."""
    numbers: list[object] = [int(match) for match in _NUMBER.findall(form)]
    if "*" in form:
        numbers += values if isinstance(values, tuple) else [values]
    _numbers_checked(name, numbers)


@functools.cache
def _environment() -> jinja2.Environment:
    """The bounded environment (built once: compiling a template needs jinja2's imports)."""
    import jinja2
    import jinja2.ext
    import jinja2.filters
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator, Frame
    from jinja2.runtime import Context
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
            # The parts go through a size check before they are joined (no constant folding:
            # a template's constants are small, and a folded join would be its own).
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            self.write(f"{join}(environment.twostroke_checked_parts((")
            for part in node.nodes:
                self.visit(part, frame)
                self.write(", ")
            self.write(")))")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset(_BINOPS)

        def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
            return _checked_binop(operator, left, right)

        def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _budget().step()
            if getattr(__obj, "__self__", None).__class__ is str:
                name = getattr(__obj, "__name__", "")
                if name in _PADDING_METHODS:
                    _numbers_checked(f"str.{name}", args)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            # str.format and format_map: the sandbox wraps them when the template reads them.
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            form = value.__self__

            def checked(*args: Any, **kwargs: Any) -> str:
                _widths_checked("str.format", form, ())
                return wrapped(*args, **kwargs)

            return checked

        def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Filter(
                    loop.iter, _LOOP_FILTER, [], [], None, None, lineno=loop.lineno
                )
            return tree

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which no model saw in training.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    def padding_filter(name: str, filter_: Callable[..., str]) -> Callable[..., str]:
        def checked(value: Any, *args: Any, **kwargs: Any) -> str:
            if name == "format":  # value % args: the widths are in the value
                _widths_checked("the format filter", str(value), tuple(args))
            else:
                _numbers_checked(f"the {name} filter", [*args, *kwargs.values()])
            return filter_(value, *args, **kwargs)

        return checked

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body: transformers marks
        the assistant's tokens with it, which only training asks for."""

        tags = {"generation"}  # noqa: RUF012 (Jinja reads a set)

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    environment = BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.twostroke_checked_parts = _checked_parts  # type: ignore[attr-defined]
    environment.filters[_LOOP_FILTER] = _counted_loop
    environment.filters["tojson"] = tojson
    for name in ("center", "indent", "format"):
        environment.filters[name] = padding_filter(name, environment.filters[name])
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment


@functools.lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled in the bounded environment (cached: a model has one template).

    Raises:
        jinja2.TemplateSyntaxError: the template does not compile.
    """
    return _environment().from_string(source)


def render(template: jinja2.Template, limits: TemplateLimits, variables: Mapping[str, Any]) -> str:
    """``template`` rendered with ``variables``, within ``limits``.

    Run it in a worker thread for a request (the engine does): it holds its thread for as
    long as the limits allow.

    Raises:
        TemplateBoundExceeded: the rendering crossed a limit (the message names it).
        jinja2.TemplateError: the template refused the variables (``raise_exception``).
    """
    budget = _Budget(limits)
    token = _BUDGET.set(budget)
    try:
        pieces: list[str] = []
        size = 0
        for piece in template.generate(**variables):
            size += len(piece)
            budget.check_size(size, "the rendered text")
            pieces.append(piece)
            if len(pieces) % _CLOCK_EVERY == 0:
                budget.check_time()
        return "".join(pieces)
    except OverflowError as exc:  # the sandbox's range() past MAX_RANGE, or a float's
        raise TemplateBoundExceeded(f"a chat template overflowed: {exc}") from exc
    except RecursionError as exc:  # a macro or a recursive loop calling itself for ever
        raise TemplateBoundExceeded(
            f"a chat template may nest calls at most as deep as Python's recursion limit "
            f"({sys.getrecursionlimit()})"
        ) from exc
    finally:
        _BUDGET.reset(token)


#: The most variables a request may give the chat template (``chat_template_kwargs``).
MAX_TEMPLATE_KWARGS = 32
#: The most characters of JSON those variables may take, all together.
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024
#: The most levels a variable's value may nest (a list in a dict is two).
_MAX_TEMPLATE_KWARGS_DEPTH = 8
#: Variables the engine sets itself: a request's own must not replace them (the
#: conversation, its tools, the generation prompt, the environment's functions).
_RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
     "raise_exception", "strftime_now", "additional_special_tokens"}
)  # fmt: skip


class ChatTemplateKwargsError(EngineError, ValueError):
    """A request's chat template variables break a rule; the message names it and the value."""


def check_template_kwargs(
    kwargs: object, field: str = "chat_template_kwargs"
) -> dict[str, Any] | None:
    """A request's extra chat template variables (vLLM's ``chat_template_kwargs``, Qwen3's
    ``enable_thinking`` say), checked once before any rendering.

    They are bounded as every input is: at most :data:`MAX_TEMPLATE_KWARGS` names, each a
    Python identifier of at most 64 characters, their values JSON (what a body decodes to)
    of at most :data:`MAX_TEMPLATE_KWARGS_CHARS` characters in all, nested at most 8 deep. A
    template reads them as it reads its own variables, so the ones the engine sets
    (``messages``, ``tools``, ``add_generation_prompt``, the special tokens such as
    ``bos_token``) are refused rather than replaced.

    Args:
        kwargs: The variables, or ``None``.
        field: The request's field that holds them, for the messages.

    Returns:
        A copy of the variables (``None`` for none).

    Raises:
        ChatTemplateKwargsError: a rule above is broken (the message names the field, the
            rule and the value).
    """
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping):
        raise ChatTemplateKwargsError(
            f"{field} must be an object of template variables, got {type(kwargs).__name__}"
        )
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ChatTemplateKwargsError(
            f"{field} may hold at most {MAX_TEMPLATE_KWARGS} variables, got {len(kwargs)}"
        )
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier() or len(name) > 64:
            raise ChatTemplateKwargsError(
                f"{field} names must be identifiers of at most 64 characters, got "
                f"{str(name)[:80]!r}"
            )
        if name in _RESERVED_VARIABLES or name.endswith("_token"):
            raise ChatTemplateKwargsError(
                f"{field} must not set {name!r}: the engine sets that template variable itself"
            )
    try:
        size = len(json.dumps(_checked_depth(kwargs, field, 0), ensure_ascii=False))
    except (TypeError, ValueError) as exc:  # not JSON: only code, never a body, passes that
        raise ChatTemplateKwargsError(f"{field} values must be JSON values: {exc}") from None
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise ChatTemplateKwargsError(
            f"{field} may take at most {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON, got {size}"
        )
    return dict(kwargs)


def _checked_depth(value: object, field: str, depth: int) -> object:
    if depth > _MAX_TEMPLATE_KWARGS_DEPTH:
        raise ChatTemplateKwargsError(
            f"{field} values may nest at most {_MAX_TEMPLATE_KWARGS_DEPTH} levels deep, got more"
        )
    if isinstance(value, Mapping):
        for item in value.values():
            _checked_depth(item, field, depth + 1)
    elif isinstance(value, list | tuple):
        for item in value:
            _checked_depth(item, field, depth + 1)
    return value


def render_chat(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    special_tokens: Mapping[str, str],
    limits: TemplateLimits = DEFAULT_TEMPLATE_LIMITS,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """A conversation through the chat template ``source``, as ``transformers`` renders it
    (the generation prompt added, the named special tokens as variables), within ``limits``.

    ``template_kwargs`` are more variables for the template (``enable_thinking``), checked
    by :func:`check_template_kwargs`: none replaces a variable set here.

    Raises:
        TemplateBoundExceeded: the rendering crossed a limit (the message names it).
        ChatTemplateKwargsError: ``template_kwargs`` breaks a rule of
            :func:`check_template_kwargs`, or names a special token of this template's.
        jinja2.TemplateError: the template does not compile or refused the conversation.
    """
    extra = check_template_kwargs(template_kwargs) or {}
    clash = sorted(extra.keys() & special_tokens.keys())
    if clash:
        raise ChatTemplateKwargsError(
            f"chat_template_kwargs must not set {clash[0]!r}: the engine sets that template "
            "variable itself"
        )
    variables = {
        **extra,
        **special_tokens,
        "messages": messages,
        "tools": tools,
        "documents": None,
        "add_generation_prompt": True,
    }
    return render(compile_chat_template(source), limits, variables)
