#!/usr/bin/env bash
# CPU serving benchmark: minisgl (the default: the shipped Q4_1 GGUF's blocks kept quantized,
# `--weights gguf`; minisgl-f32: dequantized to fp32, `--weights float32`; minisgl-bf16: to bf16,
# where the CPU has native bf16) against llama.cpp's llama-server (an F32 GGUF dequantized from
# the shipped Q4_1 SmolLM2, and the Q4_1 file itself), every server driven by the same client
# (`python -m minisgl.bench serve`) with the same text prompts. Prints a markdown table (and each
# server's memory after each workload) and appends it to BENCHMARKS.md under a dated heading.
#   bash scripts/cpu_bench.sh
#   CPU_ISA=avx2 bash scripts/cpu_bench.sh     # what an AVX2-only CPU runs, on an AVX-512 one:
#       minisgl on its avx2 path (torch's own kernels capped at AVX2 too) beside a llama.cpp built
#       without AVX-512 (LLAMA_ISA=avx2); rows labelled minisgl@avx2, llama-f32@avx2, ...
# Env: RUNS (3), WORKLOADS ("W1 W2 W3"), SERVERS ("minisgl minisgl-f32 minisgl-bf16 llama-f32
#      llama-q4_1"; minisgl-bf16 is skipped on a CPU without native bf16), THREADS (2),
#      CPU_ISA (minisgl's --cpu-isa: auto, avx512, avx2 or portable; rows labelled minisgl@avx2 ...;
#      with avx2, torch's ATen/MKL/oneDNN kernels are capped at AVX2 as well, through their own env
#      switches), LLAMA_ISA (native: llama.cpp built with GGML_NATIVE; avx2: AVX/AVX2/FMA/F16C/BMI2
#      only, rows labelled llama-f32@avx2 ...; default avx2 when CPU_ISA=avx2, else native),
#      LLAMA_NO_REPACK=1 (llama-server --no-repack: no AMX/repacked weight buffers; set by the script
#      itself when a native build dies of SIGILL at start-up, as it does where AMX tiles fault),
#      RUNS_F32 (runs of the f32 rows, minisgl-f32 and llama-f32; default RUNS),
#      KV_PAGES (minisgl's KV pool in 16-token pages; default: llama-server's -c, for equal capacity),
#      MINISGL_ARGS / LLAMA_ARGS (extra server flags), REQUEST_TIMEOUT (s, 1800),
#      MINISGL_PEER_CACHE (~/.cache/minisgl-peer), BENCH_NOTE (a line for the heading),
#      NO_APPEND=1 (stdout only), BENCH_OUT (keep raw results and logs in this dir; rows already
#      there from an earlier invocation are reported too, marked as such), REPORT_ONLY=1 (no runs:
#      just the report of what BENCH_OUT holds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${MINISGL_PEER_CACHE:-$HOME/.cache/minisgl-peer}
RUNS=${RUNS:-3}
WORKLOADS=${WORKLOADS:-"W1 W2 W3"}
SERVERS=${SERVERS:-"minisgl minisgl-f32 minisgl-bf16 llama-f32 llama-q4_1"}
THREADS=${THREADS:-2}
CPU_ISA=${CPU_ISA:-}
LLAMA_ISA=${LLAMA_ISA:-$([ "$CPU_ISA" = avx2 ] && echo avx2 || echo native)}
RUNS_F32=${RUNS_F32:-$RUNS}
LLAMA_NO_REPACK=${LLAMA_NO_REPACK:-}  # 1: llama-server --no-repack (set by itself after a SIGILL in AMX code)
# What an AVX2-only CPU runs: torch's own kernels (ATen's vectorized ops, MKL's GEMMs, oneDNN)
# pick AVX-512 where the CPU has it, so cap them too (their own switches, read by those libraries).
TORCH_ISA_ENV=()
[ "$CPU_ISA" = avx2 ] && TORCH_ISA_ENV=(ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2)
REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-1800}
SLOTS=32
CTX=$((SLOTS * (512 + 128 + 64)))  # 32 slots x (longest W2 prompt + output + margin)
KV_PAGES=${KV_PAGES:-$((CTX / 16))}
# BENCH_OUT=DIR keeps the raw JSON lines and server logs there (partial results survive an abort).
WORK=${BENCH_OUT:-$(mktemp -d -t minisgl-bench.XXXXXX)}
mkdir -p "$WORK"
RESULTS=$WORK/results.jsonl
MEMORY=$WORK/memory.tsv  # server, workload, RSS / PSS / peak RSS (MiB) summed over its processes
SERVER_PID=""

log() { echo "[cpu-bench] $*" >&2; }

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo '?')
CMDLINE="RUNS=$RUNS${RUNS_F32:+ RUNS_F32=$RUNS_F32} WORKLOADS=\"$WORKLOADS\" SERVERS=\"$SERVERS\"${CPU_ISA:+ CPU_ISA=$CPU_ISA} LLAMA_ISA=$LLAMA_ISA bash scripts/cpu_bench.sh"
EARLIER_ROWS=0
[ -f "$RESULTS" ] && EARLIER_ROWS=$(grep -c '^{' "$RESULTS" || true)
if [ "${REPORT_ONLY:-0}" = 1 ]; then
    if [ -z "${BENCH_OUT:-}" ] || [ ! -f "$RESULTS" ]; then
        log "REPORT_ONLY needs BENCH_OUT with a results.jsonl"; exit 2
    fi
    SERVERS=""
    CMDLINE="REPORT_ONLY=1 BENCH_OUT=$BENCH_OUT bash scripts/cpu_bench.sh"
fi

stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    fi
    # The server was started in its own session: take down whatever of its group is left.
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap 'stop_server; [ -n "${BENCH_OUT:-}" ] || rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# start_server NAME PORT: launches the server in a new session (so its children can be reaped).
start_server() {
    local name=$1 port=$2 logfile=$WORK/$1.log
    case $name in
        minisgl|minisgl-f32|minisgl-bf16)
            local weights=auto
            [ "$name" = minisgl-f32 ] && weights=float32
            [ "$name" = minisgl-bf16 ] && weights=bfloat16
            # shellcheck disable=SC2086
            setsid env ${TORCH_ISA_ENV[@]+"${TORCH_ISA_ENV[@]}"} "$PY" -m minisgl --device cpu --weights $weights ${CPU_ISA:+--cpu-isa $CPU_ISA} \
                --num-pages "$KV_PAGES" --host 127.0.0.1 --port "$port" ${MINISGL_ARGS:-} >"$logfile" 2>&1 & ;;
        llama-f32|llama-q4_1)
            local model=$F32_GGUF
            [ "$name" = llama-q4_1 ] && model=$Q41_GGUF
            # shellcheck disable=SC2086
            setsid "$LLAMA_SERVER" -m "$model" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -cb -c "$CTX" \
                --host 127.0.0.1 --port "$port" ${LLAMA_NO_REPACK:+--no-repack} ${LLAMA_ARGS:-} >"$logfile" 2>&1 & ;;
        *) log "unknown server $name"; exit 2 ;;
    esac
    SERVER_PID=$!
    for _ in $(seq 600); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            local rc=0
            wait "$SERVER_PID" 2>/dev/null || rc=$?
            SERVER_PID=""
            # A native llama.cpp build on a CPU whose cpuid lists AMX but where the tiles fault
            # (some VMs): SIGILL in its AMX matmul. --no-repack leaves out the AMX (and repacked)
            # weight buffers, so it runs its plain AVX-512 kernels; the report says so.
            if [ "$rc" = 132 ] && [ "${name#llama-}" != "$name" ] && [ -z "${LLAMA_NO_REPACK:-}" ]; then
                log "$name: illegal instruction at start-up (AMX tiles unusable here?): retrying with --no-repack"
                LLAMA_NO_REPACK=1
                start_server "$name" "$port"
                return
            fi
            log "$name exited during start-up (status $rc); its log:"; tail -20 "$logfile" >&2; exit 1
        fi
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
        sleep 1
    done
    log "$name not healthy after 600 s"; tail -20 "$logfile" >&2; exit 1
}

# --- the peer and its models ---------------------------------------------------------------------
needs_llama=0
case " $SERVERS " in *" llama-"*) needs_llama=1 ;; esac
Q41_GGUF=$("$PY" -c "from minisgl.models.source import default_gguf_path; print(default_gguf_path())")
F32_GGUF=$CACHE/models/$(basename "$Q41_GGUF" .Q4_1.gguf).F32.gguf
LLAMA_SERVER=""
LLAMA_VERSION="not run"
LLAMA_BUILD="not run"
if [ "$needs_llama" = 1 ]; then
    LLAMA_SERVER=$(LLAMA_ISA=$LLAMA_ISA bash scripts/peer/build_llama_server.sh "$CACHE" | tail -1)
    LLAMA_VERSION=$("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i version || echo unknown)
    # The build's ISA switches as its CMake cache records them, and a check of the binary itself.
    cache_file=$(dirname "$(dirname "$LLAMA_SERVER")")/CMakeCache.txt
    LLAMA_BUILD=$(grep -E '^GGML_(NATIVE|AVX|AVX2|FMA|F16C|BMI2|AVX_VNNI|AVX512[A-Z0-9_]*|AMX_[A-Z0-9]*):BOOL=ON' \
        "$cache_file" 2>/dev/null | sed 's/:BOOL=ON//; s/^GGML_//' | tr '\n' ' ' | sed 's/ $//' || true)
    zmm=$(objdump -d --no-show-raw-insn "$LLAMA_SERVER" 2>/dev/null | grep -c '%zmm' || true)
    if [ "$LLAMA_ISA" = native ]; then LLAMA_BUILD="GGML_NATIVE (-march=native on the build machine)"
    else LLAMA_BUILD="GGML_NATIVE off, ${LLAMA_BUILD:-?} on, every other GGML ISA switch off"; fi
    LLAMA_BUILD="$LLAMA_BUILD; instructions on zmm registers (AVX-512) in the binary: ${zmm:-?}"
    if [ "$LLAMA_ISA" = avx2 ] && [ "${zmm:-0}" != 0 ]; then log "warning: the avx2 llama-server has $zmm AVX-512 instructions"; fi
    log "llama-server ($LLAMA_ISA): $LLAMA_BUILD"
    if [ ! -f "$F32_GGUF" ]; then
        mkdir -p "$(dirname "$F32_GGUF")"
        "$PY" -m minisgl.bench dequant-gguf "$Q41_GGUF" "$F32_GGUF"
    fi
else
    cached=$(ls "$CACHE"/build-*/bin/llama-server 2>/dev/null | head -1 || true)
    if [ -n "$cached" ]; then LLAMA_VERSION=$("$cached" --version 2>&1 | grep -m1 -i version || echo unknown); fi
fi

# memory_of NAME WORKLOAD: the server's processes (its session) summed: RSS, PSS (shared pages
# split between the processes that map them) and the sum of each process's peak RSS, in MiB.
memory_of() {
    local rss=0 pss=0 hwm=0 pid kb
    for pid in $(ps -o pid= -s "$SERVER_PID" 2>/dev/null); do
        kb=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0); rss=$((rss + ${kb:-0}))
        kb=$(awk '/^VmHWM:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0); hwm=$((hwm + ${kb:-0}))
        kb=$(awk '/^Pss:/ {print $2}' "/proc/$pid/smaps_rollup" 2>/dev/null || echo 0); pss=$((pss + ${kb:-0}))
    done
    printf '%s\t%s\t%d\t%d\t%d\n' "$1" "$2" $((rss / 1024)) $((pss / 1024)) $((hwm / 1024)) >>"$MEMORY"
}

# --- runs ------------------------------------------------------------------------------------------
if "$PY" -c "import sys; from minisgl.platform.cpu import cpu_has_native_bf16; sys.exit(not cpu_has_native_bf16())"; then
    :
else
    case " $SERVERS " in *" minisgl-bf16 "*) log "no native bf16 on this CPU: skipping minisgl-bf16" ;; esac
    SERVERS=$(echo " $SERVERS " | sed 's/ minisgl-bf16 / /' | xargs)
fi
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for server in $SERVERS; do
    port=$(free_port)
    label=$server
    case $server in
        minisgl*) [ -n "$CPU_ISA" ] && label="$server@$CPU_ISA" ;;
        llama-*) [ "$LLAMA_ISA" != native ] && label="$server@$LLAMA_ISA" ;;
    esac
    runs=$RUNS
    case $server in *-f32) runs=$RUNS_F32 ;; esac
    log "starting $label on port $port"
    start_server "$server" "$port"
    for workload in $WORKLOADS; do
        log "$label $workload: $runs runs"
        # Exit status 1 means some requests failed; the JSON still says which, so keep going.
        "$PY" -m minisgl.bench serve --url "http://127.0.0.1:$port" --preset "$workload" --runs "$runs" \
            --tokenizer local --timeout "$REQUEST_TIMEOUT" --label "$label" --json >>"$RESULTS" \
            || log "$label $workload: some requests failed (see the table)"
        memory_of "$label" "$workload"
    done
    stop_server
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# --- report ----------------------------------------------------------------------------------------
cpu=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
ncpu=$(nproc)
flags=$(lscpu | grep -o -w -E 'avx512f|avx512_bf16|avx512_vnni|amx_tile|avx2' | sort -u | tr '\n' ' ')
mem=$(free -g | awk '/^Mem:/ {print $2 " GiB"}')
report=$WORK/report.md
{
    echo "## CPU serving benchmark, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "- command: \`$CMDLINE\`" \
         "(minisgl $COMMIT)"
    if [ "$EARLIER_ROWS" != 0 ]; then
        echo "- $EARLIER_ROWS of the rows below were measured by earlier invocations into the same" \
             "BENCH_OUT (the runs column shows how many runs each row had)"
    fi
    echo "- hardware: $cpu, $ncpu CPUs, $mem RAM; $flags; load average before/after: $load_before / $load_after"
    echo "- minisgl: \`${TORCH_ISA_ENV[*]+${TORCH_ISA_ENV[*]} }python -m minisgl --device cpu --weights auto ${CPU_ISA:+--cpu-isa $CPU_ISA }--num-pages $KV_PAGES ${MINISGL_ARGS:-}\`" \
         "(auto = gguf: the shipped file's Q4_1/Q8_0 blocks kept, fp32 activations, quantized CPU kernels" \
         "on the ${CPU_ISA:-best} path); minisgl-f32: the same with \`--weights float32\` (every tensor dequantized);" \
         "minisgl-bf16: \`--weights bfloat16\` (CPUs with native bf16 only); KV pool: $KV_PAGES pages of 16 tokens" \
         "(fp16 pages for the quantized default, fp32 for f32, bf16 for bf16), the capacity of llama-server's -c $CTX"
    echo "- peer: llama.cpp llama-server ($LLAMA_VERSION, built from the llama-cpp-python sdist's vendored tree," \
         "Release, LLAMA_ISA=$LLAMA_ISA: $LLAMA_BUILD) \`-t $THREADS -tb $THREADS -np $SLOTS -cb -c $CTX" \
         "${LLAMA_NO_REPACK:+--no-repack }${LLAMA_ARGS:-}\`${LLAMA_NO_REPACK:+ (--no-repack added: the first start died of SIGILL in its AMX kernels, unusable on this CPU)};" \
         "llama-f32: every tensor of the shipped Q4_1 GGUF dequantized to F32 (the weights minisgl runs);" \
         "llama-q4_1: the shipped file; KV cache at llama.cpp's default (f16)"
    echo "- client: \`python -m minisgl.bench serve --preset W --runs $RUNS --tokenizer local\`: streaming" \
         "/v1/completions, greedy, ignore_eos, identical text prompts (calibrated with the SmolLM2 tokenizer)," \
         "run k uses seed k; the row is the median run by output tok/s; latencies in ms"
    echo "- W1: 1 request, 128-token prompt, 128 out; W2: 32 concurrent, prompts 64-512 tokens, 128 out;" \
         "W3: 32 concurrent, shared 400-token prefix + 16-32-token questions, 64 out"
    if [ -n "${BENCH_NOTE:-}" ]; then echo "- note: $BENCH_NOTE"; fi
    echo
    "$PY" -m minisgl.bench table "$RESULTS"
    echo
    if [ -s "$MEMORY" ]; then
        echo "Server memory after each workload, summed over the server's processes (MiB; PSS splits shared pages):"
        echo
        echo "| server | workload | RSS | PSS | peak RSS |"
        echo "|---|---|---|---|---|"
        awk -F'\t' '{printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5}' "$MEMORY"
        echo
    fi
} >"$report"
cat "$report"
if [ "${NO_APPEND:-0}" != 1 ]; then
    [ -f BENCHMARKS.md ] || printf '# Benchmarks\n\n' >BENCHMARKS.md
    cat "$report" >>BENCHMARKS.md
    log "appended to BENCHMARKS.md"
fi
