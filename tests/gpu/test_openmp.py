"""OpenMP's wait policy: bounded spinning unless the user chose one, set before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from twostroke.gpu import openmp
from twostroke.gpu.openmp import WAIT_POLICY_VARIABLES, prefer_bounded_spin


@pytest.fixture
def no_policy(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in WAIT_POLICY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "torch")  # as if torch were not loaded yet
    return monkeypatch


def test_bounded_spinning_when_nobody_chose(no_policy: pytest.MonkeyPatch) -> None:
    assert prefer_bounded_spin()
    assert os.environ["GOMP_SPINCOUNT"] == openmp.SPIN_COUNT == "30000"
    assert "OMP_WAIT_POLICY" not in os.environ


@pytest.mark.parametrize(
    ("name", "value"), [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "10000")]
)
def test_a_users_choice_is_left_alone(no_policy: pytest.MonkeyPatch, name: str, value: str) -> None:
    no_policy.setenv(name, value)
    assert not prefer_bounded_spin()
    assert os.environ[name] == value
    (other,) = set(WAIT_POLICY_VARIABLES) - {name}
    assert other not in os.environ


def test_too_late_once_torch_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in WAIT_POLICY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert "torch" in sys.modules
    assert not prefer_bounded_spin()
    assert not set(WAIT_POLICY_VARIABLES) & set(os.environ)


def test_importing_the_package_sets_it_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_POLICY_VARIABLES}
    code = (
        "import os, twostroke.gpu.openmp as o, torch; "
        "print(o.SET_AT_IMPORT, os.environ.get('GOMP_SPINCOUNT'), o.wait_policy())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split(maxsplit=2) == [
        "True",
        "30000",
        "GOMP_SPINCOUNT=30000 (set by twostroke)\n",
    ]
    assert isinstance(openmp.SET_AT_IMPORT, bool)


@pytest.mark.parametrize(
    ("environ", "set_at_import", "expected"),
    [
        ({}, False, "GNU OpenMP's default (spin 300,000 polls, then sleep)"),
        ({"GOMP_SPINCOUNT": "30000"}, True, "GOMP_SPINCOUNT=30000 (set by twostroke)"),
        (
            {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "3000"},
            False,
            "OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=3000 (chosen by the user)",
        ),
    ],
)
def test_the_policy_in_effect_is_described_for_reports(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], set_at_import: bool, expected: str
) -> None:
    monkeypatch.setattr(
        openmp, "_AT_IMPORT", {name: environ.get(name) for name in WAIT_POLICY_VARIABLES}
    )
    monkeypatch.setattr(openmp, "SET_AT_IMPORT", set_at_import)
    assert openmp.wait_policy() == expected


def test_this_process_reports_what_importing_the_package_found() -> None:
    described = openmp.wait_policy()
    if openmp.SET_AT_IMPORT:
        assert described == "GOMP_SPINCOUNT=30000 (set by twostroke)"
    else:
        assert described.endswith(("(chosen by the user)", "then sleep)"))
