//! Gated MLA without positional encoding (docs/K3.md §4.4), evaluated in the absorbed form.
//!
//! ```text
//! c_q  = RMS_ε(W_qa y; q_a_layernorm);   q_h = (W_qb c_q)_h = [qn_h | qt_h]
//! [c_kv | kt] = W_kva y;                 ĉ = RMS_ε(c_kv; kv_a_layernorm)
//! score_h(t, s) = [ (B_h^Kᵀ qn_h(t)) · ĉ(s) + qt_h(t) · kt(s) ] / √(nope + rope),  s ≤ t
//! p_h = softmax_s(score_h);   o_h(t) = B_h^V (Σ_s p_h(t, s) ĉ(s))
//! out = W_o (concat_h o_h ⊙ σ(W_g y))
//! ```
//!
//! `B_h^K` / `B_h^V` are head `h`'s key / value rows of `kv_b_proj`. Only `ĉ` and `kt` are
//! cached per token, stored as bf16 (576 values = 1,152 B per token per layer for K3).

use crate::error::ModelError;
use crate::model::linear::{Linear, apply_group};
use crate::model::norm::rms_norm_rows;
use deltafin_kernels::{
    CacheValue, axpy_bf16_f32, axpy_i8_f32, causal_latent_attention, dot_bf16_f32, dot_i8_f32,
    sigmoid,
};
use deltafin_store::dims::{CacheDtype, ModelDims};
use deltafin_tensor::bf16;
use rayon::prelude::*;

/// (token, head) rows of one prefill attention task: with `mini`'s 8 heads, 8 tokens.
const ATTN_BLOCK_ROWS: usize = 64;
/// Bytes of one prefill attention task's probabilities (rows × cached tokens × 4).
const ATTN_BLOCK_BYTES: usize = 4 << 20;

/// Weights of one gated MLA layer (`model.layers.N.self_attn.*`).
#[derive(Clone, Debug)]
pub struct MlaWeights {
    /// `q_a_proj.weight` `[q_lora, D]`.
    pub q_a_proj: Linear,
    /// `q_a_layernorm.weight` `[q_lora]`.
    pub q_a_layernorm: Vec<f32>,
    /// `q_b_proj.weight` `[H·(nope+rope), q_lora]`; head `h` owns rows `(nope+rope)·h ..`:
    /// `nope` rows, then `rope` tail rows.
    pub q_b_proj: Linear,
    /// `kv_a_proj_with_mqa.weight` `[kv_lora + rope, D]`: latent rows, then the shared tail.
    pub kv_a_proj: Linear,
    /// `kv_a_layernorm.weight` `[kv_lora]`.
    pub kv_a_layernorm: Vec<f32>,
    /// `kv_b_proj.weight` `[H·(nope+v), kv_lora]`; head `h` owns rows `(nope+v)·h ..`: `nope`
    /// key rows, then `v` value rows.
    pub kv_b_proj: Linear,
    /// `g_proj.weight` `[H·v, D]` (output gate).
    pub g_proj: Linear,
    /// `o_proj.weight` `[D, H·v]`.
    pub o_proj: Linear,
}

/// A value type the MLA cache can hold.
pub trait CacheElem:
    CacheValue + Copy + Send + Sync + PartialEq + std::fmt::Debug + 'static
{
    /// Round an f32 for storage.
    fn store(v: f32) -> Self;
    /// Widen for compute.
    fn load(self) -> f32;
}

impl CacheElem for bf16 {
    #[inline]
    fn store(v: f32) -> Self {
        bf16::from_f32(v)
    }
    #[inline]
    fn load(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl CacheElem for f32 {
    #[inline]
    fn store(v: f32) -> Self {
        v
    }
    #[inline]
    fn load(self) -> f32 {
        self
    }
}

/// Cached rows of one MLA layer: `ĉ` (`kv_lora` per token) and `kt` (`rope` per token).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheRows<E> {
    /// `ĉ` rows, oldest first.
    pub latent: Vec<E>,
    /// `kt` rows, oldest first.
    pub tail: Vec<E>,
}

/// The growable per-sequence cache of one MLA layer, in the storage type chosen by
/// [`ModelDims::mla_cache_dtype`] (bf16 by default).
#[derive(Clone, Debug, PartialEq)]
pub enum MlaCache {
    /// bf16 storage (1,152 B per token per layer for K3).
    Bf16(CacheRows<bf16>),
    /// f32 storage (for verification runs that must not depend on bf16 rounding).
    F32(CacheRows<f32>),
}

impl MlaCache {
    /// Empty cache of the configured storage type.
    pub fn new(dims: &ModelDims) -> MlaCache {
        match dims.mla_cache_dtype {
            CacheDtype::Bf16 => MlaCache::Bf16(CacheRows::default()),
            CacheDtype::F32 => MlaCache::F32(CacheRows::default()),
        }
    }
    /// Cached tokens.
    pub fn len(&self, dims: &ModelDims) -> usize {
        let n = match self {
            MlaCache::Bf16(c) => c.latent.len(),
            MlaCache::F32(c) => c.latent.len(),
        };
        n / dims.kv_lora_rank.max(1)
    }
    /// Number of stored `ĉ` and `kt` values.
    pub fn values(&self) -> (usize, usize) {
        match self {
            MlaCache::Bf16(c) => (c.latent.len(), c.tail.len()),
            MlaCache::F32(c) => (c.latent.len(), c.tail.len()),
        }
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            MlaCache::Bf16(c) => (c.latent.len() + c.tail.len()) * 2,
            MlaCache::F32(c) => (c.latent.len() + c.tail.len()) * 4,
        }
    }
    /// Whether the cache stores `dtype`.
    pub fn is_dtype(&self, dtype: CacheDtype) -> bool {
        matches!(
            (self, dtype),
            (MlaCache::Bf16(_), CacheDtype::Bf16) | (MlaCache::F32(_), CacheDtype::F32)
        )
    }

    /// Drop every token at position `len` and later.
    pub fn truncate(&mut self, len: usize, dims: &ModelDims) {
        let (a, b) = (len * dims.kv_lora_rank, len * dims.qk_rope_head_dim);
        match self {
            MlaCache::Bf16(c) => {
                c.latent.truncate(a);
                c.tail.truncate(b);
            }
            MlaCache::F32(c) => {
                c.latent.truncate(a);
                c.tail.truncate(b);
            }
        }
    }
}

impl MlaWeights {
    /// `t` new tokens (rows of D in `y`), appended to `cache`, each attending causally to the
    /// cache and to the new tokens up to itself. Returns `t` rows of D.
    pub fn forward(
        &self,
        dims: &ModelDims,
        y: &[f32],
        t: usize,
        cache: &mut MlaCache,
    ) -> Result<Vec<f32>, ModelError> {
        // The three projections of y in one parallel region, then the queries' second step.
        let outs = apply_group(
            &[
                (self.q_a_proj.product(), y),
                (self.kv_a_proj.product(), y),
                (self.g_proj.product(), y),
            ],
            t,
        )?;
        let Ok([cq_raw, kv, gate]) = <[Vec<f32>; 3]>::try_from(outs) else {
            unreachable!("apply_group returns one result per product")
        };
        let mut cq = vec![0f32; cq_raw.len()];
        rms_norm_rows(&cq_raw, &self.q_a_layernorm, dims.mla_norm_eps, &mut cq);
        let q = self.q_b_proj.apply(&cq, t)?;
        let o = match cache {
            MlaCache::Bf16(c) => self.attend(dims, &q, &kv, &gate, t, c),
            MlaCache::F32(c) => self.attend(dims, &q, &kv, &gate, t, c),
        };
        let mut out = vec![0f32; t * self.o_proj.rows()];
        self.o_proj.matmul(&o, t, &mut out)?;
        Ok(out)
    }

    /// Append the new `ĉ` (normalised latent) and `kt` rows to the cache, then run the
    /// absorbed attention for `t` new queries; returns the gated head outputs, `t` rows of
    /// `H·v`.
    fn attend<E: CacheElem>(
        &self,
        dims: &ModelDims,
        q: &[f32],
        kv: &[f32],
        gate: &[f32],
        t: usize,
        cache: &mut CacheRows<E>,
    ) -> Vec<f32> {
        let (h, dn, dr, dv, kvl) = dims.mla_head_sizes();
        let dq = dn + dr;
        let mut chat = vec![0f32; kvl];
        for row in kv.chunks_exact(kvl + dr) {
            rms_norm_rows(
                &row[..kvl],
                &self.kv_a_layernorm,
                dims.mla_norm_eps,
                &mut chat,
            );
            cache.latent.extend(chat.iter().map(|&v| E::store(v)));
            cache.tail.extend(row[kvl..].iter().map(|&v| E::store(v)));
        }
        let total = cache.latent.len() / kvl;
        let base = total - t;
        let scale = 1.0 / (dq as f32).sqrt();
        let kvb = KvbRows::new(&self.kv_b_proj, kvl);
        let cache_ref = &*cache;

        // One task per (block of new tokens, group of heads). Short inputs (decode) split the
        // heads so both workers run; long ones (prefill) give each task a block of tokens and
        // all heads, so each cached row is read once per block rather than once per token. A
        // head's values depend neither on its group nor on its block
        // (`causal_latent_attention`).
        let threads = rayon::current_num_threads();
        let groups = (2 * threads).div_ceil(t).clamp(1, h.max(1));
        // Heads per task: a divisor of H, so no task straddles two tokens.
        let per = (h.div_ceil(groups)..=h)
            .find(|&p| p > 0 && h % p == 0)
            .unwrap_or(h)
            .max(1);
        // Tokens per task (all heads only): up to ATTN_BLOCK_ROWS (token, head) rows, the
        // probabilities under ATTN_BLOCK_BYTES, and at least four tasks per worker.
        let block = if per == h && t > 1 {
            let by_rows = (ATTN_BLOCK_ROWS / h.max(1)).max(1);
            let by_bytes = (ATTN_BLOCK_BYTES / (4 * h.max(1) * total)).max(1);
            let by_tasks = t.div_ceil(4 * threads).max(1);
            by_rows.min(by_bytes).min(by_tasks)
        } else {
            1
        };
        let mut o = vec![0f32; t * h * dv];
        o.par_chunks_mut(block * per * dv)
            .enumerate()
            .for_each(|(idx, og)| {
                let tasks = h / per;
                let (t0, h0) = ((idx / tasks) * block, (idx % tasks) * per);
                let tb = og.len() / (per * dv);
                // q_lat = B_h^Kᵀ qn per (token, head) of the task, and the heads' rope tails.
                let mut q_lat = vec![0f32; tb * per * kvl];
                let mut q_tail = vec![0f32; tb * per * dr];
                for (r, (ql, qtl)) in q_lat
                    .chunks_exact_mut(kvl)
                    .zip(q_tail.chunks_exact_mut(dr))
                    .enumerate()
                {
                    let (ti, hh) = (t0 + r / per, h0 + r % per);
                    let qh = &q[ti * h * dq + hh * dq..ti * h * dq + (hh + 1) * dq];
                    let (qn, qt) = qh.split_at(dn);
                    let rows = hh * (dn + dv);
                    for (i, &qi) in qn.iter().enumerate() {
                        kvb.axpy_row(rows + i, qi, ql);
                    }
                    qtl.copy_from_slice(qt);
                }
                let n0 = base + t0 + 1;
                let mut p = vec![0f32; tb * per * (n0 + tb - 1)];
                let mut ctx = vec![0f32; tb * per * kvl];
                causal_latent_attention(
                    &q_lat,
                    &q_tail,
                    &cache_ref.latent,
                    &cache_ref.tail,
                    per,
                    tb,
                    n0,
                    scale,
                    &mut p,
                    &mut ctx,
                );
                // o_h = B_h^V ctx_h, gated.
                for (r, (oh, ctx)) in og
                    .chunks_exact_mut(dv)
                    .zip(ctx.chunks_exact(kvl))
                    .enumerate()
                {
                    let (ti, hh) = (t0 + r / per, h0 + r % per);
                    let rows = hh * (dn + dv);
                    let g = &gate[ti * h * dv + hh * dv..ti * h * dv + (hh + 1) * dv];
                    for (j, oj) in oh.iter_mut().enumerate() {
                        *oj = kvb.dot_row(rows + dn + j, ctx) * sigmoid(g[j]);
                    }
                }
            });
        o
    }
}

/// Rows of `kv_b_proj` read element-wise by the absorbed attention, in either format
/// (row-int8 elements are `scale_r · q`, the dequantized weights).
enum KvbRows<'a> {
    Bf16(&'a [bf16], usize),
    Int8(&'a deltafin_tensor::RowInt8Matrix),
}

impl<'a> KvbRows<'a> {
    fn new(w: &'a Linear, cols: usize) -> KvbRows<'a> {
        match w.host() {
            Linear::RowInt8(m) => KvbRows::Int8(m),
            Linear::Bf16(m) => KvbRows::Bf16(m.data(), cols),
            Linear::Device(_) => unreachable!("host() never returns Linear::Device"),
        }
    }

    /// `out += alpha · W[r, ·]`.
    #[inline]
    fn axpy_row(&self, r: usize, alpha: f32, out: &mut [f32]) {
        match *self {
            KvbRows::Bf16(d, cols) => axpy_bf16_f32(&d[r * cols..(r + 1) * cols], alpha, out),
            KvbRows::Int8(m) => axpy_i8_f32(m.row(r), m.scale(r), alpha, out),
        }
    }

    /// `W[r, ·] · x`.
    #[inline]
    fn dot_row(&self, r: usize, x: &[f32]) -> f32 {
        match *self {
            KvbRows::Bf16(d, cols) => dot_bf16_f32(&d[r * cols..(r + 1) * cols], x),
            KvbRows::Int8(m) => dot_i8_f32(m.row(r), m.scale(r), x),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_util::{Rng, mv64, rel_l2, rel_l2_32, rms64, sig64, to64};

    pub(crate) fn random_mla(rng: &mut Rng, dims: &ModelDims) -> MlaWeights {
        let (dm, h) = (dims.hidden_size, dims.mla_heads);
        let (dn, dr, dv) = (
            dims.qk_nope_head_dim,
            dims.qk_rope_head_dim,
            dims.v_head_dim,
        );
        let (ql, kvl) = (dims.q_lora_rank, dims.kv_lora_rank);
        MlaWeights {
            q_a_proj: rng.bf16_matrix(ql, dm).into(),
            q_a_layernorm: rng.around_one(ql, 0.2),
            q_b_proj: rng.bf16_matrix_scaled(h * (dn + dr), ql, 2.0).into(),
            kv_a_proj: rng.bf16_matrix(kvl + dr, dm).into(),
            kv_a_layernorm: rng.around_one(kvl, 0.2),
            kv_b_proj: rng.bf16_matrix(h * (dn + dv), kvl).into(),
            g_proj: rng.bf16_matrix(h * dv, dm).into(),
            o_proj: rng.bf16_matrix(dm, h * dv).into(),
        }
    }

    /// f64 expanded-form reference state: per cached token, every head's full key and value.
    #[derive(Default)]
    pub(crate) struct Mla64 {
        keys: Vec<Vec<Vec<f64>>>,   // [token][head] (nope + rope)
        values: Vec<Vec<Vec<f64>>>, // [token][head] (v)
    }

    /// One token of §4.4 in the expanded form: `k_h = [kn_h | kt]`, `v_h`, explicit softmax.
    /// The cache stores `ĉ` and `kt` in bf16 (the engine's storage choice), so the reference
    /// rounds them at the same point before expanding.
    pub(crate) fn mla64_step(
        w: &MlaWeights,
        dims: &ModelDims,
        y: &[f64],
        st: &mut Mla64,
    ) -> Vec<f64> {
        let (h, dn, dr, dv, kvl) = dims.mla_head_sizes();
        let eps = dims.mla_norm_eps as f64;
        let cq = rms64(&mv64(&w.q_a_proj, y), &w.q_a_layernorm, eps);
        let q = mv64(&w.q_b_proj, &cq);
        let kv = mv64(&w.kv_a_proj, y);
        let round = |v: f64| match dims.mla_cache_dtype {
            CacheDtype::Bf16 => bf16::from_f64(v).to_f64(),
            CacheDtype::F32 => v as f32 as f64,
        };
        let c: Vec<f64> = rms64(&kv[..kvl], &w.kv_a_layernorm, eps)
            .into_iter()
            .map(round)
            .collect();
        let kt: Vec<f64> = kv[kvl..].iter().map(|&v| round(v)).collect();
        let kvb = mv64(&w.kv_b_proj, &c);
        let mut keys = Vec::new();
        let mut vals = Vec::new();
        for hh in 0..h {
            let b = hh * (dn + dv);
            let mut k = kvb[b..b + dn].to_vec();
            k.extend_from_slice(&kt);
            keys.push(k);
            vals.push(kvb[b + dn..b + dn + dv].to_vec());
        }
        st.keys.push(keys);
        st.values.push(vals);
        let g = mv64(&w.g_proj, y);
        let mut o = vec![0f64; h * dv];
        for hh in 0..h {
            let qh = &q[hh * (dn + dr)..(hh + 1) * (dn + dr)];
            let s: Vec<f64> = st
                .keys
                .iter()
                .map(|k| {
                    qh.iter().zip(&k[hh]).map(|(a, b)| a * b).sum::<f64>()
                        / ((dn + dr) as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for j in 0..dv {
                let v: f64 = st
                    .values
                    .iter()
                    .zip(&e)
                    .map(|(vv, p)| p / z * vv[hh][j])
                    .sum();
                o[hh * dv + j] = v * sig64(g[hh * dv + j]);
            }
        }
        mv64(&w.o_proj, &o)
    }

    /// A random MLA layer of the tiny dims and `t` random input rows.
    fn setup(seed: u64, t: usize) -> (ModelDims, MlaWeights, Vec<f32>) {
        let mut rng = Rng(seed);
        let dims = crate::model::forward::tests::tiny_dims();
        let w = random_mla(&mut rng, &dims);
        let y = rng.vec(t * dims.hidden_size, 1.0);
        (dims, w, y)
    }

    /// Rows `rows` of `y` through `w` one at a time, appended to `cache`.
    fn stepwise(
        w: &MlaWeights,
        dims: &ModelDims,
        y: &[f32],
        rows: std::ops::Range<usize>,
        cache: &mut MlaCache,
    ) -> Vec<f32> {
        let dm = dims.hidden_size;
        rows.flat_map(|ti| {
            w.forward(dims, &y[ti * dm..(ti + 1) * dm], 1, cache)
                .unwrap()
        })
        .collect()
    }

    #[test]
    fn absorbed_matches_expanded_f64_and_stepwise() {
        let t = 37;
        let (dims, w, y) = setup(31, t);
        let dm = dims.hidden_size;
        // Prefill 30, then 7 one by one.
        let mut cache = MlaCache::new(&dims);
        let mut out = w.forward(&dims, &y[..30 * dm], 30, &mut cache).unwrap();
        out.extend(stepwise(&w, &dims, &y, 30..t, &mut cache));
        assert_eq!(cache.len(&dims), t);
        assert_eq!(
            cache.bytes(),
            t * dims.mla_cache_values_per_token_layer() * 2
        );
        let mut st = Mla64::default();
        let mut want = Vec::new();
        for ti in 0..t {
            want.extend(mla64_step(
                &w,
                &dims,
                &to64(&y[ti * dm..(ti + 1) * dm]),
                &mut st,
            ));
        }
        let e = rel_l2(&out, &want);
        assert!(e < 1e-5, "absorbed vs expanded f64: {e}");
        // All stepwise.
        let mut c2 = MlaCache::new(&dims);
        let step = stepwise(&w, &dims, &y, 0..t, &mut c2);
        assert_eq!(c2, cache, "cache contents must not depend on batching");
        let e = rel_l2_32(&out, &step);
        assert!(e < 1e-6, "prefill vs stepwise: {e}");
    }

    /// Prefill attention runs in blocks of tokens (`causal_latent_attention`); every row must
    /// keep the bits of one-token decode, whatever the block size or the resume point.
    #[test]
    fn prefill_blocks_give_the_stepwise_bits() {
        let t = 150;
        let (dims, w, y) = setup(77, t);
        let dm = dims.hidden_size;
        let mut c1 = MlaCache::new(&dims);
        let step = stepwise(&w, &dims, &y, 0..t, &mut c1);
        for split in [0usize, 1, 64, 97] {
            let mut c2 = MlaCache::new(&dims);
            let mut out = Vec::new();
            if split > 0 {
                out = w.forward(&dims, &y[..split * dm], split, &mut c2).unwrap();
            }
            out.extend(
                w.forward(&dims, &y[split * dm..], t - split, &mut c2)
                    .unwrap(),
            );
            assert_eq!(c2, c1, "split {split}");
            let same = out
                .iter()
                .zip(&step)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "split {split}: prefill rows differ from decode");
        }
    }

    #[test]
    fn truncate_then_replay_is_identical() {
        let (dims, w, y) = setup(4, 12);
        let dm = dims.hidden_size;
        let mut cache = MlaCache::new(&dims);
        let full = w.forward(&dims, &y, 12, &mut cache).unwrap();
        cache.truncate(9, &dims);
        let tail = w.forward(&dims, &y[9 * dm..], 3, &mut cache).unwrap();
        assert_eq!(&full[9 * dm..], &tail[..]);
    }
}

/// The CUDA kernels' CPU reference (`deltafin_kernels::reference`) is this module's
/// absorbed decode, bit for bit.
#[cfg(test)]
mod cuda_reference_parity {
    use super::tests::random_mla;
    use super::*;
    use crate::test_util::Rng;

    #[test]
    fn reference_mla_decode_equals_attend() {
        let mut rng = Rng(57);
        let dims = crate::model::forward::tests::tiny_dims();
        let w = random_mla(&mut rng, &dims);
        let (h, dn, dr, dv, kvl) = dims.mla_head_sizes();
        let mut cache = CacheRows::<bf16>::default();
        for n in 1..=6 {
            let q = rng.vec(h * (dn + dr), 1.0);
            let kv = rng.vec(kvl + dr, 1.0);
            let gate = rng.vec(h * dv, 1.0);
            let o = w.attend(&dims, &q, &kv, &gate, 1, &mut cache);
            let o_ref = deltafin_kernels::reference::mla_decode(
                (h, dn, dr, dv, kvl),
                n,
                &q,
                w.kv_b_proj
                    .as_bf16()
                    .expect("random_mla builds a bf16 kv_b_proj")
                    .data(),
                &cache.latent,
                &cache.tail,
                &gate,
            );
            assert_eq!(o, o_ref, "{n} cached tokens");
        }
    }
}
