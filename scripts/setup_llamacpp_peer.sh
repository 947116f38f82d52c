#!/usr/bin/env bash
# Builds the llama.cpp peer of `twostroke bench`: llama-cpp-python, compiled from source, in its
# own virtual environment.
#
# Why from source: the registry has no wheel for every machine, and a wheel built elsewhere is
# built for some other CPU; this one is built for this machine's (llama.cpp's GGML_NATIVE:
# -march=native, so AVX2/AVX-512 where the CPU has them), on CMAKE_BUILD_PARALLEL_LEVEL cores.
# Why its own venv: `make test`'s .venv never builds llama.cpp, and the bench runs llama.cpp in
# a child process of that venv's Python (engine/bench/_llamacpp_child.py), apart from torch's
# OpenMP threads; `make bench` passes --llamacpp-python .venv-llamacpp/bin/python.
# The multimodal library (mtmd, LLAVA_BUILD) is left out: the bench runs text models only.
#
# Idempotent: when the venv already imports the pinned version, nothing is built again.
#
# Usage: scripts/setup_llamacpp_peer.sh [--dry-run] [VENV_DIR]   (default .venv-llamacpp,
# relative to the repo root; --dry-run: say what would be built, build nothing).
# Environment: PYTHON (default python3), LLAMACPP_VERSION (default 0.3.36),
# CMAKE_BUILD_PARALLEL_LEVEL (default 2), CMAKE_ARGS (added to the defaults below).
set -euo pipefail

cd "$(dirname "$0")/.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
VENV_DIR="${1:-.venv-llamacpp}"
PYTHON="${PYTHON:-python3}"
LLAMACPP_VERSION="${LLAMACPP_VERSION:-0.3.36}"

installed() {
    test -x "$VENV_DIR/bin/python" && "$VENV_DIR/bin/python" - "$LLAMACPP_VERSION" <<'EOF' 2>/dev/null
import sys

import llama_cpp

sys.exit(0 if llama_cpp.__version__ == sys.argv[1] else 1)
EOF
}

if installed; then
    echo "setup_llamacpp_peer: llama-cpp-python $LLAMACPP_VERSION is built in $VENV_DIR; nothing to do"
    exit 0
fi
# SOURCE_DATE_EPOCH turns llama.cpp's GGML_NATIVE default off; the build asks for it anyway.
unset SOURCE_DATE_EPOCH
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
export CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF${CMAKE_ARGS:+ $CMAKE_ARGS}"
# --no-binary: always the source; --no-cache-dir: never a wheel cached from another build
# (built for another CPU, or with other CMAKE_ARGS).
install=("$VENV_DIR/bin/python" -m pip install --no-cache-dir --no-binary llama-cpp-python
    "llama-cpp-python==$LLAMACPP_VERSION")
if [ "$DRY_RUN" = 1 ]; then
    echo "setup_llamacpp_peer: would build: CMAKE_BUILD_PARALLEL_LEVEL=$CMAKE_BUILD_PARALLEL_LEVEL CMAKE_ARGS='$CMAKE_ARGS' ${install[*]}"
    exit 0
fi
if ! test -x "$VENV_DIR/bin/python" && ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "setup_llamacpp_peer: $PYTHON not found (set PYTHON=...)" >&2
    exit 1
fi
for tool in cmake cc c++; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "setup_llamacpp_peer: $tool not found; building llama.cpp needs cmake and a C/C++ compiler" >&2
        exit 1
    fi
done

test -x "$VENV_DIR/bin/python" || "$PYTHON" -m venv "$VENV_DIR"
build() {
    echo "setup_llamacpp_peer: building llama-cpp-python $LLAMACPP_VERSION on $CMAKE_BUILD_PARALLEL_LEVEL cores (CMAKE_ARGS=$CMAKE_ARGS)"
    started=$(date +%s)
    "${install[@]}" "$@"
    echo "setup_llamacpp_peer: built in $(($(date +%s) - started)) s"
}
build

# A prompt of 64 tokens through the default GGUF model, where .venv has it: on a CPU that
# reports AMX, -march=native compiles llama.cpp's AMX tile kernels, which a virtual machine
# may not run (an Intel Xeon guest, 2026-12-05: SIGILL at TILELOADD on the first prompt of
# more than a few tokens, while one token decoded). Then it is built again without AMX.
smoke() {
    local model
    model=$(.venv/bin/python -c "from twostroke.engine.checkpoints.source import resolve_model; print(resolve_model('smollm2'))" 2>/dev/null) || return 0
    "$VENV_DIR/bin/python" - "$model" <<'EOF' >/dev/null 2>&1
import sys

import llama_cpp

model = llama_cpp.Llama(sys.argv[1], n_threads=2, verbose=False)
model("The quick brown fox jumps over the lazy dog. " * 6, max_tokens=2)
EOF
}
if ! smoke; then
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
        echo "setup_llamacpp_peer: the build fails a 64-token prompt on this CPU; building it again without AMX ($no_amx)"
        export CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
        build --force-reinstall --no-deps
        smoke || { echo "setup_llamacpp_peer: the build still fails a 64-token prompt" >&2; exit 1; }
    else
        echo "setup_llamacpp_peer: the build fails a 64-token prompt on this CPU" >&2
        exit 1
    fi
fi

"$VENV_DIR/bin/python" - <<'EOF'
import llama_cpp

print(f"llama-cpp-python=={llama_cpp.__version__}")
print(llama_cpp.llama_print_system_info().decode().strip())
EOF
echo "setup_llamacpp_peer: done; run: twostroke bench --llamacpp-python $VENV_DIR/bin/python"
