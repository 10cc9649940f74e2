#!/bin/bash
# One cold prefill with per-layer phase times (docs/PERFORMANCE.md, "Prefill at agent prompt
# lengths"): `deltafin run --state-cache off --max-new 1 --layer-profile` on PROMPT_FILE, then
# the prefill rate (from the events file's prefill_done) and the phase times summed over the
# prefill passes (KDA / MLA attention, MoE / dense FFN, mix), with the load average.
# usage: prefill_profile.sh BIN PROMPT_FILE [SPINE]
# env: MODEL_ROOT (default /tmp/deltafin-mini), RAYON_NUM_THREADS (default 2)
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 BIN PROMPT_FILE [SPINE]" >&2; exit 2; fi
BIN=$1; P=$2; SPINE=${3:-int8}
ROOT=${MODEL_ROOT:-/tmp/deltafin-mini}
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}
TMP=$(mktemp -d)
"$BIN" run --model-root "$ROOT" --spine "$SPINE" --state-cache off --prompt "$(cat "$P")" \
  --max-new 1 --events-jsonl "$TMP/ev.jsonl" --layer-profile >/dev/null 2>"$TMP/phases.txt"
python3 - "$TMP/ev.jsonl" "$TMP/phases.txt" <<'PY'
import collections, json, re, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e.get("event") == "prefill_done":
        print("%d tokens, %.2f s, %.2f token/s" % (e["prompt_tokens"], e["duration_ns"] / 1e9,
              e["prompt_tokens"] / e["duration_ns"] * 1e9))
        break
tot = collections.Counter()
pat = re.compile(r"rows=(\d+) (\w+)\+(\w+) total_ms=([\d.]+) weights_ms=[\d.]+ mix_ms=([\d.]+) "
                 r"attention_ms=([\d.]+) ffn_ms=([\d.]+)")
for line in open(sys.argv[2]):
    m = pat.search(line)
    if not m or int(m.group(1)) < 2:  # decode steps
        continue
    rows, att, ffn, total, mix, at, ff = m.groups()
    tot["total"] += float(total); tot["mix"] += float(mix)
    tot["attention " + att] += float(at); tot["ffn " + ffn] += float(ff)
print("  ".join("%s %.2f s (%.0f%%)" % (k, v / 1e3, 100 * v / tot["total"])
                for k, v in sorted(tot.items())))
PY
echo "$(uptime | sed 's/.*load/load/')"
rm -rf "$TMP"
