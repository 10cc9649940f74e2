#!/usr/bin/env bash
# Build the GPU check bundle on a CPU machine: the release test binary of the CUDA kernel
# tests, precompiled PTX (for GPU machines without NVRTC), the release `deltafin` and a tiny
# synthesized checkpoint for the forward-pass check. Writes target/gpu-bundle/.
# Needs the pip wheels nvidia-cuda-nvrtc-cu12 + nvidia-cuda-nvcc-cu12 in $DELTAFIN_CUDA_PYTHON
# (default python3), e.g. python3 -m venv /work/cuda-venv && /work/cuda-venv/bin/pip install
# nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=target/gpu-bundle
rm -rf "$bundle" && mkdir -p "$bundle/ptx"
export DELTAFIN_REQUIRE_NVRTC=1 DELTAFIN_CUDA_PTX_OUT="$PWD/$bundle/ptx"
cargo test --locked --release -p deltafin-kernels --test cuda_compile -- --nocapture 2>&1 | tail -3
exe=$(cargo test --locked --release -p deltafin-kernels --features cuda --test cuda_device --no-run \
  --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda_device" and m.get("executable"):
        print(m["executable"])')
cp "$exe" "$bundle/cuda_device"
strip "$bundle/cuda_device" 2>/dev/null || true
# The K3 forward-pass check (check.sh `model_on_device`): the release binary and a tiny
# synthesized checkpoint (real vocabulary and tokenizer, hidden 48, 14 layers).
cargo build --locked --release -p deltafin-cli 2>&1 | tail -1
cp target/release/deltafin "$bundle/deltafin"
strip "$bundle/deltafin" 2>/dev/null || true
cargo xtask synth --preset tiny --seed 7 --out "$bundle/model" 2>&1 | tail -1
git rev-parse HEAD > "$bundle/commit"
du -sh "$bundle"/* | sed 's/^/  /'
echo "bundle ready: $bundle (carry it to the GPU machine, then run tools/gpu/check.sh)"
