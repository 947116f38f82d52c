"""The prepared GPU check's CPU-only path: ``scripts/gpu_check.sh --dry-run`` runs and reports.

The script waits for a GPU machine; this keeps it from rotting meanwhile. The dry run runs the
same Python as the real check, on the CPU with a tiny random model (the CUDA-marked tests skip,
the bench command is recorded, not run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
# Hang tripwires: the dry run took 29.7 s with the 2-core machine at a load average of 3;
# 300 s leaves ten times that for a background load on both cores (110 s left under four),
# and pytest's own limit comes after the script's, so a hang reports the script's output.
@pytest.mark.timeout(330)
def test_the_gpu_check_dry_run_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["dry_run"] is True
    assert figures["passed"] is True
    tests = figures["cuda_tests"]
    assert tests["returncode"] == 0
    assert tests["tests"] >= 10
    assert tests["failures"] == tests["errors"] == 0
    parity = figures["parity"]
    assert (parity["device"], parity["mismatches"], parity["passed"]) == ("cpu", 0, True)
    for depth in ("depth1", "depth2"):
        run = figures["engine"][depth]
        assert run["steps"] > 0
        assert run["forward_idle_seconds"] >= 0
        assert run["completion_polls"] >= run["steps"]
    assert figures["bench"]["skipped"] == "dry run"
    assert "--device cpu" in figures["bench"]["command"]


def test_the_gpu_check_refuses_to_run_without_a_gpu_unless_dry(tmp_path: Path) -> None:
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "f.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "torch.cuda.is_available() is False" in done.stderr
    assert "error" in json.loads((tmp_path / "f.json").read_text())
