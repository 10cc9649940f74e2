#!/usr/bin/env bash
# Prefill rate A B B A: two deltafin binaries on the same prompt, alternated, with the load.
# Usage: tools/bench/prefill_ab.sh BASE_BIN NEW_BIN MODEL_ROOT PROMPT_FILE [extra run args...]
# Rate = prompt tokens / prefill_done.duration_ns (from --events-jsonl), 2 rayon threads.
set -euo pipefail
base=$1 new=$2 root=$3 prompt=$4
shift 4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
one() {
    local name=$1 bin=$2
    shift 2
    local load
    load=$(cut -d' ' -f1 /proc/loadavg)
    RAYON_NUM_THREADS=2 "$bin" run --model-root "$root" --prompt "$(cat "$prompt")" --max-new 1 \
        --events-jsonl "$tmp/ev.jsonl" "$@" >/dev/null 2>&1
    python3 - "$tmp/ev.jsonl" "$name" "$load" "$(cut -d' ' -f1 /proc/loadavg)" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if '"prefill_done"' in l][-1]
rate = ev["prompt_tokens"] / (ev["duration_ns"] / 1e9)
print(f"{sys.argv[2]:4} {rate:8.2f} token/s  ({ev['prompt_tokens']} tokens, load {sys.argv[3]} -> {sys.argv[4]})")
PY
}
one A "$base" "$@"
one B "$new" "$@"
one B "$new" "$@"
one A "$base" "$@"
