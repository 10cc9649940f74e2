#!/usr/bin/env bash
# Runs every cargo-fuzz target of fuzz/ for RUNS executions each, one after another
# (docs/OPERATIONS.md "Fuzzing"), and prints a table of the results.
#
#   tools/fuzz/run_all.sh                        # every target, 1,000,000 runs each
#   RUNS=100000 tools/fuzz/run_all.sh tokenizer config_json
#
# Env: RUNS (1000000), SANITIZER (address; `none` where ASan is unavailable), RSS_MB (2048,
# libFuzzer's memory limit), TIMEOUT_S (10, per input), MAX_TIME_S (0: none; else each target
# stops after this many seconds even short of RUNS), CARGO_TARGET_DIR (fuzz/target).
# Builds are release with debug assertions (overflow checks on). The toolchain may be stable:
# RUSTC_BOOTSTRAP=1 lets it take the sanitizer flags cargo-fuzz passes. New corpus entries go
# to fuzz/target/corpus/<target>/ (the committed seeds in fuzz/corpus/ are only read); a
# crashing input is written to fuzz/artifacts/<target>/ and, once minimized
# (`cargo fuzz tmin <target> <file>`), belongs in fuzz/regressions/<target>/. Logs:
# fuzz/target/campaigns/<UTC time>/<target>.log. Exit status 1 if any target failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FUZZ=$ROOT/fuzz
RUNS=${RUNS:-1000000}
SANITIZER=${SANITIZER:-address}
RSS_MB=${RSS_MB:-2048}
TIMEOUT_S=${TIMEOUT_S:-10}
MAX_TIME_S=${MAX_TIME_S:-0}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$FUZZ/target}
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked || exit 1
fi

cd "$FUZZ" || exit 1
if [ "$#" -gt 0 ]; then
  TARGETS=("$@")
else
  mapfile -t TARGETS < <(cargo fuzz list)
fi
LOGS=$CARGO_TARGET_DIR/campaigns/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$LOGS"

cargo fuzz build -O -a -s "$SANITIZER" || exit 1

status=0
rows=()
for t in "${TARGETS[@]}"; do
  work=$CARGO_TARGET_DIR/corpus/$t
  mkdir -p "$work"
  log=$LOGS/$t.log
  echo "== $t: $RUNS runs ($log)" >&2
  start=$(date +%s)
  cargo fuzz run -O -a -s "$SANITIZER" "$t" "$work" "$FUZZ/corpus/$t" -- \
    -runs="$RUNS" -rss_limit_mb="$RSS_MB" -timeout="$TIMEOUT_S" -max_total_time="$MAX_TIME_S" \
    -print_final_stats=1 \
    >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  # libFuzzer's own time when it finished (without the build); else the elapsed time.
  done_s=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
  secs=${done_s:-$secs}
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -1)
  crashes=$(grep -cE 'ERROR: (libFuzzer: deadly signal|AddressSanitizer)' "$log")
  timeouts=$(grep -c 'ERROR: libFuzzer: timeout' "$log")
  ooms=$(grep -c 'ERROR: libFuzzer: out-of-memory' "$log")
  if [ "$rc" -ne 0 ]; then
    status=1
    [ "$crashes$timeouts$ooms" = "000" ] && crashes="exit $rc"
  fi
  rows+=("| \`$t\` | ${execs:-?} | ${secs} s | ${rss:-?} MB | $crashes | $timeouts | $ooms |")
done

echo
echo "| target | executions | wall time | peak RSS | crashes | timeouts | OOMs |"
echo "|---|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
exit "$status"
