#!/bin/bash
# A B B A comparison of two deltafin binaries on `mini` (docs/PERFORMANCE.md, "Vectorised
# transcendentals"): per run, the prefill of PROMPT_FILE (--max-new 1; rate from the events
# file's prefill_done = prompt_tokens / duration_ns) and a 48-token decode of a short prompt
# (the closing line's decode=), with the load average. The decode texts of A and B are compared.
# usage: ab_prefill_decode.sh BIN_A BIN_B
# env: MODEL_ROOT (default /tmp/deltafin-mini), PROMPT_FILE (default /tmp/prompt625.txt),
#      SPINE (default bf16), RAYON_NUM_THREADS (default 2)
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 BIN_A BIN_B" >&2; exit 2; fi
A=$1; B=$2
SPINE=${SPINE:-bf16}
ROOT=${MODEL_ROOT:-/tmp/deltafin-mini}
P="$(cat "${PROMPT_FILE:-/tmp/prompt625.txt}")"
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}
TMP=$(mktemp -d)
one() { # binary label
  local ev=$TMP/ev.jsonl; rm -f "$ev"
  "$1" run --model-root "$ROOT" --spine "$SPINE" --prompt "$P" --max-new 1 --events-jsonl "$ev" \
    >/dev/null 2>&1
  local pf
  pf=$(python3 -c "
import json
for l in open('$ev'):
    e = json.loads(l)
    if e.get('event') == 'prefill_done':
        print('%d tokens, %.2f token/s' % (e['prompt_tokens'], e['prompt_tokens'] / e['duration_ns'] * 1e9))
        break")
  local dec
  dec=$("$1" run --model-root "$ROOT" --spine "$SPINE" --prompt "The history of the printing press" \
    --max-new 48 2>&1 >"$TMP/out-$2.txt" | grep -o 'decode=[0-9.]* token/s')
  echo "$2 prefill: $pf | $dec | $(uptime | sed 's/.*load/load/')"
}
one "$A" A; one "$B" B; one "$B" B; one "$A" A
if cmp -s "$TMP/out-A.txt" "$TMP/out-B.txt"; then echo "decode texts identical"; else echo "decode texts differ"; fi
rm -rf "$TMP"
