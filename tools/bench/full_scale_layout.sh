#!/usr/bin/env bash
# The full-scale layout benchmark (not in CI; docs/PERFORMANCE.md, "Full-scale layout").
#
# On the real K3 release layout at full scale as sparse files (`cargo xtask synth-layout`:
# 96 shards, 497,220 tensors, 1.42 TiB of tensor bytes left as holes, ≈ 130 MB on disk), runs
# `deltafin doctor` (with the run's budget and spine), `deltafin setup --dry-run` and
# `setup --check`, then one
# `deltafin run --memory-budget-gb BUDGET_GB --spine bf16 --max-new TOKENS --stats` after
# dropping the page cache, under /usr/bin/time -v, and prints: load time, peak RSS against the
# budget, spine and expert bytes read per forward pass against what the config predicts, and
# seconds per token. Every weight reads as zero, so tokens are meaningless; the sizes are real.
#
#   tools/bench/full_scale_layout.sh
#   LAYOUT=/work/k3-layout BUDGET_GB=16 TOKENS=2 tools/bench/full_scale_layout.sh
#
# Env: LAYOUT (/work/k3-layout; written when it has no config.json), BIN
# (target/release/deltafin), XTASK (target/release/xtask), BUDGET_GB (16), TOKENS (2),
# PROMPT ("Hello"), OUT (a new directory under /tmp: every command's output), KEEP (1: keep
# OUT; the layout is always kept).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LAYOUT=${LAYOUT:-/work/k3-layout}
BIN=${BIN:-$ROOT/target/release/deltafin}
XTASK=${XTASK:-$ROOT/target/release/xtask}
BUDGET_GB=${BUDGET_GB:-16}
TOKENS=${TOKENS:-2}
PROMPT=${PROMPT:-Hello}
OUT=${OUT:-$(mktemp -d /tmp/deltafin-full-scale.XXXXXX)}
mkdir -p "$OUT"
[ -x "$BIN" ] || { echo "no release binary at $BIN: cargo build --release -p deltafin-cli" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "/usr/bin/time (GNU time) is needed for the peak RSS" >&2; exit 2; }

if [ ! -f "$LAYOUT/config.json" ]; then
    [ -x "$XTASK" ] || { echo "no xtask at $XTASK: cargo build --release -p xtask" >&2; exit 2; }
    echo "== writing the full-scale layout into $LAYOUT"
    "$XTASK" synth-layout --out "$LAYOUT" | tail -n 1
fi
echo "== layout: $(du -sh --apparent-size "$LAYOUT" | cut -f1) apparent, $(du -sh "$LAYOUT" | cut -f1) on disk; $(df -h --output=avail "$LAYOUT" | tail -n 1 | tr -d ' ') free"

step() { # step NAME CMD...: run, keep its output, print its exit status and last lines
    local name=$1
    shift
    set +e
    "$@" > "$OUT/$name.out" 2>&1
    local rc=$?
    set -e
    echo "== $name: exit $rc"
    tail -n "${TAIL:-6}" "$OUT/$name.out" | sed 's/^/   /'
}

TAIL=40 step doctor "$BIN" doctor --model-root "$LAYOUT" --memory-budget-gb "$BUDGET_GB" --spine bf16
TAIL=20 step setup-dry-run "$BIN" setup --dry-run --model-root "$LAYOUT"
TAIL=20 step setup-check "$BIN" setup --check --model-root "$LAYOUT"

if sync && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then
    echo "== page cache dropped"
else
    echo "== the page cache could not be dropped (not root): the run may read cached pages"
fi
set +e
K3_EXPERT_HEAT=off /usr/bin/time -v "$BIN" run --model-root "$LAYOUT" \
    --memory-budget-gb "$BUDGET_GB" --spine bf16 --max-new "$TOKENS" --stats \
    --prompt "$PROMPT" > "$OUT/run.stdout" 2> "$OUT/run.stderr"
RC=$?
set -e
echo "== run: exit $RC"
grep -E '^\[deltafin\]|^deltafin:|^\[stats\] (load|spine|experts hits|memory)|Maximum resident|Elapsed' \
    "$OUT/run.stderr" | sed 's/^/   /'

summary() { # the figures of one run's outputs
python3 - "$LAYOUT/config.json" "$OUT/run.stderr" "$OUT/run.stdout" "$BUDGET_GB" <<'EOF'
import json, re, sys
cfg = json.load(open(sys.argv[1]))
t = cfg.get("text_config", cfg)
err = open(sys.argv[2]).read()
out = open(sys.argv[3]).read()  # `--stats` writes its per-token lines to stdout
budget = float(sys.argv[4]) * 1e9
layers = t["num_hidden_layers"]
dense = t.get("first_k_dense_replace", 0)
top_k = t["num_experts_per_token"]
f, lr = t["moe_intermediate_size"], t["routed_expert_hidden_size"]
group = t["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
expert = 3 * (f * lr // 2 + f * lr // group)  # MXFP4 codes + E8M0 scales, docs/K3.md §3.4
moe_layers = layers - dense
def field(pat, cast=float):
    m = re.search(pat, err)
    return cast(m.group(1)) if m else None
load = field(r"load=([0-9.]+)s")
rss_kb = field(r"Maximum resident set size \(kbytes\): (\d+)", int)
gens = re.findall(r"\[stats\] generated=(\d+) elapsed=([0-9.]+)s", out)
passes = field(r"\[stats\] spine streamed_layers=\d+ passes=(\d+)", int)
spine_read = field(r"\[stats\] spine .* bytes_read=(\d+)", int)
per_pass = field(r"streamed \(([0-9.]+) GB read per forward pass", float)
experts_read = field(r"\[stats\] experts hits=.* bytes_read=(\d+)", int)
print("== summary")
print(f"   load: {load} s (startup line)")
m = re.search(r"\[stats\] load: .*", err)
if m:
    print("   " + m.group(0))
if rss_kb is not None:
    rss = rss_kb * 1024
    print(f"   peak RSS: {rss/1e9:.3f} GB against a {budget/1e9:.1f} GB budget: {rss/budget:.3f} x (limit 1.05)")
if passes:
    print(f"   forward passes: {passes} (one prefill, then decode)")
if spine_read is not None and passes:
    print(f"   spine read: {spine_read/1e9:.3f} GB, {spine_read/passes/1e9:.3f} GB per pass; the plan predicts {per_pass} GB per pass")
if experts_read is not None and passes:
    print(f"   experts read: {experts_read/1e9:.3f} GB, {experts_read/passes/1e9:.3f} GB per pass; a decode token needs at most {moe_layers} MoE layers x {top_k} experts x {expert} B = {moe_layers*top_k*expert/1e9:.3f} GB (fewer with cache hits)")
if len(gens) >= 2:
    (n0, e0), (n1, e1) = gens[0], gens[-1]
    n0, n1, e0, e1 = int(n0), int(n1), float(e0), float(e1)
    if n1 > n0:
        print(f"   decode: {(e1-e0)/(n1-n0):.2f} s per token (tokens {n0}..{n1}); first token after {e0:.2f} s")
elif gens:
    print(f"   first token after {float(gens[0][1]):.2f} s")
m = re.search(r"stop=\S+ generated=(\d+) prefill=([0-9.]+)s .* decode=([0-9.]+) token/s", err)
if m:
    d = float(m.group(3))
    print(f"   prefill {float(m.group(2)):.1f} s; decode {d:.4f} token/s" + (f" ({1/d:.1f} s per token)" if d > 0 else ""))
EOF
}
summary
echo "== outputs in $OUT"
[ "${KEEP:-1}" = 1 ] || rm -rf "$OUT"
exit $RC
