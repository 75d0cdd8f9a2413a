#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, run the GPU tests, the benchmarks and the
# profiles, print a table last. Through the device tool, with carry [".whl"] (plus ".base", ".peer"):
#   bash scripts/gpu_run.sh PHASES        PHASES: comma-separated, or all (= check,profile,bench,bench8b,moe)
# Phases:
#   check    the GPU tests (pytest -m gpu $CHECK_ARGS, default tests/kernels tests/golden; CHECK_LIMIT s)
#   bench    the issue-10 workload on Qwen3-0.6B (256 seqs, prompts 100-1024, outputs 100-1024,
#            seed 0, dummy weights), bs=1 decode (128-token prompt, 1024 out), and ablations of the
#            same workload: --no-overlap-schedule, --no-fused-kernels (UNFUSED=0 skips it), no CUDA graphs
#   main     the headline run alone
#   fp8kv    the headline workload with --kv-cache-dtype fp8_e4m3 beside bf16 KV, and bs=1 decode with each
#   fp8w     Qwen3-8B's shape with --quantization fp8 / fp8_block (float8 W8A8, per-channel / 128x128-block weights quantized at
#            load) beside bf16, same KV budget, at the workload and at bs=1 decode, plus fp8 weights
#            with fp8 KV; first the FP8 GEMM GPU tests (tests/kernels/test_fp8_weights_gpu.py; FP8W_TESTS=0 skips them)
#   ablate   the other switches, each against the default of the same call: --no-pdl, --no-fold-norms,
#            --no-triton-gemm, --no-decode-tuned, --no-pad-eager, 8k-token prefill steps
#   bench8b  Qwen3-8B, the same workload        moe  Qwen3-30B-A3B, the same workload
#   families issue 22's shapes on the same workload: Gemma-3-1B (5 local : 1 global layers, 512
#            window) and Phi-4-mini (FAMILY_MODELS), each beside the decode memory floor that
#            bench offline prints (KV + weight bytes over the copy bandwidth measured there)
#   moe2     issue 26's shapes on the same workload: GPT-OSS-20B and DeepSeek-V2-Lite (MOE2_MODELS),
#            each beside its floor (the experts a step routes to counted)
#   spec     issue 27: a bs=1 verify step of K=4 n-gram proposals vs a plain decode step (bench spec --verify-cost)
#   hf       Hugging Face transformers' continuous batching as a peer (32 seqs)
#   tp       two GPUs: the TP parity tests, then Qwen3-8B at TP=1 and TP=2
#   peer     the nano-vllm peer bundle (.peer/run_peer.sh, see shared/peers/nano-vllm) on the same
#            workload, PEER_RUNS timed runs (default 2)
#   profile  `python -m minisgl.bench profile` decode (ms per step) and table (top kernels of 32
#            decode steps) at each batch:prompt of PROFILE_SHAPES (default "1:128 256:512")
#   steps    profile steps of the workload (wall per step by kind and batch size)
#   host     profile host (cProfile per step) at HOST_SHAPES (default "256:512 1:128")
#   trace    profile table of the workload's steps WINDOWS (default "0-24 400-412"): device busy
#            share, idle gaps, CUDA runtime calls
#   prefill  profile prefill of PREFILL_SHAPE (default 16:512), no prefix cache
#   tool     one research tool of tools/: TOOL="sweep_gemm.py --quick" (TOOL_LIMIT s, default 300)
# A/B: with BASE=DIR (a checkout of an older commit, carried as an ignored folder, e.g. .base), the
# default-flag runs of bench, main, bench8b and moe run for the base tree and this tree interleaved,
# AB_ROUNDS times (default 2: base, new, base, new), in this one call, and a last table compares
# their medians. The base tree gets default flags only (older trees took env switches).
# BUDGET=S: the whole call's seconds; each later step's limit is cut to what is left, and a step is
# skipped (said so) once under 20 s are left, so a call never outruns the device lease.
# DRY_RUN=1 prints the commands instead (no GPU needed). Results land in $OUT (default
# /tmp/minisgl-out): gpu_tests.log, bench.jsonl, bench.err, profile.txt, peer.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
phases=",${1:-all},"
[ "$phases" = ",all," ] && phases=",check,profile,bench,bench8b,moe,"
has() { [[ "$phases" == *",$1,"* ]]; }
DRY=${DRY_RUN:-0}
OUT=${OUT:-/tmp/minisgl-out}
mkdir -p "$OUT"
: >"$OUT/bench.jsonl"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -n "${BASE:-}" ]; then
    BASE=$(cd "$BASE" && pwd) || { echo "BASE=$BASE is not a directory"; exit 1; }
    [ -f "$BASE/minisgl/bench/offline.py" ] || { echo "BASE=$BASE holds no minisgl tree"; exit 1; }
fi
if [ "$DRY" = 1 ]; then
    echo "(dry run: commands are printed, not run)"
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    [ -n "${BASE:-}" ] && echo "base tree: $BASE ($(git -C "$BASE" log -1 --format='%h %s' 2>/dev/null || echo 'no git'))"
fi

# run SECONDS CMD...: the command under a time limit (printed under DRY_RUN=1)
run() {
    local limit=$1; shift
    if [ "$DRY" = 1 ]; then echo "+ timeout $limit $*"; return 0; fi
    limit=$(left "$limit") || { echo "(skipped, BUDGET=$BUDGET s spent: $*)"; return 0; }
    timeout "$limit" "$@"
}
# left SECONDS: the limit cut to what BUDGET leaves; fails when under 20 s are left
left() {
    [ -z "${BUDGET:-}" ] && { echo "$1"; return 0; }
    local rest=$((BUDGET - SECONDS))
    [ "$rest" -lt 20 ] && return 1
    echo $(($1 < rest ? $1 : rest))
}
# bench_in TREE NAME SECONDS ARGS...: one `bench offline` run of TREE (this tree or $BASE), its JSON
# line tagged with NAME in bench.jsonl
bench_in() {
    local tree=$1 name=$2 limit=$3; shift 3
    echo "== $name: python -m minisgl.bench offline $*${tree:+ (tree $tree)}"
    if [ "$DRY" = 1 ]; then echo "+ (cd ${tree:-.} && timeout $limit python3 -m minisgl.bench offline --quiet $*)"; return 0; fi
    limit=$(left "$limit") || { echo "(skipped, BUDGET=$BUDGET s spent)"; return 0; }
    (cd "${tree:-.}" && PYTHONPATH="${tree:-$PWD}:/tmp/site" timeout "$limit" python3 -m minisgl.bench offline --quiet "$@") \
        2>/tmp/bench.err | sed "s/^{/{\"run\": \"$name\", /" | tee -a "$OUT/bench.jsonl"
    { echo "== $name"; cat /tmp/bench.err; } >>"$OUT/bench.err"  # at most 8 files come back: one log
    grep -E "captured|engine ready|Error|error" /tmp/bench.err | tail -4
}
bench() { bench_in "" "$@"; }  # NAME SECONDS ARGS...: this tree
# ab NAME SECONDS ARGS...: with BASE, base and this tree interleaved AB_ROUNDS times; else this tree once
ab() {
    local name=$1; shift
    if [ -z "${BASE:-}" ]; then bench "$name" "$@"; return; fi
    for i in $(seq "${AB_ROUNDS:-2}"); do
        bench_in "$BASE" "$name@base-$i" "$@"
        bench "$name@new-$i" "$@"
    done
}
profile() {  # TITLE SECONDS ARGS...: `bench profile`, output kept in profile.txt
    local title=$1 limit=$2; shift 2
    echo "== $title: python -m minisgl.bench profile $*" | tee -a "$OUT/profile.txt"
    run "$limit" python3 -m minisgl.bench profile "$@" 2>>"$OUT/profile.err" | tee -a "$OUT/profile.txt"
}
W="--model configs/qwen3-0.6b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0"
B1="--model configs/qwen3-0.6b --dummy-weights --num-seqs 1 --min-input 128 --max-input 128 --min-output 1024 --max-output 1024"
Q06="--model configs/qwen3-0.6b --dummy-weights"

if has check; then
    if [ "$DRY" = 1 ]; then echo "+ pytest -m gpu ${CHECK_ARGS:-tests/kernels tests/golden}"; else
        timeout "$(left "${CHECK_LIMIT:-600}" || echo 1)" python3 -m pytest -q -rf --tb=short -m gpu ${CHECK_ARGS:-tests/kernels tests/golden} \
            -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    fi
fi
if has profile; then
    for shape in ${PROFILE_SHAPES:-1:128 256:512}; do  # batch size:prompt length
        bs=${shape%:*} len=${shape#*:}
        S="$Q06 --num-seqs $bs --min-input $len --max-input $len"
        profile "decode bs=$bs prompt=$len" 200 decode $S
        profile "kernels bs=$bs prompt=$len, 32 decode steps" 200 table $S --min-output 32 --max-output 32 --rows 30 | tail -40
    done
fi
has steps && profile "steps of the workload" 200 steps $W
if has host; then  # host time per step vs wall time per step
    for shape in ${HOST_SHAPES:-256:512 1:128}; do
        profile "host bs=${shape%:*} prompt=${shape#*:}" 200 host $Q06 --num-seqs "${shape%:*}" \
            --min-input "${shape#*:}" --max-input "${shape#*:}" --min-output 136 --max-output 136 --rows 20
    done
fi
if has trace; then
    for window in ${WINDOWS:-0-24 400-412}; do
        profile "trace of steps $window" 250 table $W --window "$window" --rows 14 | tail -60
    done
fi
if has prefill; then
    shape=${PREFILL_SHAPE:-16:512}
    profile "prefill ${shape%:*} x ${shape#*:}" 150 prefill $Q06 --cache naive --num-seqs "${shape%:*}" \
        --min-input "${shape#*:}" --max-input "${shape#*:}"
fi
# prefill2: issue 28's long prefill, tools/sweep_extend.py: the extend kernel's long-sequence launches on
# 32k / 16k+16k / 8k one-request chunks, then the whole 0.6B model's 8k and 32k prefill at 8k/16k/32k
# chunks with the two best; PREFILL2_LIMIT s (default 150, the tool's --budget), output in prefill2.txt
if has prefill2; then
    p2=$(left "${PREFILL2_LIMIT:-150}") || p2=0
    if [ "$DRY" = 1 ]; then echo "+ timeout ${PREFILL2_LIMIT:-150} python3 tools/sweep_extend.py --budget ${PREFILL2_LIMIT:-150}"
    elif [ "$p2" -gt 0 ]; then
        timeout "$p2" python3 tools/sweep_extend.py --budget "$p2" 2>&1 | tee "$OUT/prefill2.txt" | tail -150
    else echo "(skipped, BUDGET=$BUDGET s spent: prefill2)"; fi
fi
if has tool; then
    [ -n "${TOOL:-}" ] || { echo "the tool phase needs TOOL=\"name.py [args]\""; exit 1; }
    # shellcheck disable=SC2086
    run "${TOOL_LIMIT:-300}" python3 tools/$TOOL 2>&1 | tee "$OUT/tool.txt" | tail -80
fi
if has bench; then
    ab qwen3-0.6b 110 $W
    ab bs1-decode 45 $B1
    [ "${UNFUSED:-1}" = 1 ] && bench qwen3-0.6b-unfused 110 $W --no-fused-kernels  # UNFUSED=0 skips it
    bench qwen3-0.6b-nooverlap 75 $W --no-overlap-schedule
    bench qwen3-0.6b-nograph 90 $W --cuda-graph-max-bs 0
fi
has main && ab qwen3-0.6b 110 $W  # the headline run alone
if has fp8kv; then  # issue 25: the same workload with float8 KV pages, beside the bf16 run of this call
    bench qwen3-0.6b-bf16kv 110 $W
    bench qwen3-0.6b-fp8kv 110 $W --kv-cache-dtype fp8_e4m3
    bench bs1-bf16kv 45 $B1
    bench bs1-fp8kv 45 $B1 --kv-cache-dtype fp8_e4m3
fi
if has fp8w; then  # issue 25: FP8 weights on the 8B shape, beside bf16 weights in this call, one KV budget
    if [ "${FP8W_TESTS:-1}" = 0 ]; then echo "(FP8W_TESTS=0: the FP8 GEMM GPU tests skipped)"
    elif [ "$DRY" = 1 ]; then echo "+ pytest -m gpu tests/kernels/test_fp8_weights_gpu.py"; else
        timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/kernels/test_fp8_weights_gpu.py -p no:cacheprovider \
            2>&1 | tee "$OUT/fp8w_tests.log" | tail -6
    fi
    W8="--model configs/qwen3-8b --dummy-weights --kv-cache-gb 60 --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0"
    B8="--model configs/qwen3-8b --dummy-weights --kv-cache-gb 60 --num-seqs 1 --min-input 128 --max-input 128 --min-output 1024 --max-output 1024"
    bench qwen3-8b-bf16w 130 $W8
    bench qwen3-8b-fp8block-fp8kv 130 $W8 --quantization fp8_block --kv-cache-dtype fp8_e4m3
    bench bs1-8b-bf16w 60 $B8
    bench bs1-8b-fp8block 60 $B8 --quantization fp8_block
    bench bs1-8b-fp8w 60 $B8 --quantization fp8
    bench qwen3-8b-fp8w 130 $W8 --quantization fp8
    bench qwen3-8b-fp8w-fp8kv 130 $W8 --quantization fp8 --kv-cache-dtype fp8_e4m3
fi
if has ablate; then  # switches under study, each against the headline run of the same call
    bench qwen3-0.6b-default 110 $W
    for flag in --no-pdl --no-fold-norms --no-triton-gemm --no-decode-tuned --no-pad-eager; do
        bench "qwen3-0.6b-${flag#--}" 110 $W "$flag"
    done
    bench bs1-no-triton-gemm 45 $B1 --no-triton-gemm
    bench bs1-no-decode-tuned 45 $B1 --no-decode-tuned
    bench qwen3-0.6b-prefill8k 110 $W --max-prefill-tokens 8192
fi
has bench8b && ab qwen3-8b 130 --model configs/qwen3-8b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0
has moe && ab qwen3-30b-a3b 200 --model configs/qwen3-30b-a3b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0
if has families; then  # issue 22: the workload on Gemma-3-1B's and Phi-4-mini's shapes; each run
    # prints its decode memory floor (bench offline's floor_* and fraction_of_floor fields)
    for model in ${FAMILY_MODELS:-gemma-3-1b-it phi-4-mini-instruct}; do
        bench "$model" 150 --model "configs/$model" --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 \
            --min-output 100 --max-output 1024 --seed 0
    done
fi
if has moe2; then  # issue 26: GPT-OSS-20B's and DeepSeek-V2-Lite's shapes, each beside its floor (experts included)
    for model in ${MOE2_MODELS:-gpt-oss-20b deepseek-v2-lite}; do
        bench "$model" 200 --model "configs/$model" --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 \
            --min-output 100 --max-output 1024 --seed 0
    done
fi
if has spec; then  # issue 27: one bs=1 step verifying K=4 proposals (decode graphs) against a plain decode step
    echo "== spec verify cost: python -m minisgl.bench spec --verify-cost $Q06 --speculative-algorithm ngram --num-speculative-tokens 4"
    run 120 python3 -m minisgl.bench spec --verify-cost $Q06 --speculative-algorithm ngram --num-speculative-tokens 4 \
        2>>"$OUT/bench.err" | tee "$OUT/spec.jsonl"
fi
has hf && bench hf-peer-32seq 200 --model configs/qwen3-0.6b --dummy-weights --num-seqs 32 --seed 0 --peer hf
if has tp; then  # two GPUs: TP=2 == TP=1 (fp32 tiny models, NCCL), then Qwen3-8B TP=1 vs TP=2
    if [ "$DRY" = 1 ]; then echo "+ pytest -m gpu tests/golden/test_tp_parity.py"; else
        timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/golden/test_tp_parity.py -p no:cacheprovider 2>&1 \
            | tee "$OUT/tp_tests.log" | tail -6
    fi
    W8="--model configs/qwen3-8b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0"
    bench qwen3-8b-tp1 130 $W8
    bench qwen3-8b-tp2 150 $W8 --tp 2
fi
if has peer; then  # nano-vllm's own bench.py workload: the same prompts and lengths as $W (seed 0)
    if [ -f .peer/run_peer.sh ]; then
        : >"$OUT/peer.jsonl"
        if [ "$DRY" = 1 ]; then echo "+ bash .peer/run_peer.sh ${PEER_RUNS:-2}"; else
            OUT="$OUT" timeout "${PEER_LIMIT:-400}" bash .peer/run_peer.sh "${PEER_RUNS:-2}" 2>>"$OUT/bench.err" \
                | grep '"engine"' >"$OUT/peer.jsonl"
            cat "$OUT/peer.jsonl"
        fi
    else
        echo "peer: no .peer/run_peer.sh (make it with shared/peers/nano-vllm/make_bundle.sh, carry .peer)"
    fi
fi
[ "$DRY" = 1 ] && exit 0
python3 - "$OUT/bench.jsonl" "$OUT/peer.jsonl" <<'PYEOF'
import json, os, statistics, sys
rows = []
for path in sys.argv[1:]:
    if os.path.exists(path):
        rows += [json.loads(line) for line in open(path) if line.startswith("{")]
if not rows:
    sys.exit(0)
CEILING = 37500.0  # decode re-reads the KV cache: ~3.6 s at 4.2 TB/s for the 0.6B workload
print(f"{'run':34} {'engine':16} {'out tok':>9} {'s':>8} {'tok/s':>9} {'ceiling':>12} {'floor tok/s':>12} {'of floor':>9}")
for r in rows:
    if r.get("engine") == "nano-vllm":  # the peer bundle's own keys
        r = {"run": f"nano-vllm-{r['run']}", "engine": "nano-vllm", "output_tokens": r["out_tokens"],
             "seconds": r["seconds"], "output_tok_s": r["out_tok_s"], "peer": True}
    frac = f"{r['output_tok_s'] / CEILING:.1%}" if r["run"].startswith("qwen3-0.6b") or r.get("peer") else "-"
    if r["run"].startswith("bs1"):  # one sequence: the decode time per token (goal <= 1.1 ms)
        frac = f"{r['seconds'] / r['output_tokens'] * 1e3:.3f} ms/tok"
    floor = f"{r['floor_tok_s']:>12.0f} {r['fraction_of_floor']:>9.1%}" if "floor_tok_s" in r else ""
    print(f"{r['run']:34} {r['engine']:16} {r['output_tokens']:>9} {r['seconds']:>8.2f} {r['output_tok_s']:>9.1f} {frac:>12} {floor}")
pairs = {}
for r in rows:
    name, _, side = str(r["run"]).partition("@")
    if side:
        pairs.setdefault(name, {}).setdefault(side.split("-")[0], []).append(r["output_tok_s"])
if pairs:
    print(f"\nA/B (same call, interleaved): {'benchmark':20} {'base tok/s':>12} {'new tok/s':>12} {'new/base':>9}")
    for name, sides in pairs.items():
        base, new = sides.get("base", []), sides.get("new", [])
        if base and new:
            b, n = statistics.median(base), statistics.median(new)
            runs = f"  base {' / '.join(f'{x:.0f}' for x in base)}; new {' / '.join(f'{x:.0f}' for x in new)}"
            print(f"{'':30}{name:20} {b:>12.1f} {n:>12.1f} {n / b:>9.3f}{runs}")
PYEOF
