#!/usr/bin/env python3
"""Fallback tiny K3 checkpoint writer (numpy only), in the real release layout.

Used only to develop/check the llama.cpp oracle pipeline without the Rust synthesizer
(`cargo xtask synth`). Layout follows docs/K3.md §3: `config.json` (the real config with
scaled dims), one shard per layer (`model-NNNNN-of-NNNNNN.safetensors`, layer L in shard
L+1), then a shard with embed/lm_head/final norms, then two tiny vision/projector shards,
`model.safetensors.index.json`, `tiktoken.model`, `tokenizer_config.json`. Every text
tensor name starts with `language_model.`. Experts are MXFP4 (U8 codes + E8M0 scales).

    python k3_synth_py.py --out DIR [--seed N]
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import struct
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets" / "kimi"

DIMS = dict(hidden=48, layers=14, vocab=163840, dense_inter=96, kda_heads=4, kda_head_dim=16,
            conv_kernel=4, mla_heads=4, q_lora=32, kv_lora=32, qk_nope=16, qk_rope=8, v_head=16,
            experts=16, top_k=4, shared_experts=2, latent=32, moe_inter=32, attn_res_block=12)


def is_mla(d: dict, l: int) -> bool:
    return l % 4 == 3 or l + 1 == d["layers"]


def scaled_config(d: dict) -> dict:
    c = json.loads((ASSETS / "k3-config.json").read_text())
    t = c["text_config"]
    t.update(hidden_size=d["hidden"], num_hidden_layers=d["layers"], vocab_size=d["vocab"],
             intermediate_size=d["dense_inter"], num_attention_heads=d["mla_heads"],
             num_key_value_heads=d["mla_heads"], q_lora_rank=d["q_lora"], kv_lora_rank=d["kv_lora"],
             qk_nope_head_dim=d["qk_nope"], qk_rope_head_dim=d["qk_rope"], v_head_dim=d["v_head"],
             num_experts=d["experts"], num_experts_per_token=d["top_k"],
             num_shared_experts=d["shared_experts"], routed_expert_hidden_size=d["latent"],
             moe_intermediate_size=d["moe_inter"], attn_res_block_size=d["attn_res_block"])
    la = t["linear_attn_config"]
    la.update(num_heads=d["kda_heads"], head_dim=d["kda_head_dim"], short_conv_kernel_size=d["conv_kernel"],
              full_attn_layers=[l + 1 for l in range(d["layers"]) if is_mla(d, l)],
              kda_layers=[l + 1 for l in range(d["layers"]) if not is_mla(d, l)])
    return c


def a_log_stored_len(heads: int) -> int:
    """The reference's A_log storage (docs/K3.md §3.2): one entry per KDA head, zero-padded to a
    multiple of 128 (so 4 heads are stored as [128], 96 as [128], 160 as [256])."""
    return -(-heads // 128) * 128


def layer_specs(d: dict, l: int) -> list[tuple[str, list[int], str]]:
    D, P = d["hidden"], d["kda_heads"] * d["kda_head_dim"]
    H, hd = d["mla_heads"], d["qk_nope"] + d["qk_rope"]
    p = f"language_model.model.layers.{l}."
    s = [(p + "input_layernorm.weight", [D], "BF16"), (p + "post_attention_layernorm.weight", [D], "BF16"),
         (p + "self_attention_res_norm.weight", [D], "BF16"), (p + "mlp_res_norm.weight", [D], "BF16"),
         (p + "self_attention_res_proj.weight", [1, D], "BF16"), (p + "mlp_res_proj.weight", [1, D], "BF16")]
    a = p + "self_attn."
    if is_mla(d, l):
        s += [(a + "q_a_proj.weight", [d["q_lora"], D], "BF16"), (a + "q_a_layernorm.weight", [d["q_lora"]], "BF16"),
              (a + "q_b_proj.weight", [H * hd, d["q_lora"]], "BF16"),
              (a + "kv_a_proj_with_mqa.weight", [d["kv_lora"] + d["qk_rope"], D], "BF16"),
              (a + "kv_a_layernorm.weight", [d["kv_lora"]], "BF16"),
              (a + "kv_b_proj.weight", [H * (d["qk_nope"] + d["v_head"]), d["kv_lora"]], "BF16"),
              (a + "g_proj.weight", [H * d["v_head"], D], "BF16"), (a + "o_proj.weight", [D, H * d["v_head"]], "BF16")]
    else:
        K = d["conv_kernel"]
        s += [(a + f"{x}_proj.weight", [P, D], "BF16") for x in "qkv"]
        s += [(a + f"{x}_conv1d.weight", [P, 1, K], "F32") for x in "qkv"]
        s += [(a + "f_a_proj.weight", [d["kda_head_dim"], D], "BF16"), (a + "f_b_proj.weight", [P, d["kda_head_dim"]], "BF16"),
              (a + "b_proj.weight", [d["kda_heads"], D], "BF16"), (a + "A_log", [a_log_stored_len(d["kda_heads"])], "F32"),
              (a + "dt_bias", [P], "F32"), (a + "o_norm.weight", [d["kda_head_dim"]], "F32"),
              (a + "g_proj.weight", [P, D], "BF16"), (a + "o_proj.weight", [D, P], "BF16")]
    if l == 0:
        F = d["dense_inter"]
        s += [(p + "mlp.gate_proj.weight", [F, D], "BF16"), (p + "mlp.up_proj.weight", [F, D], "BF16"),
              (p + "mlp.down_proj.weight", [D, F], "BF16")]
    else:
        m = p + "block_sparse_moe."
        Lr, F, Fs, E = d["latent"], d["moe_inter"], d["moe_inter"] * d["shared_experts"], d["experts"]
        s += [(m + "gate.weight", [E, D], "BF16"), (m + "gate.e_score_correction_bias", [E], "F32"),
              (m + "routed_expert_down_proj.weight", [Lr, D], "BF16"),
              (m + "routed_expert_up_proj.weight", [D, Lr], "BF16"),
              (m + "routed_expert_norm.weight", [Lr], "BF16"),
              (m + "shared_experts.gate_proj.weight", [Fs, D], "BF16"),
              (m + "shared_experts.up_proj.weight", [Fs, D], "BF16"),
              (m + "shared_experts.down_proj.weight", [D, Fs], "BF16")]
        for e in sorted(range(E), key=str):  # release order: string order of expert ids
            for w, (rows, cols) in (("w1", (F, Lr)), ("w2", (Lr, F)), ("w3", (F, Lr))):
                s += [(m + f"experts.{e}.{w}.weight_packed", [rows, cols // 2], "U8"),
                      (m + f"experts.{e}.{w}.weight_scale", [rows, cols // 32], "U8")]
    return s


def values(name: str, shape: list[int], dtype: str, d: dict, rng: np.random.Generator) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "U8":
        if name.endswith("weight_packed"):
            return rng.integers(0, 256, n, dtype=np.uint8)
        cols = shape[1] * 32
        base = int(round(np.log2((1 / np.sqrt(cols)) / np.sqrt(8.5625 * 1.75)))) + 127
        return (base - 1 + rng.integers(0, 3, n)).astype(np.uint8)
    if name.endswith("A_log"):
        v = np.zeros(n, np.float32)
        v[: d["kda_heads"]] = np.log1p(3 * rng.random(d["kda_heads"]))
        return v
    if name.endswith("dt_bias"):
        return (-1.5 + rng.uniform(-0.5, 0.5, n)).astype(np.float32)
    if name.endswith("conv1d.weight"):
        v = rng.uniform(-1, 1, shape) * np.sqrt(3) * 0.5
        v[..., -1] = 1 + rng.uniform(-0.25, 0.25, v[..., -1].shape)
        return v.astype(np.float32).ravel()
    if name.endswith("e_score_correction_bias"):
        return rng.permutation(np.linspace(-0.2, 0.2, n)).astype(np.float32)
    std = None
    if name.endswith("res_proj.weight"):
        std = 1 / np.sqrt(d["hidden"])
    elif len(shape) == 1:
        return (1 + rng.uniform(-0.1, 0.1, n)).astype(np.float32)
    elif name.endswith("embed_tokens.weight"):
        std = 1.0
    elif name.endswith("lm_head.weight"):
        std = 4 / np.sqrt(d["hidden"])
    else:
        std = 1 / np.sqrt(shape[1])
        if name.endswith("o_proj.weight") or name.endswith("routed_expert_up_proj.weight") or (
                name.endswith("down_proj.weight") and "routed_expert_down_proj" not in name):
            std /= np.sqrt(d["attn_res_block"])
    return (rng.uniform(-1, 1, n) * np.sqrt(3) * std).astype(np.float32)


def to_bytes(v: np.ndarray, dtype: str) -> bytes:
    if dtype == "U8":
        return v.astype(np.uint8).tobytes()
    if dtype == "F32":
        return v.astype("<f4").tobytes()
    u = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")  # round to nearest even
    return r.tobytes()


def write_shard(path: Path, specs, d: dict, seed: int) -> int:
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, shape, dtype in specs:
        rng = np.random.default_rng([seed] + list(name.encode()))
        b = to_bytes(values(name, shape, dtype, d, rng), dtype)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return off


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    d = copy.deepcopy(DIMS)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    D = d["hidden"]
    shards = [layer_specs(d, l) for l in range(d["layers"])]
    shards.append([("language_model.model.embed_tokens.weight", [d["vocab"], D], "BF16"),
                   ("language_model.lm_head.weight", [d["vocab"], D], "BF16"),
                   ("language_model.model.norm.weight", [D], "BF16"),
                   ("language_model.model.output_attn_res_norm.weight", [D], "BF16"),
                   ("language_model.model.output_attn_res_proj.weight", [1, D], "BF16")])
    shards.append([("mm_projector.post_norm.weight", [D], "BF16")])
    shards.append([("vision_tower.encoder.final_layernorm.weight", [16], "BF16")])
    n = len(shards)
    weight_map, total = {}, 0
    for i, specs in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:06d}.safetensors"
        total += write_shard(out / fname, specs, d, args.seed)
        weight_map.update({s[0]: fname for s in specs})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(scaled_config(d), indent=2) + "\n")
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, out / f)
    print(f"wrote {n} shards, {total} tensor bytes to {out}")


if __name__ == "__main__":
    main()
