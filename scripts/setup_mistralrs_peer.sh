#!/usr/bin/env bash
# Sets up the mistral.rs peer of `twostroke bench` in its own virtual environment.
#
# Why a separate venv: the `mistralrs` wheel is a Rust extension with its own thread pool
# (rayon), which `make test`'s venv does not need; the bench drives it as a subprocess
# (`twostroke bench --mistralrs-python .venv-mistralrs/bin/python`), apart from torch's threads.
# The PyPI wheel is prebuilt for the CPU (x86-64 Linux, about 26 MB); nothing is compiled.
#
# Idempotent: when the venv already has the pinned version (a `NAME==VERSION` spec), nothing is
# installed again.
#
# Usage: scripts/setup_mistralrs_peer.sh [--dry-run] [VENV_DIR]   (default .venv-mistralrs,
# relative to the repo root; --dry-run: say what would be installed, install nothing).
# Environment: PYTHON (default python3), MISTRALRS_SPEC (default mistralrs==0.9.5).
set -euo pipefail

cd "$(dirname "$0")/.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
VENV_DIR="${1:-.venv-mistralrs}"
PYTHON="${PYTHON:-python3}"
MISTRALRS_SPEC="${MISTRALRS_SPEC:-mistralrs==0.9.5}"

installed() {
    test -x "$VENV_DIR/bin/python" &&
        "$VENV_DIR/bin/python" - "$MISTRALRS_SPEC" <<'PY' 2>/dev/null
import importlib.metadata as md
import sys

name, pinned, version = sys.argv[1].partition("==")
if not pinned:
    sys.exit(1)  # not a pin: pip decides
try:
    sys.exit(0 if md.version(name) == version else 1)
except md.PackageNotFoundError:
    sys.exit(1)
PY
}

if installed; then
    echo "setup_mistralrs_peer: $MISTRALRS_SPEC is installed in $VENV_DIR; nothing to do"
    exit 0
fi
if [ "$DRY_RUN" = 1 ]; then
    echo "setup_mistralrs_peer: would install: $VENV_DIR/bin/python -m pip install $MISTRALRS_SPEC"
    exit 0
fi
if ! test -x "$VENV_DIR/bin/python" && ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "setup_mistralrs_peer: $PYTHON not found (set PYTHON=...)" >&2
    exit 1
fi

test -x "$VENV_DIR/bin/python" || "$PYTHON" -m venv "$VENV_DIR"
"$VENV_DIR/bin/python" -m pip install --no-cache-dir "$MISTRALRS_SPEC"
"$VENV_DIR/bin/python" -c "import importlib.metadata as md, mistralrs; print('mistralrs', md.version('mistralrs'))"
echo "setup_mistralrs_peer: done; run: twostroke bench --mistralrs-python $VENV_DIR/bin/python"
