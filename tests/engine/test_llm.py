"""The blocking facade and the CLI, on the toy model."""

from __future__ import annotations

import re
from typing import Any

import pytest

from twostroke.engine import LLM, EngineClosed, RequestRejected, SamplingParams
from twostroke.engine.cli import main


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_llm_generates_in_order(backend: str) -> None:
    prompts = [f"prompt {i}" for i in range(5)]
    with LLM("toy", backend=backend) as llm:  # type: ignore[arg-type]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=7), progress=False)
        single = llm.generate("prompt 3", SamplingParams(max_tokens=7), progress=False)
        stats = llm.statistics()
    assert [o.prompt_token_ids for o in outputs] == [tuple(p.encode()) for p in prompts]
    assert single[0].token_ids == outputs[3].token_ids
    assert stats.num_free_blocks == stats.num_blocks


def test_llm_params_per_prompt() -> None:
    with LLM("toy") as llm:
        outputs = llm.generate(
            ["a", "b"],
            [
                SamplingParams(max_tokens=2, ignore_eos=True),
                SamplingParams(max_tokens=5, ignore_eos=True),
            ],
            progress=False,
        )
        assert [len(o.token_ids) for o in outputs] == [2, 5]
        with pytest.raises(ValueError, match="one per prompt: got 1 for 2 prompts"):
            llm.generate(["a", "b"], [SamplingParams()], progress=False)


BAD_BATCHES = [
    pytest.param(
        ["a fine prompt", ""], None, ValueError, "prompt must not be empty, got ''", id="empty"
    ),
    pytest.param(
        ["fine", 5],
        None,
        TypeError,
        "prompt must be text, a sequence of token ids or a list of chat messages, got int",
        id="not-a-prompt",
    ),
    pytest.param(
        ["fine", [{"role": "user"}]],
        None,
        ValueError,
        "messages[0] must have keys 'role' and 'content', missing 'content'",
        id="bad-chat",
    ),
    pytest.param(
        ["fine", "also fine"],
        [SamplingParams(), {"max_tokens": 3}],
        TypeError,
        "params[1] must be SamplingParams or None, got dict {'max_tokens': 3}",
        id="bad-params",
    ),
    pytest.param(
        ["fine", "x" * 40],
        [SamplingParams(max_tokens=2), SamplingParams(max_tokens=16)],
        RequestRejected,
        "prompt + max_tokens (56 tokens) needs 14 KV blocks of 4, but the pool has only 8",
        id="too-big-for-the-pool",
    ),
]


@pytest.mark.parametrize(("prompts", "params", "error", "message"), BAD_BATCHES)
def test_a_bad_prompt_anywhere_in_a_batch_runs_nothing(
    prompts: list[Any], params: Any, error: type[Exception], message: str
) -> None:
    """Issue 8: the good prompts before the bad one used to be queued and run."""
    with LLM("toy", num_blocks=8, block_size=4) as llm:
        first = llm.generate("warm", SamplingParams(max_tokens=2), progress=False)[0]
        before = llm.statistics()
        with pytest.raises(error) as caught:
            llm.generate(prompts, params, progress=False)
        assert str(caught.value) == message
        after = llm.statistics()
        assert (after.num_steps, after.num_tokens_scheduled, after.num_open_requests) == (
            before.num_steps,
            before.num_tokens_scheduled,
            0,
        )
        assert after.num_free_blocks == after.num_blocks
        # Request ids are consecutive: none was spent on the bad batch, except where the
        # engine itself rejected a request, which is then cancelled before any step.
        following = llm.generate("warm", SamplingParams(max_tokens=2), progress=False)[0]
        if error is not RequestRejected:
            assert following.request_id == first.request_id + 1
        assert following.token_ids == first.token_ids


def test_a_failed_batch_note_names_the_prompt() -> None:
    with LLM("toy") as llm, pytest.raises(ValueError, match="must not be empty") as caught:
        llm.generate(["a", "b", ""], progress=False)
    assert caught.value.__notes__ == ["(prompts[2] of the batch; nothing was queued)"]


@pytest.mark.parametrize(
    ("backend", "error", "message"),
    [
        ("curio", ValueError, "backend must be one of 'asyncio', 'trio', got 'curio'"),
        (None, TypeError, "backend must be one of 'asyncio', 'trio', got NoneType None"),
    ],
)
def test_an_unknown_backend(backend: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        LLM("toy", backend=backend)


def test_llm_after_close() -> None:
    llm = LLM("toy")
    llm.close()
    with pytest.raises(EngineClosed, match="this LLM is closed"):
        llm.generate("late", progress=False)
    llm.close()  # idempotent


def test_cli_generate_streams_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["generate", "hello", "--model", "toy", "--max-tokens", "12", "--device", "cpu"]) == 0
    )
    printed = capsys.readouterr().out
    assert printed.strip()


def test_cli_rejects_bad_sampling_flags() -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        main(["generate", "hello", "--model", "toy", "--max-tokens", "0"])
