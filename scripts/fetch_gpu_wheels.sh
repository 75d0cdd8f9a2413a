#!/usr/bin/env bash
# Download (here, with network) the wheels the GPU machine lacks into .whl/ (git-ignored), for
# Python 3.12 manylinux x86_64. scripts/gpu_run.sh installs them there with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PKGS=(pyzmq fastapi starlette pydantic pydantic-core typing-inspection annotated-types uvicorn h11
      openai httpx2 httpcore2 truststore jiter distro sniffio anyio gguf prometheus_client
      opentelemetry-api importlib-metadata zipp click msgpack annotated-doc typing-extensions
      # The GPU parity tests' reference: this machine's transformers, not the image's older one
      # (5.17 there hard-codes GPT-OSS's SwiGLU clamp and mis-feeds Phi-3's LongRoPE recompute).
      "transformers==$(python3 -c 'import transformers; print(transformers.__version__)')"
      # ... with the huggingface_hub it asks for (5.25 needs >= 2.4; the image has 1.33). Not its
      # hf-xet (3.5 MB, only for downloads from the hub, which the device cannot reach): the
      # device call carries at most 64 MiB, the peer bundle included.
      "huggingface_hub==$(python3 -c 'import huggingface_hub; print(huggingface_hub.__version__)')")
for pkg in "${PKGS[@]}"; do
    name=${pkg%%==*} version=""
    [[ "$pkg" == *==* ]] && version=${pkg#*==}
    if ls .whl | grep -qi "^${name//-/_}-${version}"; then continue; fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_27_x86_64 --platform any -d .whl "$pkg" >/dev/null 2>&1 \
        || { echo "could not fetch $pkg" >&2; exit 1; }
done
du -sh .whl
