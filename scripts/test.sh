#!/usr/bin/env bash
# Set up (with test dependencies) and run the whole CPU test suite: unit, kernels under the
# Triton interpreter, golden parity with Hugging Face, end-to-end server tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh --test
"$PY" -c "import openai, anthropic, pytest, schemathesis, openapi_spec_validator, selenium, matplotlib, PIL, peft, compressed_tensors" || { echo "[test] test dependencies missing"; exit 1; }
command -v chromium >/dev/null && command -v chromedriver >/dev/null || { echo "[test] chromium/chromedriver missing (chat page test)"; exit 1; }
exec "$PY" -m pytest -q "$@"
