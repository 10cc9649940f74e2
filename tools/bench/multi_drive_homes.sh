#!/usr/bin/env bash
# Expert homes on 1, 2 and 4 simulated drives (issue 44): loop devices on files, each
# throttled by the cgroup v1 blkio controller to RATE_MB MB/s and IOPS_LIMIT reads/s, so that
# the drives are independent and far slower than the real disk under them. For each drive
# count N the experts are placed on N drives (1 copy for N = 1, else 2), the page cache is
# dropped, and `deltafin run` decodes under a memory budget inside the throttled cgroup.
# Printed per run: decode token/s, the expert bytes read, the homes' bytes, and the run's I/O
# bound (its expert bytes ÷ (N × RATE_MB)) against its prefill + decode time. Not part of CI: needs root, loop
# devices, mkfs.ext4 and /sys/fs/cgroup/blkio.
#
#   cargo build --release && cargo xtask synth --preset stream --out /tmp/exp-stream
#   sudo tools/bench/multi_drive_homes.sh
#   MODEL=/tmp/exp-stream RATE_MB=100 TOKENS=32 REPS=2 sudo -E tools/bench/multi_drive_homes.sh
#
# Env: MODEL (/tmp/exp-stream), BIN (target/release/deltafin), WORK (/tmp/deltafin-homes-bench),
# RATE_MB (100: MB/s per drive), IOPS_LIMIT (0: none), BUDGET_GB (0.6), TOKENS (32),
# REPS (2 per drive count), THREADS (4 expert read threads per drive), SPINE (bf16).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=${MODEL:-/tmp/exp-stream}
BIN=${BIN:-$ROOT/target/release/deltafin}
WORK=${WORK:-/tmp/deltafin-homes-bench}
RATE_MB=${RATE_MB:-100}
IOPS_LIMIT=${IOPS_LIMIT:-0}
BUDGET_GB=${BUDGET_GB:-0.6}
TOKENS=${TOKENS:-32}
REPS=${REPS:-2}
THREADS=${THREADS:-4}
SPINE=${SPINE:-bf16}
CG=/sys/fs/cgroup/blkio/deltafin-homes-bench

die() { echo "multi_drive_homes: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (loop devices, mounts, blkio throttles)"
[ -d /sys/fs/cgroup/blkio ] || die "no cgroup v1 blkio controller at /sys/fs/cgroup/blkio"
[ -x "$BIN" ] || die "$BIN is missing: cargo build --release"
[ -f "$MODEL/config.json" ] || die "$MODEL has no model: cargo xtask synth --preset stream --out $MODEL"
command -v mkfs.ext4 >/dev/null || die "mkfs.ext4 is missing"

# Expert bytes of the model: the sum of the routed experts' tensor sizes in the shard index is
# not needed; a home of all experts is at most the model's size on disk.
MODEL_BYTES=$(du -sb "$MODEL" | cut -f1)
# Per drive: 1 copy (N = 1) + 1 (N = 2, 2 replicas on 2 drives) + 1/2 (N = 4) + slack.
FILE_BYTES=$(( (MODEL_BYTES * 5 / 2 >> 20 << 20) + (256 << 20) ))
RATE=$(( RATE_MB * 1000 * 1000 ))

LOOPS=()
cleanup() {
  set +e
  if [ -d "$CG" ]; then
    while read -r p; do echo "$p" > /sys/fs/cgroup/blkio/cgroup.procs; done < "$CG/cgroup.procs"
    rmdir "$CG"
  fi
  for i in 0 1 2 3; do umount "$WORK/d$i" 2>/dev/null; done
  for l in "${LOOPS[@]}"; do losetup -d "$l"; done
  rm -f "$WORK"/drive*.img
}
trap cleanup EXIT

mkdir -p "$WORK" "$CG"
for i in 0 1 2 3; do
  img="$WORK/drive$i.img"
  truncate -s "$FILE_BYTES" "$img"
  # --direct-io=on: the loop device reads its file past the host's page cache.
  loop=$(losetup -f --show --direct-io=on "$img")
  LOOPS+=("$loop")
  mkfs.ext4 -q -F "$loop"
  mkdir -p "$WORK/d$i"
  mount "$loop" "$WORK/d$i"
  dev=$(lsblk -dno MAJ:MIN "$loop" | tr -d ' ')
  echo "$dev $RATE" > "$CG/blkio.throttle.read_bps_device"
  if [ "$IOPS_LIMIT" != 0 ]; then
    echo "$dev $IOPS_LIMIT" > "$CG/blkio.throttle.read_iops_device"
  fi
done
echo "4 loop drives of $((FILE_BYTES >> 20)) MiB, each throttled to $RATE_MB MB/s (iops ${IOPS_LIMIT/#0/unlimited}) in $CG"

homes_of() { # N → comma-separated home directories for N drives
  local n=$1 out=() i
  for ((i = 0; i < n; i++)); do mkdir -p "$WORK/d$i/h$n"; out+=("$WORK/d$i/h$n"); done
  (IFS=,; echo "${out[*]}")
}

# Placement runs outside the throttled cgroup (its read-backs would otherwise be throttled).
for n in 1 2 4; do
  replicas=$(( n == 1 ? 1 : 2 ))
  "$BIN" place-experts --model-root "$MODEL" --homes "$(homes_of $n)" --replicas $replicas \
    2>/dev/null | tail -n 1
done

run_once() { # N → one line of results
  local n=$1 homes out err
  homes=$(homes_of "$n")
  sync; echo 3 > /proc/sys/vm/drop_caches
  err=$(mktemp)
  # The run is the only process in the throttled cgroup.
  out=$(sh -c 'echo $$ > '"$CG"'/cgroup.procs; exec "$@"' sh \
    env K3_SPINE="$SPINE" K3_EXPERT_READ_THREADS="$THREADS" K3_EXPERT_HEAT=off \
    "$BIN" run --model-root "$MODEL" --memory-budget-gb "$BUDGET_GB" --expert-homes "$homes" \
      --prompt "The drives share the reads of every token" --max-new "$TOKENS" --stats \
    2>"$err" >/dev/null; cat "$err")
  rm -f "$err"
  local decode bytes dev prefill generated
  decode=$(grep -o 'decode=[0-9.]* token/s' <<<"$out" | grep -o '[0-9.]*' | head -1)
  prefill=$(grep -o ' prefill=[0-9.]*s' <<<"$out" | grep -o '[0-9.]*' | head -1)
  generated=$(grep -o ' generated=[0-9]*' <<<"$out" | head -1 | cut -d= -f2)
  bytes=$(grep -o ' bytes_read=[0-9]*' <<<"$out" | head -1 | cut -d= -f2)
  dev=$(grep -o ' homes=[^ ]*' <<<"$out" | head -1)
  # The I/O bound of the run: its expert bytes at N × RATE, against its prefill + decode time.
  awk -v n="$n" -v d="$decode" -v p="$prefill" -v g="$generated" -v b="$bytes" -v r="$RATE" 'BEGIN {
    t = p + g / d; bound = b / (n * r);
    printf "homes=%d decode=%.3f token/s prefill=%.2f s generated=%d expert_bytes=%.0f run=%.2f s io_bound=%.2f s bound/run=%.3f\n",
      n, d, p, g, b, t, bound, bound / t }'
  echo "    ${dev# }"
}

for rep in $(seq 1 "$REPS"); do
  for n in 1 2 4; do run_once "$n"; done
done
