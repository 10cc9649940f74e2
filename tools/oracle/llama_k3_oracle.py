#!/usr/bin/env python3
"""llama.cpp (via llama-cpp-python) as an independent oracle for deltafin's K3 forward pass.

Pipeline:
  1. synthesize a tiny K3 checkpoint in the release layout (`cargo xtask synth`, or the numpy
     fallback `k3_synth_py.py`), or take an existing one (`--ckpt`);
  2. convert it to GGUF with llama.cpp's own K3 rules (`k3_gguf_convert.py`, a numpy port of
     the vendored `conversion/kimi_k3.py`), twice: the canonical MXFP4 file and a file whose
     routed experts hold the same values as F32 (the primary oracle: no Q8_0 activations);
  3. run both on the CPU with llama-cpp-python (f32 weights, f32 KV cache, no flash attention,
     no BOS, logits for every position) on fixed token-id prompts, greedy-decode, and write
     fixtures to tests/fixtures/oracle/.

See tools/oracle/README.md ("llama.cpp K3 forward oracle") for the one-command rebuild and
the fixture schema.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import k3_gguf_convert as conv  # noqa: E402
from k3_numpy_ref import K3Ref  # noqa: E402
import llama_layer_dump  # noqa: E402

FRANCE = [1008, 10484, 318, 15383, 387]
# docs/K3.md §8.1 golden: one user turn "Hello", thinking off, generation prompt (specials)
CHAT = [163587, 2778, 6244, 878, 2482, 1, 163589, 19180, 163588, 2778, 163589, 163586, 163587, 2778,
        6244, 878, 69702, 1, 163589, 163587, 12092, 163589]
SHORT_TEXT = "Hello, world! Kimi K3 runs on a CPU: 2 cores, 93 layers, 你好世界."
LONG_TEXT = (
    "The delta rule updates a matrix-valued state one token at a time: it first decays every row "
    "by a learned gate, then writes the new value along the normalised key, scaled by a write "
    "strength beta. Multi-head latent attention caches only a 512-wide latent and a 64-wide key "
    "tail per token, so a million-token context fits in memory. 混合注意力 keeps decoding fast.\n"
    "def forward(x):\n    return lm_head(norm(mix(x)))\n"
    "Attention residuals mix snapshots across depth, never across time."
)
LONG_LEN = 100
N_GREEDY = 20
N_TOP = 20
KNOWN_DIFFERENCES = [
    "llama.cpp computes every activation in f32 (weights here are the checkpoint's exact BF16/MXFP4 "
    "values widened to f32); the HF reference rounds Linear outputs, residual adds and RMS results to BF16.",
    "MLA q_a_layernorm / kv_a_layernorm use eps = rms_norm_eps = 1e-5 in llama.cpp; the reference uses 1e-6.",
    "KDA q/k L2 norm: llama.cpp build_gdn_l2_norm = x / sqrt(sum(x^2) + 1e-5); the reference (FLA l2norm) "
    "uses 1e-6 inside the root.",
    "Router renormalisation: llama.cpp divides by the selected-score sum clamped to >= 6.103515625e-5; "
    "the reference adds 1e-20.",
    "MoE weighted sum order: llama.cpp sums the selected experts in its own top-k order (ggml_argsort_top_k) "
    "and applies the routing weight to the f32 expert output.",
    "AttnRes key: llama.cpp fuses w_norm * w_proj into one f32 vector at conversion (res_score), then scores "
    "rms_norm(V) . u; the reference multiplies the normalised candidate by w_norm then w_proj.",
    "MLA runs in llama.cpp's absorbed form (k_b/v_b split of kv_b_proj, 1/sqrt(qk_nope+qk_rope) scale); "
    "KDA prefill uses ggml's chunked gated-delta-net, decode the recurrent form.",
    "Primary GGUF stores the routed experts as F32 holding the exact MXFP4 values; the canonical MXFP4 GGUF "
    "(llama.cpp's own output) makes ggml quantize the expert activations to Q8_0, see mxfp4_gguf per prompt.",
    "ssm_a = -exp(A_log[:n_head]) is computed in float64 and rounded to f32 by the converter port "
    "(torch's f32 exp may differ by 1 ulp).",
]


def sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def k3_encoding(ckpt: Path):
    import base64
    import tiktoken
    ranks = {}
    for line in (ckpt / "tiktoken.model").read_text().splitlines():
        if line:
            t, r = line.split()
            ranks[base64.b64decode(t)] = int(r)
    return tiktoken.Encoding(name="kimi-k3", pat_str=conv.kimi_pat_str(), mergeable_ranks=ranks, special_tokens={})


def prompts(ckpt: Path) -> list[dict]:
    enc = k3_encoding(ckpt)
    assert enc.encode("Hello world", disallowed_special=()) == [19180, 2695], "tokenizer golden (docs/K3.md §7.6)"
    short = enc.encode(SHORT_TEXT, disallowed_special=())
    long = enc.encode(LONG_TEXT, disallowed_special=())
    if len(long) < LONG_LEN:
        raise ValueError(f"LONG_TEXT encodes to {len(long)} ids, need {LONG_LEN}")
    return [
        {"name": "france", "source": "raw ids of 'The capital of France is' (docs/K3.md §7.6)", "ids": FRANCE},
        {"name": "short_text", "source": f"tiktoken K3 encoding, specials off: {SHORT_TEXT!r}", "ids": short},
        {"name": "long_text", "source": f"first {LONG_LEN} ids of the K3 encoding (specials off) of: {LONG_TEXT!r}",
         "ids": long[:LONG_LEN]},
        {"name": "chat", "source": "XTML golden of docs/K3.md §8.1 (special ids 163586-163589)", "ids": CHAT},
    ]


class Runner:
    """One llama.cpp context over a GGUF; f32 KV cache, no flash attention, all logits."""

    def __init__(self, gguf_path: Path, n_ctx: int, n_threads: int):
        from llama_cpp import Llama
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                         logits_all=True, n_threads=n_threads, n_threads_batch=n_threads,
                         type_k=0, type_v=0, flash_attn=False, seed=0, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def run(self, ids: list[int], n_greedy: int) -> dict:
        llm = self.llm
        llm.reset()  # clears the hybrid (KV + recurrent) memory
        llm.eval(ids)
        n = len(ids)
        all_logits = np.array(llm.scores[:n], dtype=np.float32)
        steps, cur = [], all_logits[-1].copy()
        last = cur.copy()
        for _ in range(n_greedy):
            order = np.argsort(-cur, kind="stable")
            top1 = int(np.argmax(cur))  # first index of the maximum (torch argmax semantics)
            top2 = int(order[1] if order[0] == top1 else order[0])
            steps.append({"id": top1, "logit": float(cur[top1]), "second_id": top2,
                          "second_logit": float(cur[top2]), "margin": float(cur[top1] - cur[top2])})
            llm.eval([top1])
            cur = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        return {"all_logits": all_logits, "last": last, "steps": steps}


DUMP_PATTERN = r"(prefix_sum_attn|l_out)-\d+|result_norm"


def dump_order(name: str) -> tuple:
    base, _, layer = name.rpartition("-")
    return (int(layer), base != "prefix_sum_attn") if layer.isdigit() else (1 << 30, False)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def synthesize(args) -> tuple[Path, str]:
    out = Path(args.work) / f"ckpt-{args.synth}-{args.preset}-seed{args.seed}"
    if args.synth == "rust":
        cmd = ["cargo", "xtask", "synth", "--preset", args.preset, "--seed", str(args.seed), "--out", str(out)]
        shown = f"cargo xtask synth --preset {args.preset} --seed {args.seed} --out DIR"
        subprocess.run(["nice", "-n", "5", *cmd], cwd=args.synth_repo, check=True)
    else:
        cmd = [sys.executable, str(HERE / "k3_synth_py.py"), "--out", str(out), "--seed", str(args.seed)]
        shown = f"python tools/oracle/k3_synth_py.py --seed {args.seed} --out DIR"
        subprocess.run(cmd, check=True)
    return out, shown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, help="existing checkpoint dir (skips synthesis)")
    ap.add_argument("--ckpt-command", default=None, help="generator command to record with --ckpt")
    ap.add_argument("--synth", choices=["rust", "py"], default="rust")
    ap.add_argument("--synth-repo", type=Path, default=REPO, help="workspace where `cargo xtask synth` runs")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("ORACLE_WORK", "/tmp/deltafin-oracle")))
    ap.add_argument("--out-dir", type=Path, default=REPO / "tests" / "fixtures" / "oracle")
    ap.add_argument("--name", default="llama_k3_tiny")
    ap.add_argument("--llama-src", type=Path, default=conv.DEFAULT_LLAMA_SRC)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    synth_commit = None
    if args.ckpt:
        ckpt, gen_cmd = args.ckpt, args.ckpt_command or f"(given checkpoint {args.ckpt})"
    else:
        ckpt, gen_cmd = synthesize(args)
        if args.synth == "rust":
            r = subprocess.run(["git", "-C", str(args.synth_repo), "rev-parse", "HEAD"], capture_output=True, text=True)
            synth_commit = r.stdout.strip() or None
    conv.load_gguf(args.llama_src)

    g_primary = args.work / f"{args.name}.f32experts.gguf"
    g_mxfp4 = args.work / f"{args.name}.mxfp4.gguf"
    conv.convert(ckpt, g_primary, "f32", experts_f32=True, llama_src=args.llama_src)
    conv.convert(ckpt, g_mxfp4, "f32", experts_f32=False, llama_src=args.llama_src)

    import llama_cpp
    ps = prompts(ckpt)
    n_ctx = 256
    primary = Runner(g_primary, n_ctx, args.threads)
    second = Runner(g_mxfp4, n_ctx, args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ref = K3Ref(ckpt)
    out_prompts = []
    for p in ps:
        r = primary.run(p["ids"], N_GREEDY)
        m = second.run(p["ids"], N_GREEDY)
        greedy = [s["id"] for s in r["steps"]]
        # independent float64 numpy forward (k3_numpy_ref.py) on the checkpoint itself
        trace: dict = {}
        ref_lcpp = ref.forward(p["ids"], eps_mla=1e-5, eps_l2=1e-5, router_clamp=True, trace=trace)
        dumps = llama_layer_dump.capture(g_primary, p["ids"], DUMP_PATTERN, args.threads)
        layers = []
        for key in sorted(dumps, key=dump_order):
            v = dumps[key].reshape(len(p["ids"]), -1)
            layers.append({"name": key, "last": [float(x) for x in v[-1]],
                           "rel_l2_vs_numpy_all_positions": rel_l2(v, trace[key])})
        ref_eps = ref.forward(p["ids"] + greedy[:-1], eps_mla=1e-6, eps_l2=1e-6, router_clamp=False)
        n = len(p["ids"])
        ref_greedy = [int(np.argmax(row)) for row in ref_eps[n - 1:]]
        last = r["last"]
        order = np.argsort(-last, kind="stable")[:N_TOP]
        fname = f"{args.name}.{p['name']}.logits.f32.gz"
        raw = last.astype("<f4").tobytes()
        with gzip.GzipFile(args.out_dir / fname, "wb", mtime=0) as f:
            f.write(raw)
        al = r["all_logits"]
        out_prompts.append({
            "name": p["name"],
            "source": p["source"],
            "ids": p["ids"],
            "last_logits": {"file": fname, "encoding": "gzip of little-endian f32", "len": int(last.size),
                            "sha256_raw": hashlib.sha256(raw).hexdigest()},
            "last_logits_l2": float(np.linalg.norm(last.astype(np.float64))),
            "top20": [[int(i), float(last[i])] for i in order],
            "positions": [{"argmax": int(np.argmax(row)), "max": float(row.max()),
                           "l2": float(np.linalg.norm(row.astype(np.float64)))} for row in al],
            "greedy": {"ids": [s["id"] for s in r["steps"]], "steps": r["steps"]},
            "numpy_crosscheck": {
                "what": "tools/oracle/k3_numpy_ref.py, float64, reads the checkpoint (not the GGUF)",
                "last_logits_rel_l2_llama_eps": rel_l2(last, ref_lcpp[-1]),
                "positions_argmax_match_llama_eps": [int(np.argmax(x)) for x in ref_lcpp]
                == [int(np.argmax(x)) for x in al],
                "last_logits_rel_l2_reference_eps_vs_llama": rel_l2(last, ref_eps[n - 1]),
                "reference_eps_greedy_ids_teacher_forced": ref_greedy,
                "reference_eps_same_greedy": ref_greedy == greedy,
            },
            "llama_intermediates": {
                "what": "llama.cpp graph nodes (cb_eval) for the prompt batch, primary GGUF: prefix_sum_attn-L = AttnRes "
                        "partial sum P after layer L's attention, l_out-L = P after layer L, result_norm = final "
                        "RMS-normed mixed state; 'last' is the last prompt position",
                "nodes": layers,
            },
            "mxfp4_gguf": {
                "greedy_ids": [s["id"] for s in m["steps"]],
                "same_greedy": [s["id"] for s in m["steps"]] == [s["id"] for s in r["steps"]],
                "last_logits_rel_l2": rel_l2(m["last"], last),
                "all_positions_max_rel_l2": max(rel_l2(a, b) for a, b in zip(m["all_logits"], al)),
            },
        })
        print(f"{p['name']}: {len(p['ids'])} ids, greedy {out_prompts[-1]['greedy']['ids']}, "
              f"min margin {min(s['margin'] for s in r['steps']):.4f}, "
              f"numpy rel_l2 {out_prompts[-1]['numpy_crosscheck']['last_logits_rel_l2_llama_eps']:.3e} / "
              f"ref-eps {out_prompts[-1]['numpy_crosscheck']['last_logits_rel_l2_reference_eps_vs_llama']:.3e} "
              f"same greedy {out_prompts[-1]['numpy_crosscheck']['reference_eps_same_greedy']}, "
              f"max node rel_l2 {max(x['rel_l2_vs_numpy_all_positions'] for x in layers):.3e}, "
              f"mxfp4 rel_l2 {out_prompts[-1]['mxfp4_gguf']['last_logits_rel_l2']:.3e}")

    cfg = json.loads((ckpt / "config.json").read_text())
    fixture = {
        "schema": "deltafin.oracle.llama_k3/1",
        "description": "llama.cpp kimi-k3 (llama-cpp-python CPU, f32) logits and greedy ids on a synthetic K3 checkpoint",
        "checkpoint": {
            "generator_command": gen_cmd,
            "preset": args.preset if not args.ckpt else None,
            "seed": args.seed if not args.ckpt else None,
            "config_sha256": sha256_file(ckpt / "config.json"),
            "index_sha256": sha256_file(ckpt / "model.safetensors.index.json"),
            "safetensors_sha256": {f.name: sha256_file(f) for f in sorted(ckpt.glob("*.safetensors"))},
            "synth_repo_commit": synth_commit,
            "hidden_size": cfg["text_config"]["hidden_size"],
            "num_hidden_layers": cfg["text_config"]["num_hidden_layers"],
            "vocab_size": cfg["text_config"]["vocab_size"],
        },
        "oracle": {
            "llama_cpp_python": llama_cpp.__version__,
            "gguf_py": "vendored in llama-cpp-python " + llama_cpp.__version__ + " (vendor/llama.cpp/gguf-py)",
            "converter": "tools/oracle/k3_gguf_convert.py (numpy port of vendor/llama.cpp/conversion/kimi_k3.py)",
            "primary_gguf": {"spine": "F32 (exact BF16 values)", "routed_experts": "F32 (exact MXFP4 values)",
                             "sha256": sha256_file(g_primary)},
            "mxfp4_gguf": {"spine": "F32", "routed_experts": "MXFP4 (lossless repack)", "sha256": sha256_file(g_mxfp4)},
            "runtime": {"device": "CPU", "n_threads": args.threads, "n_ctx": n_ctx, "n_batch": n_ctx,
                        "n_ubatch": n_ctx, "kv_cache_type": "f32", "flash_attn": False, "bos_added": False,
                        "prompt_eval": "one batch (all prompt ids), then one id per greedy step"},
            "greedy_rule": "argmax, first index of the maximum",
        },
        "known_differences": KNOWN_DIFFERENCES,
        "tolerances_suggested": {"greedy_ids": "identical", "last_logits_rel_l2": 1e-3},
        "prompts": out_prompts,
    }
    path = args.out_dir / f"{args.name}.json"
    path.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
