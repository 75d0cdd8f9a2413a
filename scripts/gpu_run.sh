#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, run the GPU tests, run the benchmarks,
# print a table last. Usage (through the device tool, with carry [".whl"]):
#   bash scripts/gpu_run.sh PHASES      PHASES: comma-separated diag,host,check,backend,profile,prefill,workload,sweep,main,
#                                       ragged,attnwl,pdl,sampling,samplingcdf,lmhead,gemm,splitk,splitkwide,pages,graphlaunch,gemmab,blasab,tunedab,
#                                       addmm,copies,bs1ab,layout,gaps,timeline,hostprefill,ablate,bench,bench8b,moe,hf,tp
#                                       (tp: two GPUs) or all
# Results land in $OUT (if set) as gpu_tests.log, profile_*.txt and bench.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
phases=",${1:-all},"
[ "$phases" = ",all," ] && phases=",check,profile,bench,bench8b,moe,"
has() { [[ "$phases" == *",$1,"* ]]; }
OUT=${OUT:-/tmp/minisgl-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
has diag && timeout 60 python3 scripts/diag_rotary.py
if has host; then  # host time per step vs wall time per step
    for shape in ${HOST_SHAPES:-256:512 1:128}; do
        timeout 120 python3 scripts/profile_host_steps.py configs/qwen3-0.6b ${shape%:*} ${shape#*:} 2>&1 | grep -v INFO
    done
fi

bench() {  # name, seconds, then bench args
    local name=$1 limit=$2; shift 2
    echo "== $name: python -m minisgl.bench offline $*"
    timeout "$limit" python3 -m minisgl.bench offline --quiet "$@" 2>/tmp/bench.err \
        | sed "s/^{/{\"run\": \"$name\", /" | tee -a "$OUT/bench.jsonl"
    { echo "== $name"; cat /tmp/bench.err; } >>"$OUT/bench.err"  # at most 8 files come back: one log
    grep -E "captured|engine ready|Error|error" /tmp/bench.err | tail -4
}
W="--model configs/qwen3-0.6b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0"

if has check; then
    timeout "${CHECK_LIMIT:-600}" python3 -m pytest -q -rf --tb=short -m gpu ${CHECK_ARGS:-tests/kernels tests/golden} \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
has backend && timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_triton_backend_interpret.py 2>&1 | tail -3
has ragged && timeout 150 python3 scripts/sweep_decode_attention.py --ragged 2>&1 | tee "$OUT/ragged.txt"
has sweep && timeout 300 python3 scripts/sweep_decode_attention.py 2>&1 | tee "$OUT/sweep.txt"
has attnwl && timeout 200 python3 scripts/sweep_decode_attention.py --workload 2>&1 | tee "$OUT/attnwl.txt"
has prefill && timeout 150 python3 scripts/profile_gpu_prefill.py ${PREFILL_SHAPE:-16 512} 2>&1 | grep -v INFO | tee "$OUT/prefill.txt" | head -40
has pdl && timeout 60 python3 scripts/probe_pdl.py 2>&1 | tee "$OUT/pdl.txt"
has sampling && timeout 120 python3 scripts/sweep_sampling.py 2>&1 | tee "$OUT/sampling.txt"
has samplingcdf && timeout 120 python3 scripts/sweep_sampling_cdf.py 2>&1 | tee "$OUT/sampling_cdf.txt"
has lmhead && timeout 150 python3 scripts/sweep_lmhead.py 2>&1 | grep -v skip | tee "$OUT/lmhead.txt"
has splitkwide && timeout 300 python3 scripts/sweep_splitk_wide.py --jobs 14 2>&1 | grep -v "skip\|compile failed" \
    | tee "$OUT/splitk_wide.txt" | tail -30
has pages && timeout 200 python3 scripts/sweep_decode_attention.py --pages 2>&1 | tee "$OUT/pages.txt"
has graphlaunch && timeout 300 python3 scripts/sweep_decode_attention.py --graphs 2>&1 | tee "$OUT/graphs.txt"
has splitk && timeout 300 python3 scripts/sweep_splitk.py --jobs 12 ${SPLITK_ARGS:-} 2>&1 | tee "$OUT/splitk.txt" | tail -60
has copies && timeout 150 python3 scripts/probe_copies.py 2>&1 | grep -v INFO | tee "$OUT/copies.txt" | tail -60
has addmm && timeout 150 python3 scripts/probe_addmm.py 2>&1 | tee "$OUT/addmm.txt"
has gemm && timeout 240 python3 scripts/sweep_gemm.py ${GEMM_ARGS:-} 2>&1 | tee "$OUT/gemm.txt" | tail -40
has gaps && timeout 150 python3 scripts/trace_gaps.py configs/qwen3-0.6b 2>&1 | grep -v INFO | tee "$OUT/gaps.txt"
if has timeline; then  # host vs GPU per step: clean, then with the host's CUDA calls profiled
    timeout 150 python3 scripts/trace_step_timeline.py 2>&1 | grep -v INFO | tee "$OUT/timeline.txt"
    PROFILE=${PROFILE:-2-5} timeout 150 python3 scripts/trace_step_timeline.py 2>&1 | grep -v INFO | tee "$OUT/timeline_prof.txt" | tail -22
fi
has hostprefill && timeout 150 python3 scripts/profile_prefill_host.py 2>&1 | grep -v INFO | tee "$OUT/hostprefill.txt" | head -45
has workload && timeout 120 python3 scripts/profile_workload.py configs/qwen3-0.6b 2>&1 | grep -v INFO | tee "$OUT/workload.txt"
if has profile; then
    for shape in ${PROFILE_SHAPES:-1:128 256:512}; do  # batch size:prompt length
        bs=${shape%:*} len=${shape#*:}
        echo "== profile bs=$bs prompt=$len"
        timeout 150 python3 scripts/profile_gpu_decode.py $bs $len >/tmp/profile.txt 2>/tmp/profile.err
        cat /tmp/profile.txt /tmp/profile.err >>"$OUT/profile.txt"
        head -2 /tmp/profile.txt; tail -3 /tmp/profile.err
    done
fi
: > "$OUT/bench.jsonl"
if has bench; then
    bench qwen3-0.6b 110 $W
    bench bs1-decode 45 --model configs/qwen3-0.6b --dummy-weights --num-seqs 1 --min-input 128 --max-input 128 --min-output 1024 --max-output 1024
    [ "${UNFUSED:-1}" = 1 ] && MINISGL_FUSED_KERNELS=0 bench qwen3-0.6b-unfused 110 $W  # UNFUSED=0 skips it
    MINISGL_DISABLE_OVERLAP=1 bench qwen3-0.6b-nooverlap 75 $W
    bench qwen3-0.6b-nograph 90 $W --cuda-graph-max-bs 0
fi
has main && bench qwen3-0.6b 110 $W  # the headline run alone
if has tunedab; then  # the per-size decode launches (GRAPH_TUNED) against the heuristic, interleaved
    for i in 1 2; do
        bench qwen3-0.6b-tuned-$i 110 $W
        MINISGL_DECODE_TUNED=0 bench qwen3-0.6b-untuned-$i 110 $W
    done
    B1="--model configs/qwen3-0.6b --dummy-weights --num-seqs 1 --min-input 128 --max-input 128 --min-output 1024 --max-output 1024"
    bench bs1-tuned 45 $B1
    MINISGL_DECODE_TUNED=0 bench bs1-untuned 45 $B1
fi
if has gemmab; then  # the split-K Triton GEMM where it pays (default) vs cuBLAS only, and cuBLASLt
    MINISGL_TRITON_GEMM=0 bench qwen3-0.6b-cublas 110 $W
    bench qwen3-0.6b-tgemm 110 $W
    MINISGL_TRITON_GEMM=0 TORCH_BLAS_PREFER_CUBLASLT=1 bench qwen3-0.6b-cublaslt 110 $W
fi
if has bs1ab; then  # bs=1 decode: cuBLAS only vs the split-K Triton GEMM where it pays
    B1="--model configs/qwen3-0.6b --dummy-weights --num-seqs 1 --min-input 128 --max-input 128 --min-output 1024 --max-output 1024"
    MINISGL_TRITON_GEMM=0 bench bs1-cublas 45 $B1
    bench bs1-decode 45 $B1
fi
has layout && timeout 200 python3 scripts/sweep_decode_attention.py --layout 2>&1 | tee "$OUT/layout.txt"
has extendorder && timeout 120 python3 scripts/sweep_decode_attention.py --extend 2>&1 | tee "$OUT/extend.txt"
if has blasab; then  # cuBLAS against cuBLASLt (torch's preferred_blas_library), twice each, interleaved
    for i in 1 2; do
        bench qwen3-0.6b-cublas-$i 110 $W
        TORCH_BLAS_PREFER_CUBLASLT=1 bench qwen3-0.6b-cublaslt-$i 110 $W
    done
fi
if has ablate; then  # switches under study, each against the headline run of the same call
    MINISGL_PDL=0 bench qwen3-0.6b-nopdl 110 $W
    bench qwen3-0.6b-prefill8k 110 $W --max-prefill-tokens 8192
fi
has bench8b && bench qwen3-8b 130 --model configs/qwen3-8b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0
has moe && bench qwen3-30b-a3b 200 --model configs/qwen3-30b-a3b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0
has hf && bench hf-peer-32seq 200 --model configs/qwen3-0.6b --dummy-weights --num-seqs 32 --seed 0 --peer hf
if has tp; then  # two GPUs: TP=2 == TP=1 (fp32 tiny models, NCCL), then Qwen3-8B TP=1 vs TP=2
    timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/golden/test_tp_parity.py -p no:cacheprovider 2>&1 \
        | tee "$OUT/tp_tests.log" | tail -6
    W8="--model configs/qwen3-8b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0"
    bench qwen3-8b-tp1 130 $W8
    bench qwen3-8b-tp2 150 $W8 --tp 2
fi
python3 - "$OUT/bench.jsonl" <<'PYEOF'
import json, os, sys
if not os.path.exists(sys.argv[1]):
    sys.exit(0)
CEILING = 37500.0  # decode re-reads the KV cache: ~3.6 s at 4.2 TB/s for the 0.6B workload
print(f"{'run':24} {'engine':16} {'out tok':>9} {'s':>8} {'tok/s':>9} {'ceiling':>8}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    frac = f"{r['output_tok_s'] / CEILING:.1%}" if r["run"].startswith("qwen3-0.6b") else "-"
    print(f"{r['run']:24} {r['engine']:16} {r['output_tokens']:>9} {r['seconds']:>8.2f} {r['output_tok_s']:>9.1f} {frac:>8}")
PYEOF
