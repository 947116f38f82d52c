"""Plans and outcomes are frozen all the way down: their mappings are read-only copies."""

from __future__ import annotations

import pytest

from twostroke.states.plan import StepOutcome


def test_an_outcome_copies_its_mapping_and_refuses_assignment() -> None:
    sampled = {1: 7, 2: 9}
    outcome = StepOutcome(0, sampled)
    sampled[3] = 11
    assert dict(outcome.sampled) == {1: 7, 2: 9}
    with pytest.raises(TypeError, match="does not support item assignment"):
        outcome.sampled[1] = 8  # type: ignore[index]
    assert outcome == StepOutcome(0, {1: 7, 2: 9})
