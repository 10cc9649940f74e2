//! DSpark weights, loading (`model.safetensors`, §9.2 names) and the forward pass (§9.3):
//! the context path (taps → context_proj → context_norm → per-layer `ĉ`, `k_rope`), the
//! query block through the dense MLA decoder layers, K3's `lm_head`, the serial Markov head
//! and the confidence head. Activations are f32 with f32 accumulation over bf16 weights.

use super::DsparkError;
use super::config::{BLOCK, DsparkConfig};
use super::rope::Yarn;
use crate::dense::{SwiGlu, add_into, matmul, rms_rows};
use crate::tensors::Tensors;
use deltafin_k3::model::K3Model;
use deltafin_k3::model::linear::Linear;
use deltafin_kernels::{argmax, matvec_bf16, rms_norm, softmax_inplace};
use deltafin_tensor::{Bf16Matrix, SafetensorsFile};
use rayon::prelude::*;
use std::path::Path;

/// One dense decoder layer (`layers.N.*`).
#[derive(Clone, Debug)]
pub struct DsparkLayer {
    /// `input_layernorm.weight` `[D]`.
    pub input_layernorm: Vec<f32>,
    /// `post_attention_layernorm.weight` `[D]`.
    pub post_attention_layernorm: Vec<f32>,
    /// `self_attn.q_a_proj.weight` `[q_lora, D]`.
    pub q_a_proj: Bf16Matrix,
    /// `self_attn.q_a_layernorm.weight` `[q_lora]`.
    pub q_a_layernorm: Vec<f32>,
    /// `self_attn.q_b_proj.weight` `[H·(nope+rope), q_lora]`, per head `[nope | rope]`.
    pub q_b_proj: Bf16Matrix,
    /// `self_attn.kv_a_proj_with_mqa.weight` `[kv_lora + rope, D]`.
    pub kv_a_proj: Bf16Matrix,
    /// `self_attn.kv_a_layernorm.weight` `[kv_lora]`.
    pub kv_a_layernorm: Vec<f32>,
    /// `self_attn.kv_b_proj.weight` `[H·(nope+v), kv_lora]`, per head `[key | value]` rows.
    pub kv_b_proj: Bf16Matrix,
    /// `self_attn.o_proj.weight` `[D, H·v]`.
    pub o_proj: Bf16Matrix,
    /// `mlp.*` (SwiGLU, `[F, D]` up, `[D, F]` down).
    pub mlp: SwiGlu,
}

/// The DSpark drafter's own weights (K3's embedding and `lm_head` are used at run time).
#[derive(Clone, Debug)]
pub struct DsparkModel {
    /// The configuration.
    pub config: DsparkConfig,
    /// `context_proj.weight` `[D, taps·D_target]`.
    pub context_proj: Bf16Matrix,
    /// `context_norm.weight` `[D]`.
    pub context_norm: Vec<f32>,
    /// Decoder layers.
    pub layers: Vec<DsparkLayer>,
    /// `final_norm.weight` `[D]`.
    pub final_norm: Vec<f32>,
    /// `markov_head.markov_w1.weight` `[V, r]` (previous-token embedding).
    pub markov_w1: Bf16Matrix,
    /// `markov_head.markov_w2.weight` `[V, r]` (logit-bias projection).
    pub markov_w2: Bf16Matrix,
    /// `confidence_head.proj.weight` `[D (+ r)]` and `.bias`, when enabled.
    pub confidence: Option<(Vec<f32>, f32)>,
    /// YaRN frequencies of the rotary tail.
    pub rope: Yarn,
}

/// Per-layer cached context keys: `ĉ` rows (`kv_lora`) and rotated `k_rope` rows (`rope`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerContext {
    /// `ĉ` rows, oldest first.
    pub latent: Vec<f32>,
    /// Rotated `k_rope` rows, oldest first.
    pub rope: Vec<f32>,
}

/// The injected target context: one entry per K3 position, per decoder layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DsparkContext {
    /// Positions held (0 … positions − 1).
    pub positions: usize,
    /// One per decoder layer.
    pub layers: Vec<LayerContext>,
}

/// The drafter's outputs for one query block.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockOutput {
    /// `h_r = RMS(final residual; final_norm)`, one row of D per requested row.
    pub hidden: Vec<f32>,
    /// `logits_r = lm_head · h_r`, one row of V per requested row.
    pub logits: Vec<f32>,
}

/// A proposal: drafted tokens and the confidence logit of each.
#[derive(Clone, Debug, PartialEq)]
pub struct Proposal {
    /// `draft_r`, r = 0 … k − 1.
    pub tokens: Vec<u32>,
    /// `c_r` (acceptance logits; empty when the head is disabled).
    pub confidence: Vec<f32>,
}

/// The sizes the tensor shapes are built from (docs/K3.md §9.2).
struct Sizes {
    d: usize,
    f: usize,
    h: usize,
    ql: usize,
    kvl: usize,
    dn: usize,
    dr: usize,
    dv: usize,
    v: usize,
    r: usize,
    /// `taps·D_target`: the width of `context_proj`'s input.
    taps: usize,
    /// The confidence head's input width (`D`, plus `r` with the Markov feature).
    confidence: usize,
}

impl Sizes {
    fn of(c: &DsparkConfig) -> Sizes {
        Sizes {
            d: c.hidden_size,
            f: c.intermediate_size,
            h: c.num_attention_heads,
            ql: c.q_lora_rank,
            kvl: c.kv_lora_rank,
            dn: c.qk_nope_head_dim,
            dr: c.qk_rope_head_dim,
            dv: c.v_head_dim,
            v: c.vocab_size,
            r: c.markov_rank,
            taps: c.target_layer_ids.len() * c.target_hidden_size,
            confidence: c.hidden_size
                + if c.confidence_head_with_markov {
                    c.markov_rank
                } else {
                    0
                },
        }
    }
}

/// The checkpoint's tensors (name, shape) for `c` (docs/K3.md §9.2), including the
/// `embed_tokens.weight` copy.
pub fn expected_tensors(c: &DsparkConfig) -> Vec<(String, Vec<usize>)> {
    let s = Sizes::of(c);
    let mut out: Vec<(String, Vec<usize>)> = vec![
        ("context_proj.weight".into(), vec![s.d, s.taps]),
        ("context_norm.weight".into(), vec![s.d]),
        ("embed_tokens.weight".into(), vec![s.v, s.d]),
    ];
    for n in 0..c.num_hidden_layers {
        for (name, shape) in [
            ("input_layernorm.weight", vec![s.d]),
            ("post_attention_layernorm.weight", vec![s.d]),
            ("self_attn.q_a_proj.weight", vec![s.ql, s.d]),
            ("self_attn.q_a_layernorm.weight", vec![s.ql]),
            ("self_attn.q_b_proj.weight", vec![s.h * (s.dn + s.dr), s.ql]),
            (
                "self_attn.kv_a_proj_with_mqa.weight",
                vec![s.kvl + s.dr, s.d],
            ),
            ("self_attn.kv_a_layernorm.weight", vec![s.kvl]),
            (
                "self_attn.kv_b_proj.weight",
                vec![s.h * (s.dn + s.dv), s.kvl],
            ),
            ("self_attn.o_proj.weight", vec![s.d, s.h * s.dv]),
            ("mlp.gate_proj.weight", vec![s.f, s.d]),
            ("mlp.up_proj.weight", vec![s.f, s.d]),
            ("mlp.down_proj.weight", vec![s.d, s.f]),
        ] {
            out.push((format!("layers.{n}.{name}"), shape));
        }
    }
    out.push(("final_norm.weight".into(), vec![s.d]));
    out.push(("markov_head.markov_w1.weight".into(), vec![s.v, s.r]));
    out.push(("markov_head.markov_w2.weight".into(), vec![s.v, s.r]));
    if c.enable_confidence_head {
        out.push(("confidence_head.proj.weight".into(), vec![1, s.confidence]));
        out.push(("confidence_head.proj.bias".into(), vec![1]));
    }
    out
}

impl DsparkModel {
    /// Load `dir/config.json` and `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<DsparkModel, DsparkError> {
        let config = DsparkConfig::from_file(&dir.join("config.json"))?;
        let file = SafetensorsFile::open(dir.join("model.safetensors"))?;
        Self::from_safetensors(config, &file)
    }

    /// Build from an opened checkpoint. Every tensor is checked (dtype BF16, shape from the
    /// config); `embed_tokens.weight` (a copy of K3's) is checked if present and not used;
    /// any other tensor is an error.
    pub fn from_safetensors(
        config: DsparkConfig,
        file: &SafetensorsFile,
    ) -> Result<DsparkModel, DsparkError> {
        let c = &config;
        let s = Sizes::of(c);
        let mut rd = Tensors::<DsparkError>::new(file);
        let context_proj = rd.matrix("context_proj.weight", s.d, s.taps)?;
        let context_norm = rd.vector("context_norm.weight", &[s.d])?;
        if rd.has("embed_tokens.weight") {
            rd.check("embed_tokens.weight", &[s.v, s.d])?;
        }
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for n in 0..c.num_hidden_layers {
            let p = |t: &str| format!("layers.{n}.{t}");
            layers.push(DsparkLayer {
                input_layernorm: rd.vector(&p("input_layernorm.weight"), &[s.d])?,
                post_attention_layernorm: rd
                    .vector(&p("post_attention_layernorm.weight"), &[s.d])?,
                q_a_proj: rd.matrix(&p("self_attn.q_a_proj.weight"), s.ql, s.d)?,
                q_a_layernorm: rd.vector(&p("self_attn.q_a_layernorm.weight"), &[s.ql])?,
                q_b_proj: rd.matrix(&p("self_attn.q_b_proj.weight"), s.h * (s.dn + s.dr), s.ql)?,
                kv_a_proj: rd.matrix(
                    &p("self_attn.kv_a_proj_with_mqa.weight"),
                    s.kvl + s.dr,
                    s.d,
                )?,
                kv_a_layernorm: rd.vector(&p("self_attn.kv_a_layernorm.weight"), &[s.kvl])?,
                kv_b_proj: rd.matrix(
                    &p("self_attn.kv_b_proj.weight"),
                    s.h * (s.dn + s.dv),
                    s.kvl,
                )?,
                o_proj: rd.matrix(&p("self_attn.o_proj.weight"), s.d, s.h * s.dv)?,
                mlp: SwiGlu::read(&mut rd, &p("mlp"), s.d, s.f)?,
            });
        }
        let final_norm = rd.vector("final_norm.weight", &[s.d])?;
        let markov_w1 = rd.matrix("markov_head.markov_w1.weight", s.v, s.r)?;
        let markov_w2 = rd.matrix("markov_head.markov_w2.weight", s.v, s.r)?;
        let confidence = if c.enable_confidence_head {
            let w = rd.vector("confidence_head.proj.weight", &[1, s.confidence])?;
            let b = rd.vector("confidence_head.proj.bias", &[1])?;
            Some((w, b[0]))
        } else {
            None
        };
        rd.finish("DSpark")?;
        let rope = Yarn::new(&c.rope, s.dr, c.qk_head_dim());
        Ok(DsparkModel {
            config,
            context_proj,
            context_norm,
            layers,
            final_norm,
            markov_w1,
            markov_w2,
            confidence,
            rope,
        })
    }

    /// Check that this drafter fits `k3` (hidden sizes, vocabulary, depth, tap layers).
    pub fn check_target(&self, k3: &K3Model) -> Result<(), DsparkError> {
        let c = &self.config;
        let kd = &k3.dims;
        let bad = |m: String| Err(DsparkError::Target(m));
        if c.target_hidden_size != kd.hidden_size || c.hidden_size != kd.hidden_size {
            return bad(format!(
                "hidden_size {} / target_hidden_size {}, K3 hidden size {}",
                c.hidden_size, c.target_hidden_size, kd.hidden_size
            ));
        }
        if c.vocab_size != kd.vocab_size {
            return bad(format!(
                "vocab_size {}, K3 vocabulary {}",
                c.vocab_size, kd.vocab_size
            ));
        }
        if c.target_num_hidden_layers != k3.layers.len() {
            return bad(format!(
                "target_num_hidden_layers {}, K3 has {} layers",
                c.target_num_hidden_layers,
                k3.layers.len()
            ));
        }
        Ok(())
    }

    /// An empty context for this drafter.
    pub fn new_context(&self) -> DsparkContext {
        DsparkContext {
            positions: 0,
            layers: vec![LayerContext::default(); self.layers.len()],
        }
    }

    /// Append `n` K3 positions to `ctx`: `rows` holds, per position, the bf16 taps after
    /// `target_layer_ids` concatenated (`taps·D_target` values).
    /// `ctx_p = RMS(context_proj · f_p; context_norm)`; per layer `[c | kr] = kv_a_proj ctx_p`,
    /// `ĉ = RMS(c; kv_a_layernorm)`, `k_rope = YaRN(kr, p)`.
    pub fn append_context(&self, ctx: &mut DsparkContext, rows: &[f32], n: usize) {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let (kvl, dr) = (c.kv_lora_rank, c.qk_rope_head_dim);
        let x = rms_rows(
            &matmul(&self.context_proj, rows, n),
            &self.context_norm,
            eps,
        );
        for (layer, lc) in self.layers.iter().zip(ctx.layers.iter_mut()) {
            let kv = matmul(&layer.kv_a_proj, &x, n);
            for (i, row) in kv.chunks_exact(kvl + dr).enumerate() {
                let mut chat = vec![0f32; kvl];
                rms_norm(&row[..kvl], &layer.kv_a_layernorm, eps, &mut chat);
                lc.latent.extend_from_slice(&chat);
                let mut kr = row[kvl..].to_vec();
                self.rope.rotate(&mut kr, ctx.positions + i);
                lc.rope.extend_from_slice(&kr);
            }
        }
        ctx.positions += n;
    }

    /// Run the query block `[anchor, mask × (BLOCK − 1)]` at positions `ctx.positions …`
    /// through the decoder layers (every row attends to every context entry and every block
    /// row), then `final_norm` and K3's `lm_head` for the first `rows` rows (at most
    /// `BLOCK`; the others' logits are not needed for fewer drafts). `embed` is K3's
    /// embedding.
    pub fn block(
        &self,
        embed: &Bf16Matrix,
        lm_head: &Linear,
        ctx: &DsparkContext,
        anchor: u32,
        rows: usize,
    ) -> BlockOutput {
        let c = &self.config;
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        let mut x = Vec::with_capacity(BLOCK * d);
        for r in 0..BLOCK {
            let tok = if r == 0 { anchor } else { c.mask_token_id };
            x.extend(embed.row(tok as usize).iter().map(|v| v.to_f32()));
        }
        for (layer, lc) in self.layers.iter().zip(&ctx.layers) {
            let y = rms_rows(&x, &layer.input_layernorm, eps);
            add_into(&mut x, &self.attention(layer, lc, ctx.positions, &y));
            let y = rms_rows(&x, &layer.post_attention_layernorm, eps);
            add_into(&mut x, &layer.mlp.forward(&y, BLOCK));
        }
        let rows = rows.min(BLOCK);
        let hidden = rms_rows(&x[..rows * d], &self.final_norm, eps);
        let logits = lm_head.apply_host(&hidden, rows);
        BlockOutput { hidden, logits }
    }

    /// MLA over the block (absorbed form): keys are the `n` context entries and the block's
    /// own `BLOCK` rows, with no mask. Returns `BLOCK` rows of D (after `o_proj`).
    fn attention(&self, w: &DsparkLayer, lc: &LayerContext, n: usize, y: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let (h, dn, dr, dv, kvl, eps) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
            c.rms_norm_eps,
        );
        let dq = dn + dr;
        let cq = rms_rows(&matmul(&w.q_a_proj, y, BLOCK), &w.q_a_layernorm, eps);
        let mut q = matmul(&w.q_b_proj, &cq, BLOCK);
        // Block keys: ĉ and rotated k_rope at positions n … n + BLOCK − 1.
        let kv = matmul(&w.kv_a_proj, y, BLOCK);
        let mut block_latent = vec![0f32; BLOCK * kvl];
        let mut block_rope = vec![0f32; BLOCK * dr];
        for (r, row) in kv.chunks_exact(kvl + dr).enumerate() {
            rms_norm(
                &row[..kvl],
                &w.kv_a_layernorm,
                eps,
                &mut block_latent[r * kvl..(r + 1) * kvl],
            );
            let kr = &mut block_rope[r * dr..(r + 1) * dr];
            kr.copy_from_slice(&row[kvl..]);
            self.rope.rotate(kr, n + r);
        }
        // Key s: context entry s < n, else block row s − n.
        let latent = |s: usize| match s.checked_sub(n) {
            None => &lc.latent[s * kvl..(s + 1) * kvl],
            Some(r) => &block_latent[r * kvl..(r + 1) * kvl],
        };
        let rope = |s: usize| match s.checked_sub(n) {
            None => &lc.rope[s * dr..(s + 1) * dr],
            Some(r) => &block_rope[r * dr..(r + 1) * dr],
        };
        for (r, qrow) in q.chunks_exact_mut(h * dq).enumerate() {
            for head in qrow.chunks_exact_mut(dq) {
                self.rope.rotate(&mut head[dn..], n + r);
            }
        }
        let keys = n + BLOCK;
        let kvb = w.kv_b_proj.data();
        let scale = self.rope.attn_scale;
        let mut heads = vec![0f32; BLOCK * h * dv];
        heads
            .par_chunks_mut(dv)
            .enumerate()
            .for_each(|(task, out)| {
                let (r, hd) = (task / h, task % h);
                let qh = &q[(r * h + hd) * dq..(r * h + hd + 1) * dq];
                let base = hd * (dn + dv) * kvl;
                // q̃ = B_hᴷᵀ qn  (kv_lora)
                let mut qt = vec![0f32; kvl];
                for (i, &qi) in qh[..dn].iter().enumerate() {
                    let row = &kvb[base + i * kvl..base + (i + 1) * kvl];
                    for (a, b) in qt.iter_mut().zip(row) {
                        *a += qi * b.to_f32();
                    }
                }
                let mut scores: Vec<f32> = (0..keys)
                    .map(|s| {
                        let a: f32 = qt.iter().zip(latent(s)).map(|(x, y)| x * y).sum();
                        let b: f32 = qh[dn..].iter().zip(rope(s)).map(|(x, y)| x * y).sum();
                        (a + b) * scale
                    })
                    .collect();
                softmax_inplace(&mut scores);
                let mut mix = vec![0f32; kvl];
                for (s, &p) in scores.iter().enumerate() {
                    for (m, &l) in mix.iter_mut().zip(latent(s)) {
                        *m += p * l;
                    }
                }
                // o = B_hⱽ · mix
                for (j, o) in out.iter_mut().enumerate() {
                    let row = &kvb[base + (dn + j) * kvl..base + (dn + j + 1) * kvl];
                    *o = row.iter().zip(&mix).map(|(a, b)| a.to_f32() * b).sum();
                }
            });
        matmul(&w.o_proj, &heads, BLOCK)
    }

    /// The Markov bias `markov_w2 · markov_w1[prev]` (V values).
    pub fn markov_bias(&self, prev: u32) -> Vec<f32> {
        let e = self.markov_w1.row_f32(prev as usize);
        let mut bias = vec![0f32; self.markov_w2.rows()];
        matvec_bf16(&self.markov_w2, &e, &mut bias);
        bias
    }

    /// Apply the serial Markov head and the confidence head to a block's outputs:
    /// `prev₀ = anchor`, `draft_r = argmax(logits_r + markov_w2 · markov_w1[prev_r])`,
    /// `c_r = w_c · [h_r ; markov_w1[prev_r]] + b_c`. At most `max` drafts.
    pub fn heads(&self, out: &BlockOutput, anchor: u32, max: usize) -> Proposal {
        let (d, v) = (self.config.hidden_size, self.config.vocab_size);
        let mut prev = anchor;
        let mut p = Proposal {
            tokens: Vec::new(),
            confidence: Vec::new(),
        };
        let rows = out.logits.len() / v.max(1);
        for r in 0..max.min(rows) {
            let mut row = self.markov_bias(prev);
            row.iter_mut()
                .zip(&out.logits[r * v..(r + 1) * v])
                .for_each(|(b, &l)| *b += l);
            if let Some((w, b)) = &self.confidence {
                let h = &out.hidden[r * d..(r + 1) * d];
                let mut c: f32 = w.iter().zip(h).map(|(a, b)| a * b).sum();
                if w.len() > d {
                    let e = self.markov_w1.row(prev as usize);
                    c += w[d..]
                        .iter()
                        .zip(e)
                        .map(|(a, b)| a * b.to_f32())
                        .sum::<f32>();
                }
                p.confidence.push(c + b);
            }
            let t = argmax(&row).unwrap_or(0) as u32;
            p.tokens.push(t);
            prev = t;
        }
        p
    }

    /// Draft up to `max` tokens after `anchor` given the context.
    pub fn propose(
        &self,
        embed: &Bf16Matrix,
        lm_head: &Linear,
        ctx: &DsparkContext,
        anchor: u32,
        max: usize,
    ) -> Proposal {
        let out = self.block(embed, lm_head, ctx, anchor, max);
        self.heads(&out, anchor, max)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dense::reference::{mv, rms, row, swiglu};
    use deltafin_tensor::bf16;

    /// xorshift64, uniform in [-1, 1).
    pub(crate) struct Rng(pub u64);
    impl Rng {
        pub fn f(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
        pub fn matrix(&mut self, rows: usize, cols: usize, gain: f32) -> Bf16Matrix {
            let s = gain * (3.0 / cols as f32).sqrt();
            let v: Vec<bf16> = (0..rows * cols)
                .map(|_| bf16::from_f32(self.f() * s))
                .collect();
            Bf16Matrix::from_values(rows, cols, &v).unwrap()
        }
        pub fn around_one(&mut self, n: usize) -> Vec<f32> {
            (0..n)
                .map(|_| bf16::from_f32(1.0 + 0.2 * self.f()).to_f32())
                .collect()
        }
    }

    pub(crate) fn small_config() -> DsparkConfig {
        DsparkConfig {
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            q_lora_rank: 12,
            kv_lora_rank: 8,
            qk_nope_head_dim: 4,
            qk_rope_head_dim: 4,
            v_head_dim: 6,
            vocab_size: 50,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 1 << 20,
            target_hidden_size: 16,
            target_num_hidden_layers: 4,
            target_layer_ids: vec![0, 2],
            mask_token_id: 49,
            bos_token_id: 1,
            eos_token_id: 2,
            pad_token_id: 48,
            markov_rank: 3,
            enable_confidence_head: true,
            confidence_head_with_markov: true,
            rope: crate::dspark::rope::tests::real(),
        }
    }

    /// A random DSpark for `small_config()` with K3-side embedding and lm_head.
    pub(crate) fn random_dspark(seed: u64) -> (DsparkModel, Bf16Matrix, Linear) {
        let c = small_config();
        let mut rng = Rng(seed);
        let s = Sizes::of(&c);
        let layers = (0..c.num_hidden_layers)
            .map(|_| DsparkLayer {
                input_layernorm: rng.around_one(s.d),
                post_attention_layernorm: rng.around_one(s.d),
                q_a_proj: rng.matrix(s.ql, s.d, 1.0),
                q_a_layernorm: rng.around_one(s.ql),
                q_b_proj: rng.matrix(s.h * (s.dn + s.dr), s.ql, 2.0),
                kv_a_proj: rng.matrix(s.kvl + s.dr, s.d, 2.0),
                kv_a_layernorm: rng.around_one(s.kvl),
                kv_b_proj: rng.matrix(s.h * (s.dn + s.dv), s.kvl, 1.0),
                o_proj: rng.matrix(s.d, s.h * s.dv, 1.0),
                mlp: SwiGlu {
                    gate_proj: rng.matrix(s.f, s.d, 1.0),
                    up_proj: rng.matrix(s.f, s.d, 1.0),
                    down_proj: rng.matrix(s.d, s.f, 1.0),
                },
            })
            .collect();
        let model = DsparkModel {
            context_proj: rng.matrix(s.d, s.taps, 1.0),
            context_norm: rng.around_one(s.d),
            layers,
            final_norm: rng.around_one(s.d),
            markov_w1: rng.matrix(s.v, s.r, 1.0),
            markov_w2: rng.matrix(s.v, s.r, 2.0),
            confidence: Some(((0..s.confidence).map(|_| rng.f() * 0.3).collect(), 0.25)),
            rope: Yarn::new(&c.rope, s.dr, c.qk_head_dim()),
            config: c,
        };
        let embed = rng.matrix(s.v, s.d, 3.0);
        let lm_head = Linear::from(rng.matrix(s.v, s.d, 3.0));
        (model, embed, lm_head)
    }

    fn rot(y: &Yarn, x: &mut [f64], pos: usize) {
        for (i, pair) in x.chunks_exact_mut(2).enumerate() {
            let ang = pos as f64 * y.inv_freq[i];
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * ang.cos() - b * ang.sin();
            pair[1] = a * ang.sin() + b * ang.cos();
        }
    }

    /// f64 reference of §9.3 in the expanded MLA form. Returns (hidden rows, logit rows,
    /// drafts, confidences).
    #[allow(clippy::type_complexity)]
    pub(crate) fn reference(
        m: &DsparkModel,
        embed: &Bf16Matrix,
        lm_head: &Linear,
        taps: &[Vec<f64>],
        anchor: u32,
    ) -> (Vec<Vec<f64>>, Vec<Vec<f64>>, Vec<u32>, Vec<f64>) {
        let c = &m.config;
        let eps = c.rms_norm_eps as f64;
        let (h, dn, dr, dv, kvl) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let n = taps.len();
        let scale = (c.qk_head_dim() as f64).powf(-0.5) * (0.1 * c.rope.factor.ln() + 1.0).powi(2);
        let ctx: Vec<Vec<f64>> = taps
            .iter()
            .map(|f| rms(&mv(&m.context_proj, f), &m.context_norm, eps))
            .collect();
        let mut x: Vec<Vec<f64>> = (0..BLOCK)
            .map(|r| {
                let t = if r == 0 { anchor } else { c.mask_token_id };
                row(embed, t as usize)
            })
            .collect();
        for w in &m.layers {
            // Keys from the context entries (positions 0..n) and the block rows (n..n+B).
            let key_of = |src: &[f64], pos: usize| {
                let kv = mv(&w.kv_a_proj, src);
                let chat = rms(&kv[..kvl], &w.kv_a_layernorm, eps);
                let mut kr = kv[kvl..].to_vec();
                rot(&m.rope, &mut kr, pos);
                let kvb = mv(&w.kv_b_proj, &chat);
                (kvb, kr)
            };
            let ys: Vec<Vec<f64>> = x.iter().map(|r| rms(r, &w.input_layernorm, eps)).collect();
            let mut keys: Vec<(Vec<f64>, Vec<f64>)> =
                ctx.iter().enumerate().map(|(p, e)| key_of(e, p)).collect();
            keys.extend(ys.iter().enumerate().map(|(r, y)| key_of(y, n + r)));
            for (r, y) in ys.iter().enumerate() {
                let cq = rms(&mv(&w.q_a_proj, y), &w.q_a_layernorm, eps);
                let q = mv(&w.q_b_proj, &cq);
                let mut heads = Vec::new();
                for hd in 0..h {
                    let mut qh = q[hd * (dn + dr)..(hd + 1) * (dn + dr)].to_vec();
                    rot(&m.rope, &mut qh[dn..], n + r);
                    let kb = |k: &Vec<f64>| k[hd * (dn + dv)..(hd + 1) * (dn + dv)].to_vec();
                    let mut s: Vec<f64> = keys
                        .iter()
                        .map(|(kvb, kr)| {
                            let kn = kb(kvb);
                            let a: f64 = qh[..dn].iter().zip(&kn[..dn]).map(|(a, b)| a * b).sum();
                            let b: f64 = qh[dn..].iter().zip(kr).map(|(a, b)| a * b).sum();
                            (a + b) * scale
                        })
                        .collect();
                    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    s.iter_mut().for_each(|v| *v = (*v - mx).exp());
                    let z: f64 = s.iter().sum();
                    let mut o = vec![0f64; dv];
                    for (p, (kvb, _)) in s.iter().zip(&keys) {
                        let vh = &kb(kvb)[dn..];
                        o.iter_mut().zip(vh).for_each(|(a, b)| *a += p / z * b);
                    }
                    heads.extend(o);
                }
                let out = mv(&w.o_proj, &heads);
                x[r].iter_mut().zip(&out).for_each(|(a, b)| *a += b);
            }
            for xr in x.iter_mut() {
                let o = swiglu(&w.mlp, &rms(xr, &w.post_attention_layernorm, eps));
                xr.iter_mut().zip(&o).for_each(|(p, b)| *p += b);
            }
        }
        let hidden: Vec<Vec<f64>> = x.iter().map(|r| rms(r, &m.final_norm, eps)).collect();
        let logits: Vec<Vec<f64>> = hidden
            .iter()
            .map(|hr| mv(lm_head.as_bf16().expect("a bf16 lm_head"), hr))
            .collect();
        let (mut drafts, mut conf, mut prev) = (Vec::new(), Vec::new(), anchor);
        for r in 0..BLOCK {
            let e = row(&m.markov_w1, prev as usize);
            let bias = mv(&m.markov_w2, &e);
            let row: Vec<f64> = logits[r].iter().zip(&bias).map(|(a, b)| a + b).collect();
            let best = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            let (w, b) = m.confidence.as_ref().unwrap();
            let feat: Vec<f64> = hidden[r].iter().copied().chain(e).collect();
            conf.push(w.iter().zip(&feat).map(|(a, b)| *a as f64 * b).sum::<f64>() + *b as f64);
            drafts.push(best as u32);
            prev = best as u32;
        }
        (hidden, logits, drafts, conf)
    }

    fn rel(a: &[f32], b: &[f64]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    }

    fn random_taps(seed: u64, n: usize, width: usize) -> Vec<Vec<f64>> {
        let mut rng = Rng(seed);
        (0..n)
            .map(|_| {
                (0..width)
                    .map(|_| bf16::from_f32(rng.f() * 2.0).to_f64())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn block_matches_f64_reference() {
        let (m, embed, lm_head) = random_dspark(17);
        let width = m.context_proj.cols();
        for (n, anchor) in [(1usize, 5u32), (9, 17), (40, 33)] {
            let taps = random_taps(n as u64 + 3, n, width);
            let mut ctx = m.new_context();
            // Feed the context in two pieces: appending is position-exact.
            let flat: Vec<f32> = taps.iter().flatten().map(|&v| v as f32).collect();
            let cut = n / 2;
            m.append_context(&mut ctx, &flat[..cut * width], cut);
            m.append_context(&mut ctx, &flat[cut * width..], n - cut);
            assert_eq!(ctx.positions, n);
            let out = m.block(&embed, &lm_head, &ctx, anchor, BLOCK);
            let (hid, logits, drafts, conf) = reference(&m, &embed, &lm_head, &taps, anchor);
            let d = m.config.hidden_size;
            let v = m.config.vocab_size;
            for r in 0..BLOCK {
                let eh = rel(&out.hidden[r * d..(r + 1) * d], &hid[r]);
                let el = rel(&out.logits[r * v..(r + 1) * v], &logits[r]);
                assert!(
                    eh < 1e-5 && el < 1e-5,
                    "n={n} row {r}: hidden {eh:e} logits {el:e}"
                );
            }
            let p = m.heads(&out, anchor, BLOCK);
            assert_eq!(p.tokens, drafts, "n={n}: Markov-head drafts");
            for (a, b) in p.confidence.iter().zip(&conf) {
                assert!((*a as f64 - b).abs() < 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            }
            // Fewer drafts are a prefix; proposals are deterministic.
            let short = m.propose(&embed, &lm_head, &ctx, anchor, 3);
            assert_eq!(short.tokens, drafts[..3]);
            assert_eq!(m.propose(&embed, &lm_head, &ctx, anchor, BLOCK), p);
        }
    }

    #[test]
    fn real_layout_has_68_tensors_and_the_published_parameter_count() {
        let c =
            DsparkConfig::from_json_str(include_str!("../../../../assets/kimi/dspark-config.json"))
                .unwrap();
        let t = expected_tensors(&c);
        assert_eq!(t.len(), 68);
        let numel = |s: &Vec<usize>| s.iter().product::<usize>();
        let total: usize = t.iter().map(|(_, s)| numel(s)).sum();
        assert_eq!(total, 3_562_312_961);
        let embed = t.iter().find(|(n, _)| n == "embed_tokens.weight").unwrap();
        assert_eq!(total - numel(&embed.1), 2_387_907_841);
        assert!(t.iter().all(|(n, _)| n != "lm_head.weight"));
    }

    #[test]
    fn context_entries_are_rotated_per_position() {
        let (m, _, _) = random_dspark(5);
        let width = m.context_proj.cols();
        let taps = random_taps(1, 2, width);
        let row: Vec<f32> = taps[0].iter().map(|&v| v as f32).collect();
        // The same tap at positions 0 and 1: equal ĉ, k_rope differing by one rotation step.
        let mut ctx = m.new_context();
        m.append_context(&mut ctx, &row, 1);
        m.append_context(&mut ctx, &row, 1);
        let (kvl, dr) = (m.config.kv_lora_rank, m.config.qk_rope_head_dim);
        for lc in &ctx.layers {
            assert_eq!(lc.latent[..kvl], lc.latent[kvl..]);
            let mut k0 = lc.rope[..dr].to_vec();
            m.rope.rotate(&mut k0, 1);
            for (a, b) in k0.iter().zip(&lc.rope[dr..]) {
                assert!((a - b).abs() < 1e-5);
            }
        }
    }
}
