"""A thinking model's output split into reasoning and answer: whole, and delta by delta."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.engine.text.reasoning import (
    REASONING_PARSERS,
    ReasoningSplit,
    opens_reasoning,
    reasoning_format,
    split_reasoning,
    template_reasoning_format,
)

THINK = reasoning_format("think")
R1 = reasoning_format("deepseek_r1")


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        (
            "<think>\nplan it\n</think>\n\nthe answer",
            False,
            ReasoningSplit("plan it\n", "the answer"),
        ),
        ("  <think>x</think>y", False, ReasoningSplit("x", "y")),
        ("no thinking </think> here", False, ReasoningSplit(None, "no thinking </think> here")),
        ("\nplain", False, ReasoningSplit(None, "\nplain")),
        # The prompt opened it (Qwen3's thinking models): the output starts inside.
        ("plan</think>answer", True, ReasoningSplit("plan", "answer")),
        ("<think>plan</think>answer", True, ReasoningSplit("plan", "answer")),
        ("cut off while thinking", True, ReasoningSplit("cut off while thinking", "")),
        ("<think>never closed </thi", False, ReasoningSplit("never closed </thi", "")),
        ("<think>\n\n</think>\n\n{}", False, ReasoningSplit("", "{}")),
        ("<thi", False, ReasoningSplit(None, "<thi")),
        ("", False, ReasoningSplit(None, "")),
        ("", True, ReasoningSplit("", "")),
    ],
)
def test_split(text: str, opened: bool, expected: ReasoningSplit) -> None:
    assert split_reasoning(THINK, text, opened=opened) == expected


def test_deepseek_r1_always_starts_inside_the_reasoning() -> None:
    assert split_reasoning(R1, "plan</think>answer") == ReasoningSplit("plan", "answer")
    assert opens_reasoning(R1, "no marker at all")


@pytest.mark.parametrize(
    ("tail", "opened"),
    [
        ("<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>\n", True),
        # Qwen3 with enable_thinking=False closes an empty reasoning in the prompt.
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ],
)
def test_the_prompts_tail_says_whether_the_reasoning_is_open(tail: str, opened: bool) -> None:
    assert opens_reasoning(THINK, tail) is opened


def test_a_template_that_mentions_think_enables_the_generic_parser() -> None:
    assert template_reasoning_format("{{ '<think>\\n\\n</think>' }}") == THINK
    assert template_reasoning_format("<|im_start|>{{ m.content }}") is None
    assert template_reasoning_format(None) is None


def test_an_unknown_parser_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"reasoning parser must be one of deepseek_r1, qwen3, "
                                         r"think, got 'r2'"):  # fmt: skip
        reasoning_format("r2")
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "think"}


_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b"])


@given(
    pieces=st.lists(_PIECES, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=8),
    opened=st.booleans(),
    deepseek=st.booleans(),
)
def test_any_split_into_deltas_gives_the_whole_outputs_split(
    pieces: list[str], cuts: list[int], opened: bool, deepseek: bool
) -> None:
    fmt = R1 if deepseek else THINK
    text = "".join(pieces)
    bounds = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    parser = fmt.parser(opened)
    reasoning, content = [], []
    for begin, end in itertools.pairwise(bounds):
        delta = parser.feed(text[begin:end])
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    last = parser.finish()
    whole = split_reasoning(fmt, text, opened=opened)
    assert "".join(content) + last.content == whole.content
    assert "".join(reasoning) + last.reasoning == (whole.reasoning or "")
    assert parser.reasoned is (whole.reasoning is not None)
