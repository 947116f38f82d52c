#!/usr/bin/env bash
# Sets up the OpenVINO GenAI peer of `twostroke bench` in its own virtual environment.
#
# Why a separate venv: openvino-genai brings its own runtime (OpenVINO, TBB, its tokenizers),
# which `make test`'s venv does not need; the bench drives it as a subprocess
# (`twostroke bench --openvino-python .venv-openvino/bin/python`), apart from torch's threads.
# The wheels are prebuilt for x86-64 Linux (about 100 MB in all); nothing is compiled.
#
# Idempotent: when the venv already has the pinned version (a `NAME==VERSION` spec), nothing is
# installed again.
#
# Usage: scripts/setup_openvino_peer.sh [--dry-run] [VENV_DIR]   (default .venv-openvino,
# relative to the repo root; --dry-run: say what would be installed, install nothing).
# Environment: PYTHON (default python3), OPENVINO_SPEC (default openvino-genai==2026.4.1).
set -euo pipefail

cd "$(dirname "$0")/.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
VENV_DIR="${1:-.venv-openvino}"
PYTHON="${PYTHON:-python3}"
OPENVINO_SPEC="${OPENVINO_SPEC:-openvino-genai==2026.4.1}"

installed() {
    test -x "$VENV_DIR/bin/python" &&
        "$VENV_DIR/bin/python" - "$OPENVINO_SPEC" <<'PY' 2>/dev/null
import importlib.metadata as md
import sys

def release(version: str) -> list[str]:
    """The release numbers, trailing zeros dropped (the wheel says 2026.4.1.0 for 2026.4.1)."""
    parts = version.split(".")
    while len(parts) > 1 and parts[-1] == "0":
        parts.pop()
    return parts


name, pinned, version = sys.argv[1].partition("==")
if not pinned:
    sys.exit(1)  # not a pin: pip decides
try:
    sys.exit(0 if release(md.version(name)) == release(version) else 1)
except md.PackageNotFoundError:
    sys.exit(1)
PY
}

if installed; then
    echo "setup_openvino_peer: $OPENVINO_SPEC is installed in $VENV_DIR; nothing to do"
    exit 0
fi
if [ "$DRY_RUN" = 1 ]; then
    echo "setup_openvino_peer: would install: $VENV_DIR/bin/python -m pip install $OPENVINO_SPEC"
    exit 0
fi
if ! test -x "$VENV_DIR/bin/python" && ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "setup_openvino_peer: $PYTHON not found (set PYTHON=...)" >&2
    exit 1
fi

test -x "$VENV_DIR/bin/python" || "$PYTHON" -m venv "$VENV_DIR"
"$VENV_DIR/bin/python" -m pip install --no-cache-dir "$OPENVINO_SPEC"
"$VENV_DIR/bin/python" -c "import openvino_genai; print('openvino-genai', openvino_genai.get_version())"
echo "setup_openvino_peer: done; run: twostroke bench --openvino-python $VENV_DIR/bin/python"
