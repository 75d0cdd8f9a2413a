#!/usr/bin/env bash
# Set up (with test dependencies) and run the whole CPU test suite: unit, kernels under the
# Triton interpreter, golden parity with Hugging Face, end-to-end server tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The four C++ CPU libraries (tests/cpu_build.py; minisgl/kernels/cpp_ext.py, cpu_quant.py) are built
# on first use, which in the suite is serial and on its critical path (~125 s on 2 idle cores, one
# after another; ~100 s all four at once). Start them now, in the background and in parallel, so
# they build while the setup installs and pytest collects; a test that needs one meanwhile waits
# for it (torch's build lock in the build folder). Best effort: a failed build here is built (and
# reported) again by the test that needs it. Early only where torch already imports, so nothing is
# compiled against a torch that the setup is installing; else right after the setup.
prebuild() {
    local log="${TMPDIR:-/tmp}/minisgl-prebuild-$$.log"
    for lib in "cpp_ext False" "cpp_ext True" "cpu_quant False" "cpu_quant True"; do
        set -- $lib
        "$PY" -c "from minisgl.kernels import $1; $1.load_library(portable_only=$2)" >>"$log" 2>&1 &
    done
}
prebuilt=""
if "$PY" -c "import torch, ninja" 2>/dev/null; then prebuild; prebuilt=1; fi
bash scripts/setup.sh --test
[ -n "$prebuilt" ] || prebuild
"$PY" -c "import openai, anthropic, pytest, schemathesis, openapi_spec_validator, selenium, matplotlib, PIL, peft, compressed_tensors" || { echo "[test] test dependencies missing"; exit 1; }
command -v chromium >/dev/null && command -v chromedriver >/dev/null || { echo "[test] chromium/chromedriver missing (chat page test)"; exit 1; }
exec "$PY" -m pytest -q "$@"
