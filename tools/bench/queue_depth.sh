#!/usr/bin/env bash
# Read rate of one drive versus reads in flight and read size, O_DIRECT (docs/PERFORMANCE.md,
# "Deep queues"): io_uring with N reads in flight from one thread, against N threads each
# with one blocking pread (what the expert reader's per-drive threads do).
# Usage: tools/bench/queue_depth.sh [FILE_ON_THE_DRIVE] [SECONDS_PER_POINT]
# FILE defaults to ./qd-probe.bin (4 GiB, created with O_DIRECT writes, deleted at the end).
set -euo pipefail
file=${1:-./qd-probe.bin}
secs=${2:-4}
made=0
if [ ! -f "$file" ]; then
  fio --name=mk --filename="$file" --size=4G --rw=write --bs=16M --direct=1 >/dev/null
  made=1
fi
echo "# host: $(uptime)"
echo "engine,bs,depth,MB/s"
for bs in 128k 1m 4m 16m; do
  for d in 1 2 4 8 16 32; do
    r=$(fio --name=u --filename="$file" --rw=randread --bs=$bs --direct=1 --ioengine=io_uring \
          --iodepth=$d --time_based --runtime=$secs --output-format=json | \
        python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["read"]["bw_bytes"]/1e6))')
    echo "io_uring,$bs,$d,$r"
    r=$(fio --name=t --filename="$file" --rw=randread --bs=$bs --direct=1 --ioengine=psync \
          --numjobs=$d --group_reporting --time_based --runtime=$secs --output-format=json | \
        python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["read"]["bw_bytes"]/1e6))')
    echo "threads,$bs,$d,$r"
  done
done
[ "$made" = 1 ] && rm -f "$file"
exit 0
