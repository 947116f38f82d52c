"""``scripts/setup_llamacpp_peer.sh`` (``make bench-peers``) builds llama.cpp only when the
pinned version is not there. The suite never builds it: a venv whose ``bin/python`` is this
Python with a fake ``llama_cpp`` on its path stands in for a built one, and ``--dry-run`` says
what it would build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup_llamacpp_peer.sh"


def _setup(tmp_path: Path, *, built: str, pinned: str) -> subprocess.CompletedProcess[str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    fake = tmp_path / "fake" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"__version__ = {built!r}\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake"), "LLAMACPP_VERSION": pinned}
    for name in ("CMAKE_ARGS", "CMAKE_BUILD_PARALLEL_LEVEL"):
        env.pop(name, None)
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(venv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_pinned_version_built_already_is_not_built_again(tmp_path: Path) -> None:
    done = _setup(tmp_path, built="0.3.36", pinned="0.3.36")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        f"setup_llamacpp_peer: llama-cpp-python 0.3.36 is built in {tmp_path / 'venv'}; "
        "nothing to do\n"
    )


def test_another_version_is_built_for_this_cpu_on_two_cores(tmp_path: Path) -> None:
    done = _setup(tmp_path, built="0.3.35", pinned="0.3.36")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        "setup_llamacpp_peer: would build: CMAKE_BUILD_PARALLEL_LEVEL=2 "
        "CMAKE_ARGS='-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF' "
        f"{tmp_path / 'venv' / 'bin' / 'python'} -m pip install --no-cache-dir "
        "--no-binary llama-cpp-python llama-cpp-python==0.3.36\n"
    )
