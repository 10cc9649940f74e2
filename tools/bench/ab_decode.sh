#!/bin/bash
# Decode speed of two deltafin binaries on `mini`, A B B A × ROUNDS per spine, with medians and
# their ratio (docs/PERFORMANCE.md, "Where the numbers come from"). Each run: `run --max-new 64`, the closing
# line's decode= figure. Run it with nothing else busy on the machine.
# usage: ab_decode.sh BIN_A BIN_B
# env: MODEL_ROOT (default /tmp/deltafin-mini), SPINES (default "int8 bf16"), ROUNDS (default 4),
#      ENV_A / ENV_B: NAME=VALUE settings for A's / B's runs only, e.g. the same binary twice with
#      ENV_A=DELTAFIN_HUGE_PAGES=off ENV_B=DELTAFIN_HUGE_PAGES=auto (docs/PERFORMANCE.md, "Resident weights in huge pages")
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 BIN_A BIN_B" >&2; exit 2; fi
A=$1; B=$2
ROOT=${MODEL_ROOT:-/tmp/deltafin-mini}
ROUNDS=${ROUNDS:-4}
dec() { # binary spine env-setting
  env ${3:+"$3"} "$1" run --model-root "$ROOT" --max-new 64 --spine "$2" 2>&1 | grep -o "decode=[0-9.]*" | tail -1 | cut -d= -f2
}
echo "$(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')"
for S in ${SPINES:-int8 bf16}; do
  a=(); b=()
  for _ in $(seq "$ROUNDS"); do
    a+=("$(dec "$A" "$S" "${ENV_A:-}")"); b+=("$(dec "$B" "$S" "${ENV_B:-}")")
    b+=("$(dec "$B" "$S" "${ENV_B:-}")"); a+=("$(dec "$A" "$S" "${ENV_A:-}")")
  done
  python3 - "$S" "$A" "$B" "${a[*]}" "${b[*]}" <<'PY'
import statistics as st, sys, os
s, na, nb, a, b = sys.argv[1:6]
a = [float(x) for x in a.split()]; b = [float(x) for x in b.split()]
print(f"{s} A {os.path.basename(na)}: median {st.median(a):.2f} token/s {a}")
print(f"{s} B {os.path.basename(nb)}: median {st.median(b):.2f} token/s {b}")
print(f"{s} B / A = {st.median(b) / st.median(a):.3f}")
PY
done
