#!/usr/bin/env bash
# The aarch64 CPU path, executed: build the kernel, tokenizer and forward-pass tests for
# aarch64-unknown-linux-gnu on this x86-64 host and run them under qemu-user twice, once on a
# CPU model with the extensions Apple's cores have and once on one without the optional ones
# (docs/OPERATIONS.md, "aarch64 under qemu").
#
# Needs: the Debian packages gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user
# (installed here with apt-get when missing and run as root), the Rust target
# aarch64-unknown-linux-gnu (rustup target add) and python3 (to read cargo's list of test
# binaries). Without them this prints a SKIPPED line, or fails when DELTAFIN_REQUIRE_AARCH64=1
# (.ci/run sets it).
set -euo pipefail
cd "$(dirname "$0")/../.."

TARGET=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu
PACKAGES="gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"

started=$(date +%s)

missing() {
  if [ "${DELTAFIN_REQUIRE_AARCH64:-0}" = 1 ]; then
    echo "FAILED: aarch64 tests under qemu: $1 (DELTAFIN_REQUIRE_AARCH64=1)" >&2
    exit 1
  fi
  echo "SKIPPED: aarch64 tests under qemu: $1 (DELTAFIN_REQUIRE_AARCH64=1 makes this a failure)"
  exit 0
}

have_tools() {
  command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 \
    && command -v qemu-aarch64 >/dev/null 2>&1 \
    && [ -e "$SYSROOT/lib/ld-linux-aarch64.so.1" ]
}

if ! have_tools && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "aarch64: installing $PACKAGES"
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $PACKAGES >/dev/null \
    || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $PACKAGES >/dev/null; } \
    || true
fi
have_tools || missing "the cross linker and qemu-user are not installed (Debian: apt-get install $PACKAGES)"
command -v python3 >/dev/null 2>&1 || missing "python3 is not installed"
if ! rustup target list --installed 2>/dev/null | grep -qx "$TARGET"; then
  rustup target add "$TARGET" || missing "rustup could not install the Rust target $TARGET"
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export QEMU_LD_PREFIX=$SYSROOT
# NEON must be found and tested (a failed detection would leave only the scalar backend).
export DELTAFIN_REQUIRE_NEON=1

# The test binaries, built once with `cargo test`'s own profile (opt-level 2, dependencies at
# 3): deltafin-kernels' unit tests (every NEON table entry against the scalar reference, the
# KDA step, vmath), deltafin-k3's (the tokenizer, the chat template, the model blocks), the
# tiktoken and NeMo goldens and the forward pass on the tiny checkpoint against llama.cpp.
list=$(mktemp)
trap 'rm -f "$list"' EXIT
cargo test --locked --target "$TARGET" --no-run --message-format=json-render-diagnostics \
  -p deltafin-kernels -p deltafin-k3 -p deltafin-tests \
  --lib --test oracle_llama --test tokenizer_goldens --test chat_goldens \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["manifest_path"].rsplit("/", 1)[0], m["executable"])
' >"$list"
built=$(date +%s)
echo "aarch64: built the test binaries in $((built - started)) s"

# Run test binary `name` (as cargo names it) under `qemu-aarch64 -cpu $cpu`, from its
# package's directory as `cargo test` does, with the test-name filters that follow.
run() {
  local cpu=$1 name=$2 dir exe
  shift 2
  read -r dir exe < <(awk -v n="$name" '$1 == n { print $2, $3; exit }' "$list") || true
  [ -n "${exe:-}" ] || { echo "FAILED: no aarch64 test binary $name" >&2; exit 1; }
  local t0
  t0=$(date +%s)
  (cd "$dir" && qemu-aarch64 -cpu "$cpu" "$exe" -q "$@")
  echo "aarch64: -cpu $cpu $name ${*:-(all)}: passed in $(($(date +%s) - t0)) s"
}

# `max`: every extension qemu implements — dotprod, i8mm and bf16 among them, as on Apple
# M2 and later (M1: dotprod). Everything runs here.
export DELTAFIN_AARCH64_EXPECT_FEATURES=dotprod,i8mm,bf16
run max deltafin_kernels
run max deltafin_k3 text:: generate:: sampling:: model::kda:: model::mla:: model::moe:: \
  model::attn_res:: model::situ:: model::norm:: model::router:: model::linear:: model::state:: \
  model::profile::
run max tokenizer_goldens
run max chat_goldens
run max oracle_llama
# `cortex-a72`: Armv8.0-A, NEON only, so any optional-feature fallback runs (and an optional
# instruction used without its runtime check would fault): the kernels, and the default
# engine's forward pass against llama.cpp's greedy ids.
export DELTAFIN_AARCH64_EXPECT_FEATURES=none
run cortex-a72 deltafin_kernels
run cortex-a72 oracle_llama default_engine_within_bound_of_llama_cpp
echo "aarch64: done in $(($(date +%s) - started)) s (build $((built - started)) s)"
