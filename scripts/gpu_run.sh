#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, run the GPU tests, run the benchmarks,
# print a table last. Usage (through the device tool, with carry [".whl"]):
#   bash scripts/gpu_run.sh check|bench|all [extra bench args]
# Results land in $OUT (if set) as gpu_tests.log and bench.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
OUT=${OUT:-/tmp/minisgl-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

if [ "$phase" = check ] || [ "$phase" = all ]; then
    python3 -m pytest -q -x -m gpu tests/kernels tests/golden/test_gpu_parity.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi

bench() {  # name, then bench args
    local name=$1; shift
    echo "== $name: python -m minisgl.bench offline $*"
    timeout 900 python3 -m minisgl.bench offline --quiet "$@" 2>"$OUT/$name.err" | sed "s/^{/{\"run\": \"$name\", /" | tee -a "$OUT/bench.jsonl"
    tail -3 "$OUT/$name.err"
}

if [ "$phase" = bench ] || [ "$phase" = all ]; then
    : > "$OUT/bench.jsonl"
    W="--model configs/qwen3-0.6b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0"
    bench qwen3-0.6b $W
    bench qwen3-0.6b-nograph $W --cuda-graph-max-bs 0
    MINISGL_DISABLE_OVERLAP=1 bench qwen3-0.6b-nooverlap $W
    bench bs1-decode --model configs/qwen3-0.6b --dummy-weights --num-seqs 1 --min-input 128 --max-input 128 --min-output 1024 --max-output 1024
    bench qwen3-8b --model configs/qwen3-8b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0
    [ -n "${WITH_HF:-}" ] && bench hf-peer $W --peer hf --no-minisgl
    python3 - "$OUT/bench.jsonl" <<'PYEOF'
import json, sys
CEILING = 37500.0
print(f"{'run':24} {'out tok':>9} {'s':>8} {'tok/s':>9} {'ceiling':>8}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    frac = r["output_tok_s"] / CEILING if r["run"].startswith("qwen3-0.6b") else float("nan")
    print(f"{r['run']:24} {r['output_tokens']:>9} {r['seconds']:>8.2f} {r['output_tok_s']:>9.1f} {frac:>8.1%}")
PYEOF
fi
