"""A replica child does not inherit the server's API key from the coordinator's environment."""

from __future__ import annotations

import sys

import pytest

from twostroke.engine.coordinator import Coordinator, process
from twostroke.engine.coordinator.process import WITHHELD_VARIABLES, replica_environment
from twostroke.engine.errors import ReplicaFailed
from twostroke.gpu import openmp

pytestmark = pytest.mark.anyio

# A child that says what it was given, then fails its start (the error carries its stderr).
TELL_AND_EXIT = """
import os, sys
key = os.environ.get("TWOSTROKE_API_KEY")
other = os.environ.get("TWOSTROKE_TEST_MARKER")
print(f"key: {'absent' if key is None else 'PRESENT ' + key}, marker: {other}", file=sys.stderr)
sys.exit(3)
"""


def test_the_environment_keeps_everything_but_the_key() -> None:
    given = {"PATH": "/bin", "TWOSTROKE_API_KEY": "sk-secret", "HF_HOME": "/cache"}
    assert replica_environment(given) == {
        "PATH": "/bin",
        "HF_HOME": "/cache",
        "OMP_WAIT_POLICY": "PASSIVE",  # a fixed thread count: see the next test
    }
    assert {"TWOSTROKE_API_KEY"} == WITHHELD_VARIABLES


@pytest.mark.parametrize(
    ("set_at_import", "given", "expected"),
    [
        # twostroke's own choice for this process, or none: the child waits passively.
        (True, {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        (False, {}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        # The user's choice, whatever it is, reaches the child unchanged.
        (False, {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}, {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}),
        (True, {"GOMP_SPINCOUNT": "1000"}, {"GOMP_SPINCOUNT": "1000"}),
        (False, {"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"}),
    ],
)
def test_a_replica_waits_passively_unless_the_user_chose_a_policy(
    monkeypatch: pytest.MonkeyPatch,
    set_at_import: bool,
    given: dict[str, str],
    expected: dict[str, str],
) -> None:
    """A process replica computes on a fixed share of the cores, which no thread governor
    watches: spinning waits would punish it on a shared machine (twostroke.gpu.openmp)."""
    monkeypatch.setattr(openmp, "SET_AT_IMPORT", set_at_import)
    assert replica_environment({"PATH": "/bin", **given}) == {"PATH": "/bin", **expected}


async def test_a_replica_child_does_not_see_twostroke_api_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TWOSTROKE_API_KEY", "sk-secret")
    monkeypatch.setenv("TWOSTROKE_TEST_MARKER", "inherited")
    command = [sys.executable, "-c", TELL_AND_EXIT]
    monkeypatch.setattr(process, "replica_command", lambda: command)
    with pytest.raises(ReplicaFailed, match="exit code 3") as caught:
        async with Coordinator.open(replicas=1, placement="process"):
            raise AssertionError("must not start")
    assert "key: absent, marker: inherited" in str(caught.value)
    assert "sk-secret" not in str(caught.value)
