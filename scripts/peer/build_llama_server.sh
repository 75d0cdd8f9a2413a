#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, native flags) from the llama.cpp tree that the PyPI sdist
# of llama-cpp-python vendors. Everything lives in a cache dir outside the repo; nothing of
# llama.cpp is ever committed. Prints the path of the binary on its last line.
#   bash scripts/peer/build_llama_server.sh [CACHE_DIR]
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default 2).
set -euo pipefail
CACHE=${1:-${MINISGL_PEER_CACHE:-$HOME/.cache/minisgl-peer}}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
SRC=$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$CACHE/build-$VERSION
BIN=$BUILD/bin/llama-server

log() { echo "[peer-build] $*" >&2; }

if [ -x "$BIN" ]; then
    log "cached: $BIN"
    echo "$BIN"
    exit 0
fi
mkdir -p "$CACHE/src"
tarball=$CACHE/src/llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$tarball" ]; then
    log "downloading the llama-cpp-python $VERSION sdist"
    "$PY" -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps \
        "llama-cpp-python==$VERSION" -d "$CACHE/src" >&2
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    log "unpacking $tarball"
    tar xzf "$tarball" -C "$CACHE/src"
fi
# The UI would be fetched from a hub at configure time (no network here) and is not needed;
# OpenSSL and curl only serve model downloads.
log "configuring (Release, GGML_NATIVE=ON) in $BUILD"
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF >&2
log "building llama-server with -j$JOBS (about 10 minutes on 2 cores)"
cmake --build "$BUILD" --target llama-server -j "$JOBS" >&2
[ -x "$BIN" ] || { log "build finished but $BIN is missing"; exit 1; }
echo "$BIN"
