#!/usr/bin/env bash
# deltafin vs llama.cpp on the synthesized `mini` K3 checkpoint (same threads, prompts, formats):
# builds the release binary, synthesizes mini (2.35 GB) when absent, reuses or creates the
# llama.cpp oracle venv (tools/oracle/run_llama_oracle.sh documents it; ~25 min to build), converts
# the checkpoint to GGUF (bf16 spine, MXFP4 experts) once and runs llama_side_by_side.py.
#
# Env: MINI (default /tmp/deltafin-mini), ORACLE_VENV (default tools/oracle/.venv),
#      ORACLE_WORK (default /tmp/deltafin-oracle), THREADS (default 2).
# Extra arguments go to llama_side_by_side.py (e.g. --rounds 3 --json out.json).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MINI=${MINI:-/tmp/deltafin-mini}
VENV=${ORACLE_VENV:-$ROOT/tools/oracle/.venv}
WORK=${ORACLE_WORK:-/tmp/deltafin-oracle}
LCPP_VERSION=0.3.36
cd "$ROOT"
cargo build --locked --release -p deltafin-cli -p xtask
[ -f "$MINI/config.json" ] || target/release/xtask synth --preset mini --seed 1 --out "$MINI"
if ! "$VENV/bin/python" -c "import llama_cpp; assert llama_cpp.__version__ == '$LCPP_VERSION'" 2>/dev/null; then
    echo "no llama.cpp venv at $VENV: run tools/oracle/run_llama_oracle.sh first (it builds it)" >&2
    exit 2
fi
SRC=$WORK/llama-cpp-python-$LCPP_VERSION
if [ ! -f "$SRC/vendor/llama.cpp/conversion/kimi_k3.py" ]; then
    "$VENV/bin/pip" download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$LCPP_VERSION" -d "$WORK/sdist"
    mkdir -p "$SRC"
    tar -xzf "$WORK/sdist/llama_cpp_python-$LCPP_VERSION.tar.gz" -C "$SRC" --strip-components=1
fi
exec "$VENV/bin/python" tools/bench/llama_side_by_side.py --model-root "$MINI" \
    --deltafin target/release/deltafin --gguf "$WORK/$(basename "$MINI").bf16.gguf" --llama-src "$SRC/vendor/llama.cpp" \
    --threads "${THREADS:-2}" "$@"
