#!/bin/bash
# A B B A comparison of two deltafin binaries on one model root: per run, `deltafin run` on a
# long prompt (greedy, `--state-cache off`, so nothing is restored) and the closing line's
# prefill and decode token/s; per spine, the means and their ratio, and whether the two builds'
# generated ids are equal (exit 1 if not). Used for kernel changes (docs/PERFORMANCE.md,
# "Vectorised transcendentals") and for behaviour-preserving ones ("Behaviour-preserving
# changes"). Run it with nothing else busy on the machine.
# usage: ab_prefill_decode.sh BIN_A BIN_B
# env: MODEL_ROOT (default /tmp/deltafin-mini), PROMPT_FILE (default: a generated prompt of about
#      600 tokens), SPINES (default "int8 bf16"; SPINE=x for one), ROUNDS (A B B A rounds,
#      default 2), TOKENS (decoded per run, default 64), RAYON_NUM_THREADS (default 2)
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 BIN_A BIN_B" >&2; exit 2; fi
A=$1; B=$2
ROOT=${MODEL_ROOT:-/tmp/deltafin-mini}
ROUNDS=${ROUNDS:-2}
TOKENS=${TOKENS:-64}
SPINES=${SPINE:-${SPINES:-int8 bf16}}
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}
if [ -n "${PROMPT_FILE:-}" ]; then
  PROMPT="$(cat "$PROMPT_FILE")"
else
  PROMPT="$(python3 -c "print(' '.join(f'word{i} the quick brown fox' for i in range(100)))")"
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "uptime at start: $(uptime)"
for spine in $SPINES; do
  for ((r = 0; r < ROUNDS; r++)); do
    for arm in A B B A; do
      bin=$A
      [ "$arm" = B ] && bin=$B
      ev="$TMP/$spine-$arm.jsonl"
      rm -f "$ev"
      line=$("$bin" run --model-root "$ROOT" --spine "$spine" --state-cache off \
        --prompt "$PROMPT" --max-new "$TOKENS" --temperature 0 --events-jsonl "$ev" \
        2>&1 >/dev/null | grep -o "prefill=.*" || true)
      echo "$spine $arm $line"
    done
  done | tee "$TMP/$spine.log"
  python3 - "$TMP" "$spine" <<'PY'
import json, re, statistics, sys
tmp, spine = sys.argv[1], sys.argv[2]
def ids(p):
    out = []
    for line in open(p):
        e = json.loads(line)
        if e.get("event") == "decode_step":
            out += e.get("emitted_token_ids", [])
    return out
rate = {"A": {"prefill": [], "decode": []}, "B": {"prefill": [], "decode": []}}
for line in open(f"{tmp}/{spine}.log"):
    m = re.match(r"\S+ ([AB]) prefill=\S+ \(([\d.]+) token/s\) decode=([\d.]+)", line)
    if m:
        rate[m[1]]["prefill"].append(float(m[2]))
        rate[m[1]]["decode"].append(float(m[3]))
for what in ("prefill", "decode"):
    a, b = rate["A"][what], rate["B"][what]
    if a and b:
        print(f"{spine} {what}: A {statistics.mean(a):.2f}, B {statistics.mean(b):.2f} token/s, "
              f"B/A {statistics.mean(b) / statistics.mean(a):.3f}")
a, b = ids(f"{tmp}/{spine}-A.jsonl"), ids(f"{tmp}/{spine}-B.jsonl")
print(f"{spine} ids: {len(a)} and {len(b)}, " + ("equal" if a == b and a else "DIFFERENT"))
sys.exit(0 if a == b and a else 1)
PY
done
echo "uptime at end: $(uptime)"
