"""The front ends take a coordinator: ``LLM(replicas=...)`` and ``twostroke generate``.

All of them open an engine or a coordinator by one rule (``open_surface``).
"""

from __future__ import annotations

import pytest

from twostroke.engine import (
    LLM,
    Coordinator,
    CoordinatorStatistics,
    Engine,
    ReplicaFailed,
    SamplingParams,
)
from twostroke.engine.cli import main
from twostroke.engine.server.errors import api_error_from
from twostroke.engine.surface import open_surface


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


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("replicas", "placement", "expected"),
    [
        (None, None, Engine),
        (1, None, Coordinator),  # one replica behind a coordinator is what was asked
        (None, "local", Coordinator),
        (2, "local", Coordinator),
    ],
)
async def test_one_rule_opens_an_engine_or_a_coordinator(
    replicas: int | None, placement: str | None, expected: type
) -> None:
    opened = open_surface("toy", replicas=replicas, placement=placement, device="cpu")
    async with opened as engine:
        assert type(engine) is expected
        if isinstance(engine, Coordinator):
            assert len(engine.statistics().replicas) == (replicas or 1)


def test_llm_opens_by_the_same_rule() -> None:
    with LLM("toy", placement="local", device="cpu") as llm:
        stats = llm.statistics()
    assert isinstance(stats, CoordinatorStatistics)
    assert len(stats.replicas) == 1


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
