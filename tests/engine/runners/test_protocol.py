"""RunnerOutput is frozen all the way down: its mappings are read-only copies."""

from __future__ import annotations

import pytest

from twostroke.engine.runners.protocol import RunnerOutput, TokenLogprobs


def test_runner_output_mappings_are_read_only_copies() -> None:
    sampled = {4: 1}
    logprobs = {4: TokenLogprobs(token_id=1, logprob=-0.5)}
    output = RunnerOutput(step_id=3, sampled=sampled, logprobs=logprobs)
    sampled.clear()
    logprobs.clear()
    assert dict(output.sampled) == {4: 1}
    assert output.logprobs[4].logprob == -0.5
    with pytest.raises(TypeError, match="does not support item assignment"):
        output.sampled[4] = 2  # type: ignore[index]
    with pytest.raises(TypeError, match="does not support item assignment"):
        output.logprobs[5] = TokenLogprobs(token_id=2, logprob=-1.0)  # type: ignore[index]
    assert dict(RunnerOutput(step_id=0, sampled={}).logprobs) == {}
