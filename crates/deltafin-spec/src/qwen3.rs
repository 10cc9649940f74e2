//! The Qwen3 Base draft model (docs/K3.md §10): a pre-norm GQA decoder with per-head q/k
//! RMSNorm before half-split RoPE (θ from the config), SwiGLU MLP, final norm and an output
//! head tied to the embedding (or `lm_head.weight` when untied). Greedy drafting in Qwen's
//! own token space; the K3-tokenizer bridge (re-encoding, §10 steps 1–3) is separate.

use crate::dense::{SwiGlu, add_into, matmul, rms_rows};
use crate::fields::{FieldError, Fields};
use crate::tensors::{TensorIssue, Tensors};
use deltafin_kernels::{argmax, softmax_inplace};
use deltafin_tensor::{Bf16Matrix, SafetensorsFile};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Errors of loading a Qwen3 checkpoint; each names the file, field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum Qwen3Error {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A bad `config.json` field.
    #[error("Qwen3 config.json field `{field}`: {message}")]
    Config { field: String, message: String },
    /// A bad or unexpected tensor.
    #[error("Qwen3 tensor `{tensor}`: {message}")]
    Tensor { tensor: String, message: String },
    /// A safetensors-level error.
    #[error(transparent)]
    Safetensors(#[from] deltafin_tensor::TensorError),
    /// A token id outside the vocabulary.
    #[error("token id {0} is outside the Qwen3 vocabulary")]
    Token(u32),
}

impl From<TensorIssue> for Qwen3Error {
    fn from(e: TensorIssue) -> Self {
        Qwen3Error::Tensor {
            tensor: e.tensor,
            message: e.message,
        }
    }
}

impl From<FieldError> for Qwen3Error {
    fn from(e: FieldError) -> Self {
        Qwen3Error::Config {
            field: e.field,
            message: e.message,
        }
    }
}

/// A validated Qwen3 configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3Config {
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (divides the query heads).
    pub num_key_value_heads: usize,
    /// `head_dim` (even).
    pub head_dim: usize,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f32,
    /// `rope_theta`.
    pub rope_theta: f64,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `tie_word_embeddings`.
    pub tie_word_embeddings: bool,
    /// `bos_token_id`.
    pub bos_token_id: u32,
    /// `eos_token_id`.
    pub eos_token_id: u32,
}

impl Qwen3Config {
    /// Parse `config.json` text; errors name the offending field. Training-only keys
    /// (`attention_dropout`, `initializer_range`, `use_cache`, `transformers_version`,
    /// `max_window_layers` without a sliding window) are read and have no effect.
    pub fn from_json_str(text: &str) -> Result<Qwen3Config, Qwen3Error> {
        let v: Value = serde_json::from_str(text).map_err(|e| Qwen3Error::Config {
            field: "config.json".into(),
            message: format!("invalid JSON: {e}"),
        })?;
        let Value::Object(map) = v else {
            return Err(Qwen3Error::Config {
                field: "config.json".into(),
                message: "expected a JSON object".into(),
            });
        };
        let mut f: Fields<Qwen3Error> = Fields::new("", map);
        let arch = f.take("architectures")?;
        if !arch
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == "Qwen3ForCausalLM"))
        {
            return Err(f.err("architectures", format!("{arch} lacks `Qwen3ForCausalLM`")));
        }
        f.expect_str("model_type", "qwen3")?;
        f.expect_str("hidden_act", "silu")?;
        f.expect_str("torch_dtype", "bfloat16")?;
        f.expect_bool("attention_bias", false)?;
        f.expect_bool("use_sliding_window", false)?;
        for k in ["rope_scaling", "sliding_window"] {
            let v = f.take(k)?;
            if !v.is_null() {
                return Err(f.err(k, format!("{v} is not supported (expected null)")));
            }
        }
        f.f64("attention_dropout")?;
        f.f64("initializer_range")?;
        f.bool("use_cache")?;
        f.string("transformers_version")?;
        f.usize("max_window_layers")?;
        let c = Qwen3Config {
            hidden_size: f.positive("hidden_size")?,
            intermediate_size: f.positive("intermediate_size")?,
            num_hidden_layers: f.positive("num_hidden_layers")?,
            num_attention_heads: f.positive("num_attention_heads")?,
            num_key_value_heads: f.positive("num_key_value_heads")?,
            head_dim: f.positive("head_dim")?,
            vocab_size: f.positive("vocab_size")?,
            rms_norm_eps: f.f64("rms_norm_eps")? as f32,
            rope_theta: f.f64("rope_theta")?,
            max_position_embeddings: f.positive("max_position_embeddings")?,
            tie_word_embeddings: f.bool("tie_word_embeddings")?,
            bos_token_id: f.u32("bos_token_id")?,
            eos_token_id: f.u32("eos_token_id")?,
        };
        if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    c.num_key_value_heads, c.num_attention_heads
                ),
            ));
        }
        if !c.head_dim.is_multiple_of(2) {
            return Err(f.err("head_dim", "must be even (RoPE rotates halves)"));
        }
        if c.rms_norm_eps <= 0.0 {
            return Err(f.err("rms_norm_eps", "must be positive"));
        }
        if c.rope_theta <= 1.0 {
            return Err(f.err("rope_theta", "must exceed 1"));
        }
        f.finish()?;
        Ok(c)
    }
}

/// One decoder layer (`model.layers.N.*`).
#[derive(Clone, Debug)]
pub struct Qwen3Layer {
    /// `input_layernorm.weight` `[D]`.
    pub input_layernorm: Vec<f32>,
    /// `post_attention_layernorm.weight` `[D]`.
    pub post_attention_layernorm: Vec<f32>,
    /// `self_attn.q_proj.weight` `[H·hd, D]`.
    pub q_proj: Bf16Matrix,
    /// `self_attn.k_proj.weight` `[KVH·hd, D]`.
    pub k_proj: Bf16Matrix,
    /// `self_attn.v_proj.weight` `[KVH·hd, D]`.
    pub v_proj: Bf16Matrix,
    /// `self_attn.o_proj.weight` `[D, H·hd]`.
    pub o_proj: Bf16Matrix,
    /// `self_attn.q_norm.weight` `[hd]`.
    pub q_norm: Vec<f32>,
    /// `self_attn.k_norm.weight` `[hd]`.
    pub k_norm: Vec<f32>,
    /// `mlp.*` (SwiGLU, `[F, D]` up, `[D, F]` down).
    pub mlp: SwiGlu,
}

/// A loaded Qwen3 model.
#[derive(Clone, Debug)]
pub struct Qwen3Model {
    /// The configuration.
    pub config: Qwen3Config,
    /// `model.embed_tokens.weight` `[V, D]`.
    pub embed: Bf16Matrix,
    /// Decoder layers.
    pub layers: Vec<Qwen3Layer>,
    /// `model.norm.weight` `[D]`.
    pub norm: Vec<f32>,
    /// The output head: the embedding when tied, else `lm_head.weight`.
    pub lm_head: Bf16Matrix,
    /// RoPE inverse frequencies, `hd/2` of them.
    pub inv_freq: Vec<f64>,
}

/// Per-sequence KV cache: rotated keys and values per layer, `KVH·hd` per position.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Qwen3Cache {
    /// Positions held.
    pub positions: usize,
    /// `(keys, values)` per layer.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl Qwen3Cache {
    /// Drop every position from `len` on.
    pub fn truncate(&mut self, len: usize, kv_width: usize) {
        if len < self.positions {
            for (k, v) in &mut self.layers {
                k.truncate(len * kv_width);
                v.truncate(len * kv_width);
            }
            self.positions = len;
        }
    }
}

impl Qwen3Model {
    /// Load `dir/config.json` and `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Qwen3Model, Qwen3Error> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Qwen3Error::Io {
            path: path.clone(),
            source,
        })?;
        let config = Qwen3Config::from_json_str(&text)?;
        let file = SafetensorsFile::open(dir.join("model.safetensors"))?;
        Self::from_safetensors(config, &file)
    }

    /// Build from an opened checkpoint; every tensor is checked (BF16, shape from the
    /// config) and an unexpected tensor is an error.
    pub fn from_safetensors(
        config: Qwen3Config,
        file: &SafetensorsFile,
    ) -> Result<Qwen3Model, Qwen3Error> {
        let c = &config;
        let (d, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (h, kvh, v) = (c.num_attention_heads, c.num_key_value_heads, c.vocab_size);
        let mut rd = Tensors::<Qwen3Error>::new(file);
        let embed = rd.matrix("model.embed_tokens.weight", v, d)?;
        let mut layers = Vec::new();
        for n in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{n}.{s}");
            layers.push(Qwen3Layer {
                q_proj: rd.matrix(&p("self_attn.q_proj.weight"), h * hd, d)?,
                k_proj: rd.matrix(&p("self_attn.k_proj.weight"), kvh * hd, d)?,
                v_proj: rd.matrix(&p("self_attn.v_proj.weight"), kvh * hd, d)?,
                o_proj: rd.matrix(&p("self_attn.o_proj.weight"), d, h * hd)?,
                mlp: SwiGlu::read(&mut rd, &p("mlp"), d, f)?,
                input_layernorm: rd.vector(&p("input_layernorm.weight"), &[d])?,
                post_attention_layernorm: rd.vector(&p("post_attention_layernorm.weight"), &[d])?,
                q_norm: rd.vector(&p("self_attn.q_norm.weight"), &[hd])?,
                k_norm: rd.vector(&p("self_attn.k_norm.weight"), &[hd])?,
            });
        }
        let lm_head = if c.tie_word_embeddings {
            embed.clone()
        } else {
            rd.matrix("lm_head.weight", v, d)?
        };
        let norm = rd.vector("model.norm.weight", &[d])?;
        rd.finish("Qwen3")?;
        let inv_freq = (0..hd / 2)
            .map(|i| c.rope_theta.powf(-(2.0 * i as f64) / hd as f64))
            .collect();
        Ok(Qwen3Model {
            config,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
        })
    }

    /// An empty cache.
    pub fn new_cache(&self) -> Qwen3Cache {
        Qwen3Cache {
            positions: 0,
            layers: vec![(Vec::new(), Vec::new()); self.layers.len()],
        }
    }

    /// Values per cached position per layer (`KVH·hd`).
    pub fn kv_width(&self) -> usize {
        self.config.num_key_value_heads * self.config.head_dim
    }

    /// Half-split RoPE of one head at `pos`: pairs `(i, i + hd/2)`.
    fn rope(&self, x: &mut [f32], pos: usize) {
        let half = x.len() / 2;
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let (s, c) = (pos as f64 * f).sin_cos();
            let (s, c) = (s as f32, c as f32);
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    }

    /// Run `tokens` (appended to `cache`, causal) and return the logits of the last one.
    pub fn forward(&self, cache: &mut Qwen3Cache, tokens: &[u32]) -> Result<Vec<f32>, Qwen3Error> {
        let c = &self.config;
        let (d, hd, h, kvh, eps) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.rms_norm_eps,
        );
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Qwen3Error::Token(t));
        }
        let t = tokens.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        let base = cache.positions;
        let kvw = self.kv_width();
        let mut x = Vec::with_capacity(t * d);
        for &tok in tokens {
            x.extend(self.embed.row(tok as usize).iter().map(|v| v.to_f32()));
        }
        let scale = 1.0 / (hd as f32).sqrt();
        for (layer, (kc, vc)) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let y = rms_rows(&x, &layer.input_layernorm, eps);
            let mut q = rms_rows(&matmul(&layer.q_proj, &y, t), &layer.q_norm, eps);
            let mut k = rms_rows(&matmul(&layer.k_proj, &y, t), &layer.k_norm, eps);
            let v = matmul(&layer.v_proj, &y, t);
            for r in 0..t {
                for head in q[r * h * hd..(r + 1) * h * hd].chunks_exact_mut(hd) {
                    self.rope(head, base + r);
                }
                for head in k[r * kvw..(r + 1) * kvw].chunks_exact_mut(hd) {
                    self.rope(head, base + r);
                }
            }
            kc.extend_from_slice(&k);
            vc.extend_from_slice(&v);
            let mut att = vec![0f32; t * h * hd];
            for r in 0..t {
                let keys = base + r + 1;
                for hh in 0..h {
                    let g = hh / (h / kvh);
                    let qh = &q[(r * h + hh) * hd..(r * h + hh + 1) * hd];
                    let mut s: Vec<f32> = (0..keys)
                        .map(|p| {
                            let kp = &kc[p * kvw + g * hd..p * kvw + (g + 1) * hd];
                            qh.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() * scale
                        })
                        .collect();
                    softmax_inplace(&mut s);
                    let o = &mut att[(r * h + hh) * hd..(r * h + hh + 1) * hd];
                    for (p, &w) in s.iter().enumerate() {
                        let vp = &vc[p * kvw + g * hd..p * kvw + (g + 1) * hd];
                        o.iter_mut().zip(vp).for_each(|(a, b)| *a += w * b);
                    }
                }
            }
            add_into(&mut x, &matmul(&layer.o_proj, &att, t));
            let y = rms_rows(&x, &layer.post_attention_layernorm, eps);
            add_into(&mut x, &layer.mlp.forward(&y, t));
        }
        cache.positions += t;
        let last = rms_rows(&x[(t - 1) * d..], &self.norm, eps);
        Ok(matmul(&self.lm_head, &last, 1))
    }

    /// Greedy continuation: feed `tokens`, then draft up to `n` tokens, each with its
    /// softmax probability (the draft confidence). Stops early after `eos_token_id`.
    pub fn draft(
        &self,
        cache: &mut Qwen3Cache,
        tokens: &[u32],
        n: usize,
    ) -> Result<Vec<(u32, f32)>, Qwen3Error> {
        let mut out = Vec::new();
        if n == 0 || tokens.is_empty() {
            return Ok(out);
        }
        let mut logits = self.forward(cache, tokens)?;
        loop {
            let id = argmax(&logits).unwrap_or(0) as u32;
            softmax_inplace(&mut logits);
            out.push((id, logits[id as usize]));
            if out.len() == n || id == self.config.eos_token_id {
                return Ok(out);
            }
            logits = self.forward(cache, &[id])?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dense::reference::{mv, rms, row, swiglu};
    use deltafin_k3::synth::{QwenSize, synthesize_qwen3};

    const REAL_06: &str = include_str!("../../../assets/kimi/qwen3-0.6b-base-config.json");
    const REAL_17: &str = include_str!("../../../assets/kimi/qwen3-1.7b-base-config.json");

    fn numel(c: &Qwen3Config) -> usize {
        let (d, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (h, kvh) = (c.num_attention_heads, c.num_key_value_heads);
        let layer = 2 * d + h * hd * d + 2 * kvh * hd * d + d * h * hd + 2 * hd + 3 * f * d;
        c.vocab_size * d + c.num_hidden_layers * layer + d
    }

    #[test]
    fn real_configs_parse_and_give_the_published_parameter_counts() {
        let a = Qwen3Config::from_json_str(REAL_06).unwrap();
        let b = Qwen3Config::from_json_str(REAL_17).unwrap();
        assert_eq!(numel(&a), 596_049_920);
        assert_eq!(numel(&b), 1_720_574_976);
        assert!(a.tie_word_embeddings && b.tie_word_embeddings);
        assert_eq!((a.head_dim, a.num_key_value_heads), (128, 8));
        // One field of the real 0.6B config set to `value`: the error names the field.
        for (field, value) in [
            ("rope_scaling", serde_json::json!({"type": "yarn"})),
            ("novel", 1.into()),
            ("num_key_value_heads", 3.into()),
        ] {
            let mut v: Value = serde_json::from_str(REAL_06).unwrap();
            v[field] = value;
            let e = Qwen3Config::from_json_str(&v.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{field}`")), "{e}");
        }
    }

    /// f64 reference of the whole model, every position at once (no cache).
    #[allow(clippy::needless_range_loop)]
    fn reference(m: &Qwen3Model, tokens: &[u32]) -> Vec<f64> {
        let c = &m.config;
        let (d, hd, h, kvh) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
        );
        let eps = c.rms_norm_eps as f64;
        let rms = |x: &[f64], w: &[f32]| rms(x, w, eps);
        let rope = |x: &mut [f64], pos: usize| {
            let half = x.len() / 2;
            for i in 0..half {
                let ang = pos as f64 * c.rope_theta.powf(-(2.0 * i as f64) / hd as f64);
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * ang.cos() - b * ang.sin();
                x[i + half] = b * ang.cos() + a * ang.sin();
            }
        };
        let mut xs: Vec<Vec<f64>> = tokens.iter().map(|&t| row(&m.embed, t as usize)).collect();
        for l in &m.layers {
            let ys: Vec<Vec<f64>> = xs.iter().map(|x| rms(x, &l.input_layernorm)).collect();
            let heads = |w: &Bf16Matrix, y: &[f64], norm: &[f32], pos: usize| -> Vec<Vec<f64>> {
                mv(w, y)
                    .chunks(hd)
                    .map(|hv| {
                        let mut hv = rms(hv, norm);
                        rope(&mut hv, pos);
                        hv
                    })
                    .collect()
            };
            let qs: Vec<Vec<Vec<f64>>> = ys
                .iter()
                .enumerate()
                .map(|(p, y)| heads(&l.q_proj, y, &l.q_norm, p))
                .collect();
            let ks: Vec<Vec<Vec<f64>>> = ys
                .iter()
                .enumerate()
                .map(|(p, y)| heads(&l.k_proj, y, &l.k_norm, p))
                .collect();
            let vs: Vec<Vec<f64>> = ys.iter().map(|y| mv(&l.v_proj, y)).collect();
            for p in 0..xs.len() {
                let mut att = Vec::new();
                for hh in 0..h {
                    let g = hh / (h / kvh);
                    let s: Vec<f64> = (0..=p)
                        .map(|s| {
                            qs[p][hh]
                                .iter()
                                .zip(&ks[s][g])
                                .map(|(a, b)| a * b)
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let mut o = vec![0f64; hd];
                    for (s, w) in e.iter().enumerate() {
                        for i in 0..hd {
                            o[i] += w / z * vs[s][g * hd + i];
                        }
                    }
                    att.extend(o);
                }
                let o = mv(&l.o_proj, &att);
                xs[p].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            }
            for x in xs.iter_mut() {
                let mo = swiglu(&l.mlp, &rms(x, &l.post_attention_layernorm));
                x.iter_mut().zip(&mo).for_each(|(a, b)| *a += b);
            }
        }
        let _ = d;
        mv(&m.lm_head, &rms(xs.last().unwrap(), &m.norm))
    }

    #[test]
    fn synthesized_qwen3_matches_f64_reference_with_and_without_cache() {
        let dir = tempfile::tempdir().unwrap();
        synthesize_qwen3(dir.path(), 3, QwenSize::Small).unwrap();
        let m = Qwen3Model::open(dir.path()).unwrap();
        let toks: Vec<u32> = (0..9).map(|i| (i * 7919 + 13) % 151_936).collect();
        let want = reference(&m, &toks);
        let rel = |got: &[f32]| {
            let num: f64 = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (*a as f64 - b).powi(2))
                .sum();
            (num / want.iter().map(|b| b * b).sum::<f64>()).sqrt()
        };
        let mut c1 = m.new_cache();
        let all = m.forward(&mut c1, &toks).unwrap();
        assert!(rel(&all) < 1e-5, "batched: {}", rel(&all));
        let mut c2 = m.new_cache();
        m.forward(&mut c2, &toks[..4]).unwrap();
        let mut last = Vec::new();
        for &t in &toks[4..] {
            last = m.forward(&mut c2, &[t]).unwrap();
        }
        assert!(rel(&last) < 1e-5, "stepwise: {}", rel(&last));
        // Truncating the cache and replaying gives the same logits.
        c2.truncate(5, m.kv_width());
        let mut again = Vec::new();
        for &t in &toks[5..] {
            again = m.forward(&mut c2, &[t]).unwrap();
        }
        assert_eq!(again, last);
        // Greedy drafts: deterministic, with probabilities in (0, 1].
        let d1 = m.draft(&mut m.new_cache(), &toks, 5).unwrap();
        let d2 = m.draft(&mut m.new_cache(), &toks, 5).unwrap();
        assert_eq!(d1, d2);
        assert!(!d1.is_empty() && d1.iter().all(|&(_, p)| p > 0.0 && p <= 1.0));
        assert_eq!(d1[0].0, argmax(&all).unwrap() as u32);
        assert!(matches!(
            m.forward(&mut m.new_cache(), &[151_936]),
            Err(Qwen3Error::Token(151_936))
        ));
    }
}
