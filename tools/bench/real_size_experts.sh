#!/usr/bin/env bash
# Real-size experts on one drive, cold (issue 44; docs/PERFORMANCE.md "Real-size experts"):
# synthesize K3's real expert geometry (hidden 7168, experts of 17,547,264 B, top-16, one MoE
# layer; `cargo xtask synth --preset real-experts`), then `cargo xtask stream-bench`: a read
# probe of the same drive (sequential, then expert-sized random O_DIRECT reads), prefill and
# greedy decode with the experts streamed through a small cache, the page cache dropped before
# each phase. It prints the expert read rate ÷ the probe and decode token/s ÷ the I/O bound.
# Not in CI: it writes EXPERTS × 17.5 MB (15.7 GB for 896) and deletes it at the end unless
# KEEP=1.
#
#   sudo tools/bench/real_size_experts.sh                 # 896 experts, 15.7 GB
#   EXPERTS=256 TOKENS=8 sudo -E tools/bench/real_size_experts.sh
#
# Env: OUT (/tmp/deltafin-real-experts), EXPERTS (896), TOKENS (8 decode steps), PROMPT (8),
# CACHE_GB (1.2: about 68 experts, so that decode streams), THREADS (8: reads in flight, the
# expert reader's default depth), KEEP (0), PROFILE (release; `dev` reuses a dev build).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/deltafin-real-experts}
EXPERTS=${EXPERTS:-896}
TOKENS=${TOKENS:-8}
PROMPT=${PROMPT:-8}
CACHE_GB=${CACHE_GB:-1.2}
THREADS=${THREADS:-8}
KEEP=${KEEP:-0}
PROFILE=${PROFILE:-release}
# XTASK: a built xtask binary to use instead of `cargo run` (e.g. target/release/xtask).
XT=${XTASK:-cargo run --profile $PROFILE -q -p xtask --}
need=$(( EXPERTS * 17547264 / 1000000000 + 3 ))
avail=$(df -BG --output=avail "$(dirname "$OUT")" | tail -1 | tr -dc 0-9)
[ "$avail" -gt $(( need + 15 )) ] || { echo "real_size_experts: $need GB needed, only $avail GB free (keeping 15 GB)" >&2; exit 1; }
cd "$ROOT"
echo "# host: $(uptime)"
if [ ! -f "$OUT/config.json" ]; then
  $XT synth --preset real-experts --experts "$EXPERTS" --out "$OUT"
fi
cleanup() { [ "$KEEP" = 1 ] || rm -rf "$OUT"; }
trap cleanup EXIT
$XT stream-bench --model-root "$OUT" --cache-gb "$CACHE_GB" \
  --prompt-tokens "$PROMPT" --tokens "$TOKENS" --threads "$THREADS" --spine bf16 \
  --probe-mb 2048 --probe-reads 200
