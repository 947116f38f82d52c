"""Chat templates render within their bounds: loops, built text and CPU time are counted as
the template runs, and a template that crosses a bound on every conversation refuses its
model at load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.engine.text.test_tokenizer import write_model_directory
from twostroke.engine.text.chat_template import TemplateBoundExceeded, TemplateLimits, render_chat
from twostroke.engine.text.tokenizer import ChatTemplateError, HFTokenizer, TokenizerLoadError

MESSAGES = [{"role": "user", "content": "hi"}]
#: 10^10 iterations: before the bounds, the first chat request froze the server for good.
NESTED_RANGES = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
#: As many iterations as the conversation has characters, times 1000: passes the load's
#: short conversation, not a long message.
PER_CHARACTER = (
    "{% for m in messages %}{% for i in range(m['content']|length * 1000) %}{% endfor %}"
    "{{ m['content'] }}{% endfor %}"
)


def render(source: str, limits: TemplateLimits | None = None) -> str:
    return render_chat(source, MESSAGES, None, {"bos_token": "<s>"}, limits or TemplateLimits())


def bound(message: str) -> pytest.RaisesExc[TemplateBoundExceeded]:
    return pytest.raises(TemplateBoundExceeded, match=f"^{re.escape(message)}")


def test_a_template_within_its_bounds_renders_as_before() -> None:
    source = (
        "{% for m in messages %}{{ bos_token }}{{ m.role }}: {{ m['content'] }}"
        "{{ loop.index }}/{{ loop.length }}{% endfor %}{{ 'ab' * 2 }}{{ 2 ** 10 }}"
        "{{ '%s-%d' % ('x', 5) }}{{ '{}!'.format('y') }}{{ 'x'|center(3) }}{{ [1] + [2] }}"
    )
    assert render(source) == "<s>user: hi1/1abab1024x-5y! x [1, 2]"


def test_nested_loops_stop_at_the_iteration_bound() -> None:
    with bound(
        "a chat template may run at most max_loop_iterations = 1000 loop iterations and "
        "calls, got 1001"
    ):
        render(NESTED_RANGES, TemplateLimits(max_loop_iterations=1000))


def test_cpu_time_is_bounded() -> None:
    with bound("a chat template may run at most max_seconds = 1e-09 CPU seconds, got "):
        render(NESTED_RANGES, TemplateLimits(max_seconds=1e-9))


@pytest.mark.parametrize(
    ("source", "what", "size"),
    [
        ("{{ 'x' * 10000000000 }}", "a sequence times 10000000000", 10000000000),
        ("{{ 10 ** 100000 }}", "10 ** 100000", 133333),
        ("{{ 'x' + 'y' * 99 }}", "a sum of sequences", 100),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "a concatenation",
            128,
        ),
        ("{{ 'x'.ljust(1000000000) }}", "the width given to str.ljust", 1000000000),
        ("{{ 'x'|center(1000000000) }}", "the width given to the center filter", 1000000000),
        ("{{ '%999999999d' % 1 }}", "the width given to % formatting", 999999999),
        ("{{ '{:>999999999}'.format(1) }}", "the width given to str.format", 999999999),
        ("{% for i in range(100) %}x{% endfor %}", "the rendered text", 100),
    ],
)
def test_built_text_is_bounded_before_it_is_built(source: str, what: str, size: int) -> None:
    with bound(
        f"a chat template may build at most max_output_chars = 99 characters ({what}), got {size}"
    ):
        render(source, TemplateLimits(max_output_chars=99))


def test_endless_recursion_is_a_bound() -> None:
    source = "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"
    with bound("a chat template may nest calls at most as deep as Python's recursion limit"):
        render(source)


def test_the_sandboxs_range_bound_is_a_bound() -> None:
    with bound("a chat template overflowed: Range too big. The sandbox blocks ranges"):
        render("{{ range(100001) | list }}")


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^max_seconds must be a number > 0, got 0$"):
        TemplateLimits(max_seconds=0)


def test_a_template_that_never_ends_refuses_the_model_at_load(tmp_path: Path) -> None:
    write_model_directory(tmp_path, chat_template=NESTED_RANGES)
    with pytest.raises(
        TokenizerLoadError,
        match=(
            f"^cannot load a tokenizer from {re.escape(str(tmp_path))}: the chat template of "
            f"{re.escape(str(tmp_path))} was stopped: a chat template may run at most "
            r"max_loop_iterations = 1000000 loop iterations and calls, got 1000001$"
        ),
    ):
        HFTokenizer.from_pretrained(tmp_path)


def test_a_template_that_refuses_the_probe_by_its_own_rules_still_loads(tmp_path: Path) -> None:
    write_model_directory(tmp_path, chat_template="{{ raise_exception('system first') }}")
    tokenizer = HFTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ChatTemplateError, match=r"rejected the messages: system first$"):
        tokenizer.apply_chat_template(MESSAGES)


def test_a_bound_that_depends_on_the_messages_is_refused_per_request(tmp_path: Path) -> None:
    write_model_directory(tmp_path, chat_template=PER_CHARACTER)
    tokenizer = HFTokenizer.from_pretrained(tmp_path)  # the short probe passes
    assert tokenizer.apply_chat_template(MESSAGES)
    with pytest.raises(
        ChatTemplateError,
        match=r"was stopped: a chat template may run at most max_loop_iterations = 1000000 ",
    ):
        tokenizer.apply_chat_template([{"role": "user", "content": "x" * 99}] * 11)
