"""The blocking facade and the CLI, on the toy model."""

from __future__ import annotations

import pytest

from twostroke.engine import LLM, EngineClosed, SamplingParams
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
        with pytest.raises(ValueError, match="prompt must not be empty"):
            llm.generate(["a", ""], progress=False)


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
