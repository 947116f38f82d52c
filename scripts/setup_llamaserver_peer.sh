#!/usr/bin/env bash
# Builds the llama-server peer of `twostroke bench`: llama.cpp's own HTTP server (continuous
# batching over -np slots), compiled from the llama.cpp that the llama-cpp-python source
# distribution vendors, so that it is the same llama.cpp as the one-sequence llama.cpp peer
# (scripts/setup_llamacpp_peer.sh), at the same pin.
#
# Why from source: as for the binding, a binary built elsewhere is built for some other CPU;
# this one is built for this machine's (GGML_NATIVE: -march=native). With --avx2 it is built
# for AVX2 alone instead (GGML_NATIVE off, AVX, AVX2, FMA, F16C and BMI2 on, every AVX-512 and
# AMX option off): the rung that users without AVX-512 run, beside the native build, apart.
# Linked statically (BUILD_SHARED_LIBS=OFF), so that the one file installed runs alone; without
# HTTPS (LLAMA_OPENSSL=OFF: the bench talks to it on 127.0.0.1) and without its web page
# (LLAMA_USE_PREBUILT_UI=OFF: that would download it at build time).
#
# Installed as VENV_DIR/bin/llama-server (native) or VENV_DIR/avx2/bin/llama-server (--avx2).
# Its --version names the pin and the flavour as its commit (llama-cpp-python-0.3.36-native),
# and the build is idempotent: where that binary already says so, nothing is built again (10 ms).
# The source and the CMake build folders stay in BUILD_DIR, so an interrupted build goes on where
# it stopped.
#
# Usage: scripts/setup_llamaserver_peer.sh [--dry-run] [--avx2] [VENV_DIR]
#   (default .venv-llamacpp, relative to the repo root; --dry-run: say what would be built,
#   build nothing).
# Environment: PYTHON (default python3, to download the source), LLAMACPP_VERSION (default
# 0.3.36), CMAKE_BUILD_PARALLEL_LEVEL (default 2), CMAKE_ARGS (added to the defaults below),
# BUILD_DIR (default build/llama-server).
set -euo pipefail

cd "$(dirname "$0")/.."
DRY_RUN=0
FLAVOUR=native
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --avx2) FLAVOUR=avx2 ;;
        -*)
            echo "setup_llamaserver_peer: unknown option $1 (known: --dry-run, --avx2)" >&2
            exit 2
            ;;
        *) break ;;
    esac
    shift
done
VENV_DIR="${1:-.venv-llamacpp}"
PYTHON="${PYTHON:-python3}"
LLAMACPP_VERSION="${LLAMACPP_VERSION:-0.3.36}"
BUILD_DIR="${BUILD_DIR:-build/llama-server}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
if [ "$FLAVOUR" = native ]; then
    TARGET="$VENV_DIR/bin/llama-server"
    isa=(-DGGML_NATIVE=ON)
else
    TARGET="$VENV_DIR/avx2/bin/llama-server"
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
        -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
        -DGGML_AMX_BF16=OFF)
fi
# The commit --version names (`version: 0.5.0-dev (build 0, commit BUILD_NAME)`): the pin and
# the flavour, checked below.
BUILD_NAME="llama-cpp-python-$LLAMACPP_VERSION-$FLAVOUR"
SOURCE="$BUILD_DIR/llama_cpp_python-$LLAMACPP_VERSION"
CMAKE_BUILD="$BUILD_DIR/build-$LLAMACPP_VERSION-$FLAVOUR"
# The build number and commit are given, not read by git: the vendored tree has no .git, and a
# BUILD_DIR inside this repository would otherwise stamp twostroke's commit on llama.cpp.
configure=(cmake -S "$SOURCE/vendor/llama.cpp" -B "$CMAKE_BUILD" -DCMAKE_BUILD_TYPE=Release
    "${isa[@]}" -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_NUMBER=0 "-DLLAMA_BUILD_COMMIT=$BUILD_NAME")
if [ -n "${CMAKE_ARGS:-}" ]; then
    read -r -a extra <<<"$CMAKE_ARGS"
    configure+=("${extra[@]}")
fi

installed() {
    test -x "$TARGET" && "$TARGET" --version 2>&1 | grep -qF "commit $BUILD_NAME)"
}

if installed; then
    echo "setup_llamaserver_peer: llama-server ($BUILD_NAME) is built in $TARGET; nothing to do"
    exit 0
fi
if [ "$DRY_RUN" = 1 ]; then
    echo "setup_llamaserver_peer: would download llama-cpp-python==$LLAMACPP_VERSION's source into $BUILD_DIR"
    echo "setup_llamaserver_peer: would build: ${configure[*]} && cmake --build $CMAKE_BUILD --target llama-server -j $CMAKE_BUILD_PARALLEL_LEVEL"
    echo "setup_llamaserver_peer: would install $TARGET"
    exit 0
fi
for tool in cmake cc c++ "$PYTHON"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "setup_llamaserver_peer: $tool not found; building llama-server needs cmake, a C/C++ compiler and Python (set PYTHON=...)" >&2
        exit 1
    fi
done
# SOURCE_DATE_EPOCH turns llama.cpp's GGML_NATIVE default off; the build names it anyway.
unset SOURCE_DATE_EPOCH

mkdir -p "$BUILD_DIR"
if ! test -f "$SOURCE/vendor/llama.cpp/CMakeLists.txt"; then
    echo "setup_llamaserver_peer: downloading llama-cpp-python==$LLAMACPP_VERSION's source distribution"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMACPP_VERSION" -d "$BUILD_DIR"
    tar -xzf "$BUILD_DIR/llama_cpp_python-$LLAMACPP_VERSION.tar.gz" -C "$BUILD_DIR"
fi

build() {
    echo "setup_llamaserver_peer: building llama-server ($BUILD_NAME) on $CMAKE_BUILD_PARALLEL_LEVEL cores"
    started=$(date +%s)
    "${configure[@]}" "$@" >"$BUILD_DIR/configure-$FLAVOUR.log"
    cmake --build "$CMAKE_BUILD" --target llama-server -j "$CMAKE_BUILD_PARALLEL_LEVEL"
    echo "setup_llamaserver_peer: built in $(($(date +%s) - started)) s"
}
build

# A 64-token prompt through the default GGUF model, where .venv has it: as for the binding
# (setup_llamacpp_peer.sh), -march=native on a CPU that reports AMX compiles llama.cpp's AMX
# tile kernels, which a virtual machine may not run (SIGILL on the first long prompt); then it
# is built again without AMX. The AVX2 build has no AMX to take off. Installed only once it
# passes, so that a binary that fails it is never taken for the pinned build.
smoke() {
    local model
    model=$(.venv/bin/python -c "from twostroke.engine.checkpoints.source import resolve_model; print(resolve_model('smollm2'))" 2>/dev/null) || return 0
    "$PYTHON" - "$CMAKE_BUILD/bin/llama-server" "$model" <<'EOF'
import json
import socket
import subprocess
import sys
import time
import urllib.request

binary, model = sys.argv[1:]
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
server = subprocess.Popen(
    [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "256"],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
base = f"http://127.0.0.1:{port}"
try:
    for _ in range(240):
        if server.poll() is not None:
            sys.exit(f"llama-server exited with status {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
                if reply.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.5)
    else:
        sys.exit("llama-server was not ready in 120 s")
    body = json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 6,
                       "n_predict": 2}).encode()
    request = urllib.request.Request(f"{base}/completion", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        json.load(reply)
finally:
    server.kill()
    server.wait()
EOF
}
if ! smoke; then
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    if [ "$FLAVOUR" = native ] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
        echo "setup_llamaserver_peer: the build fails a 64-token prompt on this CPU; building it again without AMX ($no_amx)"
        build "-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx"
        smoke || { echo "setup_llamaserver_peer: the build still fails a 64-token prompt" >&2; exit 1; }
    else
        echo "setup_llamaserver_peer: the build fails a 64-token prompt on this CPU" >&2
        exit 1
    fi
fi

mkdir -p "$(dirname "$TARGET")"
install -m 755 "$CMAKE_BUILD/bin/llama-server" "$TARGET"
"$TARGET" --version 2>&1 | grep -E "^(version|built with)" || true
echo "setup_llamaserver_peer: done; run: twostroke bench --llamaserver-binary $TARGET"
