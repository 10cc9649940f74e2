#!/usr/bin/env bash
# Recreate the llama.cpp oracle venv from PyPI, synthesize the tiny K3 checkpoint with
# `cargo xtask synth`, convert it with llama.cpp's K3 rules and regenerate
# tests/fixtures/oracle/llama_k3_tiny*. Extra arguments go to llama_k3_oracle.py
# (e.g. --out-dir /tmp/check to compare against the committed fixtures).
#
# Env: ORACLE_VENV (default tools/oracle/.venv), ORACLE_WORK (default /tmp/deltafin-oracle),
#      ORACLE_SEED (default 7), ORACLE_SYNTH_REPO (workspace that runs `cargo xtask synth`,
#      default this one), PYTHON (default python3, >= 3.10).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${ORACLE_VENV:-$ROOT/tools/oracle/.venv}
WORK=${ORACLE_WORK:-/tmp/deltafin-oracle}
SEED=${ORACLE_SEED:-7}
SYNTH_REPO=${ORACLE_SYNTH_REPO:-$ROOT}
LCPP_VERSION=0.3.36
mkdir -p "$WORK"

if ! "$VENV/bin/python" -c "import llama_cpp, tiktoken, yaml, numpy; assert llama_cpp.__version__ == '$LCPP_VERSION'" 2>/dev/null; then
    "${PYTHON:-python3}" -m venv "$VENV"
    # llama-cpp-python builds llama.cpp from source (CPU only): ~25 min on 2 cores.
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} nice "$VENV/bin/pip" install \
        numpy==2.4.6 tiktoken==0.14.0 PyYAML==6.0.4 "llama-cpp-python==$LCPP_VERSION"
fi

# The sdist's vendor/llama.cpp provides gguf-py (with KIMI_K3), the K3 chat template and the
# conversion sources that k3_gguf_convert.py ports.
SRC=$WORK/llama-cpp-python-$LCPP_VERSION
if [ ! -f "$SRC/vendor/llama.cpp/conversion/kimi_k3.py" ]; then
    "$VENV/bin/pip" download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$LCPP_VERSION" -d "$WORK/sdist"
    mkdir -p "$SRC"
    tar -xzf "$WORK/sdist/llama_cpp_python-$LCPP_VERSION.tar.gz" -C "$SRC" --strip-components=1
fi

exec nice "$VENV/bin/python" "$ROOT/tools/oracle/llama_k3_oracle.py" \
    --synth rust --synth-repo "$SYNTH_REPO" --preset tiny --seed "$SEED" \
    --work "$WORK" --llama-src "$SRC/vendor/llama.cpp" "$@"
