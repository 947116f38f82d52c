"""The workloads where speculation pays: input-grounded requests and an agent trace."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import pytest

from twostroke.engine.bench.grounded import (
    ANSWER_MARGIN,
    CODE,
    GROUNDED_KINDS,
    agent_workload,
    grounded_exchanges,
    grounded_workload,
)


def encode(text: str) -> list[int]:
    """A deterministic word-level stand-in for a tokenizer."""
    return [sum(map(ord, word)) % 5000 for word in text.split()]


def chat(messages: Sequence[Mapping[str, str]]) -> list[int]:
    """A ChatML-like stand-in for a chat template: role markers and the contents' words."""
    ids: list[int] = []
    for message in messages:
        ids += [9000 + len(message["role"]), *encode(message["content"]), 9999]
    return [*ids, 9009]  # the generation prompt


def test_each_task_in_turn_and_each_answer_comes_from_its_prompt() -> None:
    exchanges = grounded_exchanges(2 * len(GROUNDED_KINDS))
    assert [e.kind for e in exchanges] == [*GROUNDED_KINDS, *GROUNDED_KINDS]
    for exchange in exchanges:
        prompt = exchange.messages[-1]["content"]
        assert exchange.messages[-1]["role"] == "user"
        answer = set(exchange.answer.replace("|", " ").replace("\n", " ").split())
        # The answer quotes or edits the prompt's passage: nearly every word of it is there.
        shown = set(prompt.replace(",", " ").split())
        quoted = len(answer & shown) / len(answer)
        assert quoted > (0.6 if exchange.kind == "spelling" else 0.85), (exchange.kind, quoted)
    replace, spelling, extract, numbered, rename, markdown = exchanges[: len(GROUNDED_KINDS)]
    assert 'write "motor" instead of "engine"' in replace.messages[-1]["content"]
    assert "motor" in replace.answer
    assert "engine" not in replace.answer
    # The prompt shows the passage misspelled; the answer is the passage as written.
    assert spelling.answer not in spelling.messages[-1]["content"]
    assert extract.answer in extract.messages[-1]["content"]
    assert numbered.answer.startswith("1. ")
    assert "def read_settings(path):" in rename.answer
    assert "load_config" not in rename.answer
    assert markdown.answer.startswith("| engine | cylinders |")


def test_grounded_workload_is_fixed_by_its_seed_and_sized_to_the_answers() -> None:
    first = grounded_workload(chat, encode, n=12, seed=1)
    assert first == grounded_workload(chat, encode, n=12, seed=1)
    assert first.requests != grounded_workload(chat, encode, n=12, seed=2).requests
    assert first.is_offline
    exchanges = grounded_exchanges(12, seed=1)
    for request, exchange in zip(first.requests, exchanges, strict=True):
        assert request.prompt_token_ids == tuple(chat(exchange.messages))
        assert request.max_tokens == len(encode(exchange.answer)) + ANSWER_MARGIN
    # Distinct prompts: a prefix cache finds only the shared instruction's start.
    assert len({r.prompt_token_ids for r in first.requests}) == 12
    assert first.description.startswith("input-grounded: 12 chat requests at once quoting")
    assert first.description.endswith(", seed 1")


def test_agent_sessions_read_write_test_and_report_and_recur() -> None:
    workload = agent_workload(chat, encode, n=40, seed=0)
    assert len(workload.requests) == 40
    assert workload.is_offline
    assert workload == agent_workload(chat, encode, n=40, seed=0)
    assert workload.description.startswith("agent trace: 40 turns of coding-agent sessions")
    # Each session's turns grow one prompt: every turn's prompt starts with the one before.
    prompts = [request.prompt_token_ids for request in workload.requests]
    for before, after in itertools.pairwise(prompts[:4]):
        assert after[: len(before) - 1] == before[:-1]  # all but the generation prompt
    # 8 sessions of 4 turns, then the trace again in another order: the same outputs recur.
    first_round = [r.max_tokens for r in workload.requests[:32]]
    assert sorted(first_round) == sorted(
        [r.max_tokens for r in agent_workload(chat, encode, n=32, seed=5).requests]
    )


def test_agent_turns_write_back_the_file_they_read_fixed() -> None:
    from twostroke.engine.bench.grounded import _BUGS, _session

    path = "src/units.py"
    read, write, run_tests, report = _session(path, _BUGS[path][0])
    assert read.answer == f"read_file {path}"
    assert write.answer == f"write_file {path}\n```python\n{CODE[path]}```"
    shown = write.messages[-1]["content"]
    assert 'units = {"s": 1, "m": 60, "h": 60}' in shown  # the bug, as read
    assert run_tests.answer == "run_tests tests/test_units.py"
    assert report.answer.startswith("Done: fixed src/units.py")
    assert [m["role"] for m in report.messages] == [
        "system", "user", "assistant", "user", "assistant", "user", "assistant", "user",
    ]  # fmt: skip


@pytest.mark.parametrize("n", [0, -1, 1.5])
def test_a_workload_needs_requests(n: object) -> None:
    with pytest.raises(ValueError, match=f"^n must be an int >= 1, got {n!r}$"):
        grounded_workload(chat, encode, n=n)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"^n must be an int >= 1, got {n!r}$"):
        agent_workload(chat, encode, n=n)  # type: ignore[arg-type]
