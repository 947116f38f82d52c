"""The front ends take a coordinator: ``LLM(replicas=...)`` and ``twostroke generate``."""

from __future__ import annotations

import pytest

from twostroke.engine import LLM, CoordinatorStatistics, ReplicaFailed, SamplingParams
from twostroke.engine.cli import main
from twostroke.engine.server.errors import api_error_from


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_llm_over_replicas_generates_what_one_engine_does(backend: str) -> None:
    prompts = [f"prompt {i}" for i in range(6)]
    params = SamplingParams(max_tokens=9, temperature=0)
    with LLM("toy", backend=backend) as llm:  # type: ignore[arg-type]
        expected = llm.generate(prompts, params, progress=False)
    with LLM("toy", backend=backend, replicas=2, device="cpu") as llm:  # type: ignore[arg-type]
        outputs = llm.generate(prompts, params, progress=False)
        stats = llm.statistics()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.text for o in outputs] == [o.text for o in expected]
    assert isinstance(stats, CoordinatorStatistics)
    assert len(stats.replicas) == 2


def test_llm_placement_needs_replicas() -> None:
    with pytest.raises(TypeError, match=r"^placement needs replicas: pass replicas=N as well$"):
        LLM("toy", placement="process")


def test_generate_command_over_replicas_prints_what_one_engine_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    command = ["generate", "hello", "--model", "toy", "--max-tokens", "12", "--device", "cpu"]
    assert main(command) == 0
    expected = capsys.readouterr().out
    assert main([*command, "--replicas", "2", "--placement", "local"]) == 0
    assert capsys.readouterr().out == expected


def test_a_failed_replica_is_a_503_for_the_server() -> None:
    """The other replicas serve on: a retry may succeed (503, not a 500 server fault)."""
    error = api_error_from(ReplicaFailed(1, "its process ended with signal SIGKILL", 7))
    assert (error.status, error.type, error.code) == (503, "server_error", "replica_failed")
    assert error.message == "the replica serving this request failed"
