#!/usr/bin/env bash
# Download (here, with network) the wheels the GPU machine lacks into .whl/ (git-ignored), for
# Python 3.12 manylinux x86_64. scripts/gpu_run.sh installs them there with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PKGS=(pyzmq fastapi starlette pydantic pydantic-core typing-inspection annotated-types uvicorn h11
      openai httpx2 httpcore2 truststore jiter distro sniffio anyio gguf prometheus_client
      opentelemetry-api importlib-metadata zipp click msgpack annotated-doc typing-extensions)
for pkg in "${PKGS[@]}"; do
    if ls .whl | grep -qi "^${pkg//-/_}-"; then continue; fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_27_x86_64 --platform any -d .whl "$pkg" >/dev/null 2>&1 \
        || { echo "could not fetch $pkg" >&2; exit 1; }
done
du -sh .whl
