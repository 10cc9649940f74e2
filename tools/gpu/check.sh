#!/usr/bin/env bash
# The GPU correctness + speed check (issue 11). Runs on a machine with an NVIDIA GPU, offline,
# in well under 8 minutes: every CUDA kernel vs the CPU reference on random ragged inputs,
# batch-width invariance, and the bandwidth table (effective weight GB/s vs the device's
# device-to-device copy probe; goal ≥ 0.8). Writes $OUT/gpu-results.md (OUT defaults to
# target/gpu-results). Uses the prebuilt bundle from tools/gpu/prepare.sh when present,
# else builds the tests with cargo.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-target/gpu-results}
mkdir -p "$out"
res="$out/gpu-results.md"
log="$out/gpu-check.log"
: > "$log"
{
  echo "# deltafin GPU check"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- commit: $(cat target/gpu-bundle/commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "- host: $(uname -srm), $(nproc) CPUs"
  if command -v nvidia-smi >/dev/null; then
    echo "- GPU: $(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version,clocks.max.memory --format=csv,noheader 2>&1 | head -1)"
  else
    echo "- GPU: nvidia-smi not found"
  fi
} > "$res"

# Kernels: NVRTC if the machine has it, else the bundled PTX (JIT-compiled by the driver).
if [ -z "${DELTAFIN_NVRTC:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so' \
   && ! ls "${CUDA_HOME:-/usr/local/cuda}"/lib64/libnvrtc.so* >/dev/null 2>&1; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
  arch=compute_80
  if [ -n "$cc" ] && [ "$cc" -ge 90 ] 2>/dev/null; then arch=compute_90; fi
  if [ -d "target/gpu-bundle/ptx/$arch" ]; then
    export DELTAFIN_CUDA_PTX_DIR="$PWD/target/gpu-bundle/ptx/$arch"
    echo "- kernels: bundled PTX ($arch), no NVRTC on this machine" >> "$res"
  fi
fi

export DELTAFIN_REQUIRE_GPU=1
# The GPU kernels take f32 activations: compare them with the CPU's f32-activation MXFP4 path
# (on AVX-512 VNNI hosts the CPU default quantises MXFP4 activations to int8, docs/NUMERICS.md).
export DELTAFIN_MXFP4_ACT=f32
args=(--test-threads=1 --nocapture)
if [ -x target/gpu-bundle/cuda_device ]; then
  runner=(target/gpu-bundle/cuda_device)
else
  runner=(cargo test --release -p deltafin-kernels --features cuda --test cuda_device --)
fi
status=0
for t in matmul_kernels_match_cpu_on_ragged_shapes kda_step_matches_cpu_over_several_tokens \
         mla_decode_matches_cpu doctor_canaries_pass matmul_bandwidth_vs_copy; do
  echo "== $t" | tee -a "$log"
  start=$(date +%s)
  if timeout 150 "${runner[@]}" "$t" --exact "${args[@]}" >>"$log" 2>&1; then r=PASS; else r="FAIL (exit $?)"; status=1; fi
  echo "- $t: $r ($(( $(date +%s) - start )) s)" >> "$res"
done
{
  echo
  echo "## Bandwidth (weight bytes per second vs device-to-device copy)"
  echo
  grep -E '^\|' "$log" || echo "(no table: see gpu-check.log)"
  echo
  echo "## Log excerpts"
  echo
  echo '```'
  grep -E -A1 'copy:|worst|SKIP|panicked|error|kernels:' "$log" | grep -v '^--$' | head -200
  echo '```'
} >> "$res"
cat "$res"
exit $status
