#!/usr/bin/env bash
# deltafin vs llama.cpp (mmap) decode speed under the SAME memory cap (issue #5).
#
# Both engines run in one memory cgroup whose limit is CAP_GB: the page cache of the files
# they read is charged to it, so what does not fit really comes from the disk again. The
# runs alternate A B B A …, the page cache is dropped before each one (when permitted), and
# each run's peak cgroup usage is printed with the load average.
#
#   sudo tools/bench/run_memcap.sh                # defaults below
#   CAP_GB=1.3 BUDGET_GB=1.2 TOKENS=16 REPS=2 THREADS=2 tools/bench/run_memcap.sh
#
# Env: MINI (/work/mini-k3, read only: runs use a symlink view in /tmp), GGUF
# (/work/mini-k3.bf16.gguf), PY (/work/oracle/venv/bin/python, llama-cpp-python 0.3.36),
# BIN (target/release/deltafin), CAP_GB (1.3), BUDGET_GB (deltafin --memory-budget-gb, 1.2),
# SPINE (int8), TOKENS (16 decode tokens), REPS (2 per engine, even), THREADS (2),
# LLAMA_REPACK (1; 0 = llama.cpp keeps every weight in the mmap instead of repacking the MXFP4
# experts into anonymous memory — with repacking, llama.cpp's anonymous memory alone is 1.38 GB
# on the 2.35 GB `mini` and a 1.2 GB cap kills it).
# cgroup v1 memory controller where mounted (root); else `systemd-run --scope -p MemoryMax=`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MINI=${MINI:-/work/mini-k3}
GGUF=${GGUF:-/work/mini-k3.bf16.gguf}
PY=${PY:-/work/oracle/venv/bin/python}
BIN=${BIN:-$ROOT/target/release/deltafin}
CAP_GB=${CAP_GB:-1.3}
BUDGET_GB=${BUDGET_GB:-1.2}
SPINE=${SPINE:-int8}
TOKENS=${TOKENS:-16}
REPS=${REPS:-2}
THREADS=${THREADS:-2}
PROMPT=${PROMPT:-"The history of the printing press begins"}
[ -x "$BIN" ] || { echo "no release binary at $BIN: cargo build --release -p deltafin-cli" >&2; exit 2; }
[ -f "$MINI/config.json" ] || { echo "no model at $MINI" >&2; exit 2; }
[ -f "$GGUF" ] || { echo "no GGUF at $GGUF" >&2; exit 2; }
CAP_BYTES=$(awk -v g="$CAP_GB" 'BEGIN { printf "%d", g * 1e9 }')
WORK=$(mktemp -d /tmp/deltafin-memcap.XXXXXX)
trap 'rm -rf "$WORK"; [ -n "${CG:-}" ] && rmdir "$CG" 2>/dev/null || true' EXIT

# A view of the model root: the model stays read-only (the expert heat file is off anyway).
VIEW=$WORK/model
mkdir -p "$VIEW"
for f in "$MINI"/*; do
    [ "$(basename "$f")" = k3-meta ] || ln -s "$f" "$VIEW/"
done

# The cgroup.
CG=
V1=/sys/fs/cgroup/memory
if [ -w "$V1" ] || [ -d "$V1" ]; then
    PARENT=$(awk -F: '$2 == "memory" { print $3 }' /proc/self/cgroup)
    CG=$V1$PARENT/deltafin-memcap-$$
    mkdir "$CG"
    echo "$CAP_BYTES" > "$CG/memory.limit_in_bytes"
    capped() { sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$CG" "$@"; }
    peak() { cat "$CG/memory.max_usage_in_bytes"; echo 0 > "$CG/memory.max_usage_in_bytes"; }
    echo "cgroup v1: $CG limit $CAP_BYTES B"
else
    capped() { systemd-run --quiet --scope -p "MemoryMax=$CAP_BYTES" -p MemorySwapMax=0 "$@"; }
    peak() { echo "n/a"; }
    echo "cgroup v2 via systemd-run --scope -p MemoryMax=$CAP_BYTES"
fi
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "note: page cache not dropped" >&2; }

cat > "$WORK/llama.py" <<'EOF'
import os, sys, time
import numpy as np
import llama_cpp.llama_cpp as lc
from llama_cpp import Llama
gguf, prompt, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if os.environ.get("LLAMA_REPACK", "1") == "0":
    # llama.cpp repacks MXFP4 (and other) weights into anonymous CPU buffers for its AVX-512
    # kernels: those bytes are no longer mmap'd. LLAMA_REPACK=0 keeps every weight in the mmap.
    default_params = lc.llama_model_default_params
    def no_repack():
        p = default_params()
        p.use_extra_bufts = False
        return p
    lc.llama_model_default_params = no_repack
llm = Llama(model_path=gguf, n_ctx=512, n_batch=512, logits_all=True, use_mmap=True,
            n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
ids = llm.tokenize(prompt.encode(), add_bos=False, special=False)
llm.eval(ids)
times = []
for i in range(n):
    tok = int(np.argmax(np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)))
    t = time.perf_counter()
    llm.eval([tok])
    times.append(time.perf_counter() - t)
d = times[1:]
print(f"TOKS {len(d) / sum(d):.4f}")
EOF

run_deltafin() {
    local ev=$WORK/events.jsonl
    rm -f "$ev"
    capped env K3_EXPERT_HEAT=off RAYON_NUM_THREADS="$THREADS" "$BIN" run --model-root "$VIEW" \
        --spine "$SPINE" --memory-budget-gb "$BUDGET_GB" --prompt "$PROMPT" --max-new "$TOKENS" \
        --events-jsonl "$ev" --stats > /dev/null 2> "$WORK/deltafin.err"
    grep -E "^\[deltafin\] (memory budget|spine)|^\[stats\] (experts hits|spine|memory)" "$WORK/deltafin.err" | sed 's/^/    /' >&2 || true
    "$PY" - "$ev" <<'EOF'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"decode_step"' in l]
d = [s["duration_ns"] / 1e9 for s in steps[1:]]
print(f"TOKS {len(d) / sum(d):.4f}")
EOF
}
run_llama() { capped "$PY" "$WORK/llama.py" "$GGUF" "$PROMPT" "$TOKENS" "$THREADS"; }

declare -a D L
order=()
for ((i = 0; i < REPS; i++)); do
    if ((i % 2 == 0)); then order+=(deltafin llama); else order+=(llama deltafin); fi
done
for engine in "${order[@]}"; do
    drop
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    tok=$("run_$engine" | awk '/^TOKS/ { print $2 }')
    p=$(peak)
    echo "$engine: decode ${tok} tok/s  peak_cgroup=${p} B  load=[$load]"
    if [ "$engine" = deltafin ]; then D+=("$tok"); else L+=("$tok"); fi
done
median() { printf '%s\n' "$@" | sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
md=$(median "${D[@]}")
ml=$(median "${L[@]}")
echo "cap ${CAP_GB} GB (budget ${BUDGET_GB} GB, spine ${SPINE}, ${THREADS} threads, ${TOKENS} tokens): deltafin median ${md} tok/s, llama.cpp median ${ml} tok/s, ratio $(awk -v a="$md" -v b="$ml" 'BEGIN { printf "%.2f", (b > 0) ? a / b : 0 }')x; uptime: $(uptime)"
