#!/usr/bin/env python3
"""deltafin vs llama.cpp (CPU), same synthesized K3 checkpoint, same threads, same prompts.

The checkpoint is converted once with llama.cpp's own K3 rules (tools/oracle/k3_gguf_convert.py,
bf16 spine, MXFP4 experts: the formats deltafin reads). Two measurements, each alternated
A B B A over `--rounds` rounds so drift in machine load hits both engines alike:

  decode   short prompt, then `--decode-tokens` greedy tokens one at a time; tokens/s over the
           decode steps (the first step, which includes the prefill, is excluded on both sides)
  prefill  one prompt of each `--prefill-tokens` length (several may be given, e.g.
           `--prefill-tokens 512 4096 16384`); prompt tokens/s. llama.cpp takes the prompt in
           one `eval` with `--ubatch`-token micro-batches (its default 512; one n×n batch would
           need n² attention scores per head); deltafin in one `run` with `--state-cache off`,
           so no stored prefix state is restored

deltafin is measured with each spine of `--spines` (default bf16, the format llama.cpp reads;
`--spines bf16 int8` adds the default row-int8 spine, which needs `convert-spine-int8` first),
every spine in each deltafin turn of every round.

deltafin runs as `deltafin run --events-jsonl` (times from its `prefill_done` and `decode_step`
events, i.e. the forward passes, no process start-up); llama.cpp runs in-process through
llama-cpp-python (`Llama.eval` timed with perf_counter). Both engines must produce the same
greedy ids on the decode prompt; a mismatch is reported (the oracle tests bound the numerics).

Output: a table and a JSON record (`--json PATH`) with the medians and the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "oracle"))

DECODE_PROMPT = "The capital of France is"
PARAGRAPH = (
    "Kimi K3 is a mixture-of-experts language model whose routed experts are stored in MXFP4 "
    "while the attention, the latent projections and the shared experts stay in bf16. A decode "
    "step reads every spine matrix once and the sixteen chosen experts of each layer; a prefill "
    "reads each matrix once for the whole prompt, so it is bound by arithmetic, not by memory. "
)


def deltafin_run(binary: Path, root: Path, prompt: str, max_new: int, threads: int,
                 extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        ev = Path(d) / "events.jsonl"
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        cmd = [str(binary), "run", "--model-root", str(root), "--prompt", prompt,
               "--max-new", str(max_new), "--events-jsonl", str(ev), "--state-cache", "off",
               *extra]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        events = [json.loads(line) for line in ev.read_text().splitlines() if line.strip()]
    prefill = [e for e in events if e.get("event") == "prefill_done"]
    steps = [e for e in events if e.get("event") == "decode_step"]
    if not prefill:
        raise SystemExit(f"deltafin wrote no prefill_done event: {cmd}")
    return {
        "prompt_tokens": prefill[0]["prompt_tokens"],
        "prefill_s": prefill[0]["duration_ns"] / 1e9,
        "ids": [e["token_id"] for e in steps],
        "decode_s": [e["duration_ns"] / 1e9 for e in steps[1:]],
    }


def cpu_flags() -> str:
    """The CPU's model name and the SIMD features the kernels choose between."""
    name, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "?":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    want = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni"]
    return f"{name}; " + " ".join(f for f in want if f in flags)


class Llama:
    """One llama.cpp context. llama-cpp-python 0.3.36 fills `scores` only with
    `logits_all=True`, so the decode context keeps every row's logits (one row per decode
    step, the same work as llama.cpp's own decode) while the prefill context computes the
    last row only, as llama.cpp's prompt processing does."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, logits_all: bool, ubatch: int):
        from llama_cpp import Llama as L
        self.llm = L(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, ubatch),
                     logits_all=logits_all, n_threads=threads, n_threads_batch=threads,
                     flash_attn=False, seed=0, verbose=False)

    def tokens(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=False)

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t

    def decode(self, ids: list[int], n: int) -> dict:
        import numpy as np
        llm = self.llm
        llm.reset()
        llm.eval(ids)
        out, times = [], []
        for i in range(n):
            cur = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            tok = int(np.argmax(cur))
            out.append(tok)
            if i + 1 == n:
                break
            t = time.perf_counter()
            llm.eval([tok])
            times.append(time.perf_counter() - t)
        return {"ids": out, "decode_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-root", type=Path, required=True, help="synthesized K3 checkpoint")
    ap.add_argument("--deltafin", type=Path, required=True, help="release deltafin binary")
    ap.add_argument("--gguf", type=Path, help="GGUF path (converted from --model-root if absent)")
    ap.add_argument("--llama-src", type=Path, required=True, help="vendored llama.cpp (for gguf-py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[512],
                    help="prompt lengths to prefill (each measured in every round)")
    ap.add_argument("--ubatch", type=int, default=512, help="llama.cpp micro-batch (n_ubatch)")
    ap.add_argument("--rounds", type=int, default=2, help="A B B A rounds")
    ap.add_argument("--spines", nargs="+", default=["bf16"], choices=["bf16", "int8"],
                    help="deltafin spine formats to measure (each in every deltafin turn)")
    ap.add_argument("--deltafin-arg", action="append", default=[],
                    help="extra argument for `deltafin run` (repeatable), e.g. --spine=bf16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    gguf = args.gguf or Path(tempfile.gettempdir()) / f"{args.model_root.name}.bf16.gguf"
    if not gguf.exists():
        import k3_gguf_convert as conv
        print(f"converting {args.model_root} -> {gguf} (bf16 spine, MXFP4 experts)", flush=True)
        conv.convert(args.model_root, gguf, "bf16", experts_f32=False, llama_src=args.llama_src)

    n_ctx = max(1024, max(args.prefill_tokens) + 64)
    llama = Llama(gguf, args.threads, n_ctx, logits_all=False, ubatch=args.ubatch)
    llama_dec = Llama(gguf, args.threads, 1024, logits_all=True, ubatch=args.ubatch)
    # Prompts of exactly each --prefill-tokens llama tokens, rebuilt as text both engines encode.
    prompts = {}
    for n in args.prefill_tokens:
        text = PARAGRAPH
        while len(llama.tokens(text)) < n + 8:
            text += PARAGRAPH
        words = text.split(" ")
        while len(llama.tokens(" ".join(words))) > n:
            words.pop()
        prompts[n] = " ".join(words)
    short_ids = llama.tokens(DECODE_PROMPT)

    rec = {"threads": args.threads, "decode_tokens": args.decode_tokens, "ubatch": args.ubatch,
           "prefill_tokens": [len(llama.tokens(p)) for p in prompts.values()], "rounds": []}
    spines = args.spines
    # A spine named through --deltafin-arg (the older spelling) selects that one spine.
    rest = []
    it = iter(args.deltafin_arg)
    for a in it:
        if a.startswith("--spine="):
            spines = [a.split("=", 1)[1]]
        elif a == "--spine":
            spines = [next(it, "bf16")]
        else:
            rest.append(a)
    args.deltafin_arg = rest
    ours_dec = {sp: [] for sp in spines}
    theirs_dec = []
    ours_pre = {sp: {n: [] for n in prompts} for sp in spines}
    theirs_pre = {n: [] for n in prompts}
    ids_match = {sp: True for sp in spines}
    ours_ids = {}
    for r in range(args.rounds):
        order = ["deltafin", "llama", "llama", "deltafin"]
        for who in order:
            if who == "deltafin":
                for sp in spines:
                    extra = [f"--spine={sp}", *args.deltafin_arg]
                    d = deltafin_run(args.deltafin, args.model_root, DECODE_PROMPT,
                                     args.decode_tokens, args.threads, extra)
                    ours_dec[sp].append(len(d["decode_s"]) / sum(d["decode_s"]))
                    ours_ids[sp] = d["ids"]
                    for n, prompt in prompts.items():
                        ids = llama.tokens(prompt)
                        p = deltafin_run(args.deltafin, args.model_root, prompt, 1, args.threads,
                                         extra)
                        if p["prompt_tokens"] != len(ids):
                            raise SystemExit(f"prompt token counts differ: deltafin "
                                             f"{p['prompt_tokens']}, llama.cpp {len(ids)}")
                        ours_pre[sp][n].append(p["prompt_tokens"] / p["prefill_s"])
            else:
                d = llama_dec.decode(short_ids, args.decode_tokens)
                theirs_dec.append(len(d["decode_s"]) / sum(d["decode_s"]))
                theirs_ids = d["ids"]
                for n, prompt in prompts.items():
                    ids = llama.tokens(prompt)
                    theirs_pre[n].append(len(ids) / llama.prefill(ids))
            print(f"round {r + 1} {who}: load {os.getloadavg()[0]:.2f}", flush=True)
        for sp in spines:
            if ours_ids[sp] != theirs_ids:
                ids_match[sp] = False
                a, b = ours_ids[sp], theirs_ids
                div = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                rec.setdefault("first_divergence", {})[sp] = {
                    "step": div, "deltafin": a[div:div + 4], "llama": b[div:div + 4]}
        rec["rounds"].append({
            "deltafin_decode_tps": {sp: v[-2:] for sp, v in ours_dec.items()},
            "llama_decode_tps": theirs_dec[-2:],
            "deltafin_prefill_tps": {sp: {str(n): v[-2:] for n, v in per.items()}
                                     for sp, per in ours_pre.items()},
            "llama_prefill_tps": {str(n): v[-2:] for n, v in theirs_pre.items()},
            "load": os.getloadavg()[0]})
    med = statistics.median
    rec.update({
        "cpu_flags": cpu_flags(),
        "llama_decode_tps": med(theirs_dec),
        "spines": {sp: {
            "decode_tps": med(ours_dec[sp]),
            "decode_ratio": med(ours_dec[sp]) / med(theirs_dec),
            "prefill": {str(n): {"deltafin_tps": med(ours_pre[sp][n]),
                                 "llama_tps": med(theirs_pre[n]),
                                 "ratio": med(ours_pre[sp][n]) / med(theirs_pre[n])}
                        for n in prompts},
            "greedy_ids_match": ids_match[sp]} for sp in spines},
    })
    print(f"threads={args.threads} decode_tokens={args.decode_tokens} "
          f"prefill_tokens={rec['prefill_tokens']} rounds={args.rounds} (A B B A); "
          f"CPU: {rec['cpu_flags']}")
    print(f"{'':22} {'deltafin':>12} {'llama.cpp':>12} {'ratio':>8}")
    for sp, v in rec["spines"].items():
        print(f"{'decode, ' + sp + ' spine':22} {v['decode_tps']:>10.2f}/s "
              f"{rec['llama_decode_tps']:>10.2f}/s {v['decode_ratio']:>7.2f}x")
        for n, p in v["prefill"].items():
            print(f"{'prefill ' + n + ', ' + sp:22} {p['deltafin_tps']:>10.1f}/s "
                  f"{p['llama_tps']:>10.1f}/s {p['ratio']:>7.2f}x")
        print(f"greedy ids identical on the decode prompt ({sp} spine): {v['greedy_ids_match']}")
    if "first_divergence" in rec:
        print(f"first divergence: {rec['first_divergence']}")
    if args.json:
        args.json.write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
