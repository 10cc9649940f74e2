#!/usr/bin/env python3
"""Plain float64 numpy transcription of the K3 forward pass (docs/K3.md §4), used only to
cross-check the llama.cpp oracle on small synthetic checkpoints.

It reads the checkpoint directly (not the GGUF), so it independently checks the GGUF
conversion too. Epsilons are parameters: `eps_mla` (q_a/kv_a norms) and `eps_l2` (KDA q/k
L2 norm) are 1e-6 in the reference and 1e-5 in llama.cpp; `router_clamp` selects
llama.cpp's `max(sum, 6.103515625e-5)` instead of the reference's `sum + 1e-20`.
Sequential recurrent KDA (no chunking), expanded MLA, experts summed in descending
(s + b) order.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from k3_gguf_convert import read_safetensors_header

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def situ(g, u, b1, b2):
    return (b1 * np.tanh(g / b1) * sigmoid(g)) * (b2 * np.tanh(u / b2))


def rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


class K3Ref:
    def __init__(self, ckpt: Path):
        self.t = {}
        for p in sorted(ckpt.glob("model-*.safetensors")):
            for x in read_safetensors_header(p):
                if x.name.startswith("language_model."):
                    self.t[x.name[len("language_model."):]] = x
        c = json.loads((ckpt / "config.json").read_text())["text_config"]
        self.c = c
        self.full = set(l - 1 for l in c["linear_attn_config"]["full_attn_layers"])

    def w(self, name: str) -> np.ndarray:
        return self.t[name].load().astype(np.float64)

    def a_log(self, name: str, heads: int) -> np.ndarray:
        """The first `heads` entries of the zero-padded `A_log` (docs/K3.md §3.2: the reference
        stores one value per KDA head, padded to a multiple of 128, and reads the first
        `num_heads`); a short tensor or non-zero padding is refused, as deltafin's loader does."""
        v = self.w(name).ravel()
        if v.size < heads:
            raise ValueError(f"{name}: {v.size} entries, fewer than the {heads} KDA heads")
        if np.any(v[heads:] != 0):
            raise ValueError(f"{name}: the padding past entry {heads} is not zero")
        return v[:heads]

    def expert(self, l: int, e: int, wid: str) -> np.ndarray:
        p = f"model.layers.{l}.block_sparse_moe.experts.{e}.{wid}."
        pk = self.t[p + "weight_packed"].raw()
        sc = self.t[p + "weight_scale"].raw()
        codes = np.stack([pk & 15, pk >> 4], -1).reshape(pk.shape[0], -1)
        return E2M1[codes] * np.exp2(np.repeat(sc.astype(np.float64), 32, axis=1) - 127)

    def attn_res(self, P, S, wn, wp):
        cands = S + [P]
        u = (wn * wp).ravel()
        scores = np.stack([(V / np.sqrt(np.mean(V * V, -1, keepdims=True) + 1e-5)) @ u for V in cands], 0)
        scores -= scores.max(0, keepdims=True)
        a = np.exp(scores)
        a /= a.sum(0, keepdims=True)
        return sum(a[j][:, None] * V for j, V in enumerate(cands))

    def kda(self, l, y, eps_l2):
        c, la = self.c, self.c["linear_attn_config"]
        # KDA heads come from linear_attn_config, not num_attention_heads (the MLA heads; both
        # are 96 in the release).
        H, d, K = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        p = f"model.layers.{l}.self_attn."
        T = y.shape[0]

        def conv(x, wname):
            wt = self.w(p + wname)[:, 0, :]  # [C, K]
            xp = np.concatenate([np.zeros((K - 1, x.shape[1])), x], 0)
            return silu(sum(wt[:, j] * xp[j:j + T] for j in range(K)))

        q = conv(y @ self.w(p + "q_proj.weight").T, "q_conv1d.weight").reshape(T, H, d)
        k = conv(y @ self.w(p + "k_proj.weight").T, "k_conv1d.weight").reshape(T, H, d)
        v = conv(y @ self.w(p + "v_proj.weight").T, "v_conv1d.weight").reshape(T, H, d)
        z = (y @ self.w(p + "f_a_proj.weight").T) @ self.w(p + "f_b_proj.weight").T + self.w(p + "dt_bias")
        A = np.exp(self.a_log(p + "A_log", H))
        g = la["gate_lower_bound"] * sigmoid(A[None, :, None] * z.reshape(T, H, d))
        alpha = np.exp(g)
        beta = sigmoid(y @ self.w(p + "b_proj.weight").T)  # [T, H]
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps_l2) / np.sqrt(d)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps_l2)
        S = np.zeros((H, d, d))
        o = np.zeros((T, H, d))
        for t in range(T):
            S = alpha[t][:, :, None] * S
            u = beta[t][:, None] * (v[t] - np.einsum("hij,hi->hj", S, k[t]))
            S = S + k[t][:, :, None] * u[:, None, :]
            o[t] = np.einsum("hij,hi->hj", S, q[t])
        r = (y @ self.w(p + "g_proj.weight").T).reshape(T, H, d)
        o = rms(o, self.w(p + "o_norm.weight"), 1e-5) * sigmoid(r)
        return o.reshape(T, H * d) @ self.w(p + "o_proj.weight").T

    def mla(self, l, y, eps_mla):
        c = self.c
        H, dn, dr, dv, kvl = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                              c["v_head_dim"], c["kv_lora_rank"])
        p = f"model.layers.{l}.self_attn."
        T = y.shape[0]
        cq = rms(y @ self.w(p + "q_a_proj.weight").T, self.w(p + "q_a_layernorm.weight"), eps_mla)
        q = (cq @ self.w(p + "q_b_proj.weight").T).reshape(T, H, dn + dr)
        kva = y @ self.w(p + "kv_a_proj_with_mqa.weight").T
        ckv = rms(kva[:, :kvl], self.w(p + "kv_a_layernorm.weight"), eps_mla)
        kt = kva[:, kvl:]
        kv = (ckv @ self.w(p + "kv_b_proj.weight").T).reshape(T, H, dn + dv)
        kn, v = kv[..., :dn], kv[..., dn:]
        k = np.concatenate([kn, np.broadcast_to(kt[:, None, :], (T, H, dr))], -1)
        sc = np.einsum("thd,shd->hts", q, k) / np.sqrt(dn + dr)
        sc = np.where(np.tril(np.ones((T, T), bool))[None], sc, -np.inf)
        sc -= sc.max(-1, keepdims=True)
        pr = np.exp(sc)
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", pr, v).reshape(T, H * dv)
        o = o * sigmoid(y @ self.w(p + "g_proj.weight").T)
        return o @ self.w(p + "o_proj.weight").T

    def moe(self, l, y, router_clamp):
        c = self.c
        b1, b2 = c["activation_situ_beta"], c["activation_situ_linear_beta"]
        p = f"model.layers.{l}.block_sparse_moe."
        s = sigmoid(y @ self.w(p + "gate.weight").T)
        sel_score = s + self.w(p + "gate.e_score_correction_bias")
        xL = y @ self.w(p + "routed_expert_down_proj.weight").T
        r = np.zeros_like(xL)
        ex = {}
        for t in range(y.shape[0]):
            idx = sorted(range(s.shape[1]), key=lambda e: (-sel_score[t, e], e))[: c["num_experts_per_token"]]
            tot = s[t, idx].sum()
            tot = max(tot, 6.103515625e-5) if router_clamp else tot + 1e-20
            for e in idx:
                if e not in ex:
                    ex[e] = (self.expert(l, e, "w1"), self.expert(l, e, "w2"), self.expert(l, e, "w3"))
                w1, w2, w3 = ex[e]
                h = w2 @ situ(w1 @ xL[t], w3 @ xL[t], b1, b2)
                r[t] += s[t, e] / tot * h
        R = rms(r, self.w(p + "routed_expert_norm.weight"), 1e-5) @ self.w(p + "routed_expert_up_proj.weight").T
        sh = situ(y @ self.w(p + "shared_experts.gate_proj.weight").T, y @ self.w(p + "shared_experts.up_proj.weight").T,
                  b1, b2) @ self.w(p + "shared_experts.down_proj.weight").T
        return R + sh

    def forward(self, ids: list[int], eps_mla=1e-6, eps_l2=1e-6, router_clamp=False,
                trace: dict | None = None) -> np.ndarray:
        """Logits [T, vocab] (float64) for every position. If `trace` is a dict, it receives the
        partial sum P after each attention (`prefix_sum_attn-L`) and after each layer
        (`l_out-L`), and the normed final state (`result_norm`), each [T, D] (llama.cpp names)."""
        c = self.c
        eps = c["rms_norm_eps"]
        bs = c["attn_res_block_size"]
        b1, b2 = c["activation_situ_beta"], c["activation_situ_linear_beta"]
        P = self.t["model.embed_tokens.weight"].load()[ids].astype(np.float64)
        S: list[np.ndarray] = []
        for l in range(c["num_hidden_layers"]):
            p = f"model.layers.{l}."
            a = P if not S else self.attn_res(P, S, self.w(p + "self_attention_res_norm.weight"),
                                              self.w(p + "self_attention_res_proj.weight"))
            restart = l % bs == 0
            if restart:
                S.append(P)
            y = rms(a, self.w(p + "input_layernorm.weight"), eps)
            o = self.mla(l, y, eps_mla) if l in self.full else self.kda(l, y, eps_l2)
            P = o if restart else P + o
            if trace is not None:
                trace[f"prefix_sum_attn-{l}"] = P.copy()
            m = self.attn_res(P, S, self.w(p + "mlp_res_norm.weight"), self.w(p + "mlp_res_proj.weight"))
            y = rms(m, self.w(p + "post_attention_layernorm.weight"), eps)
            if l < c["first_k_dense_replace"]:
                f = situ(y @ self.w(p + "mlp.gate_proj.weight").T, y @ self.w(p + "mlp.up_proj.weight").T,
                         b1, b2) @ self.w(p + "mlp.down_proj.weight").T
            else:
                f = self.moe(l, y, router_clamp)
            P = P + f
            if trace is not None:
                trace[f"l_out-{l}"] = P.copy()
        x = self.attn_res(P, S, self.w("model.output_attn_res_norm.weight"), self.w("model.output_attn_res_proj.weight"))
        x = rms(x, self.w("model.norm.weight"), eps)
        if trace is not None:
            trace["result_norm"] = x.copy()
        return x @ self.t["lm_head.weight"].load().astype(np.float64).T
