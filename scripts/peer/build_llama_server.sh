#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU; native flags, or AVX2-only with LLAMA_ISA=avx2) from the llama.cpp tree that the PyPI sdist
# of llama-cpp-python vendors. Everything lives in a cache dir outside the repo; nothing of
# llama.cpp is ever committed. Prints the path of the binary on its last line.
#   bash scripts/peer/build_llama_server.sh [CACHE_DIR]
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default 2), LLAMA_ISA (native: GGML_NATIVE,
#      the build's own CPU; avx2: GGML_NATIVE=OFF with AVX/AVX2/FMA/F16C/BMI2 on and every AVX-512/AMX/
#      AVX-VNNI flag off, what a Zen 3 or a client Intel chip runs; its own build dir, build-V-avx2).
set -euo pipefail
CACHE=${1:-${MINISGL_PEER_CACHE:-$HOME/.cache/minisgl-peer}}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
SRC=$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp
LLAMA_ISA=${LLAMA_ISA:-native}
case $LLAMA_ISA in
    native) BUILD=$CACHE/build-$VERSION; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) BUILD=$CACHE/build-$VERSION-avx2
          ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                     -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "[peer-build] LLAMA_ISA must be native or avx2, not $LLAMA_ISA" >&2; exit 2 ;;
esac
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
log "configuring (Release, ${ISA_FLAGS[*]}) in $BUILD"
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "${ISA_FLAGS[@]}" -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF >&2
log "building llama-server with -j$JOBS (about 10 minutes on 2 cores)"
cmake --build "$BUILD" --target llama-server -j "$JOBS" >&2
[ -x "$BIN" ] || { log "build finished but $BIN is missing"; exit 1; }
echo "$BIN"
