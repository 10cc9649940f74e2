//! Kimi Delta Attention (docs/K3.md §4.3).
//!
//! Per token `y` (already normalised by `input_layernorm`), heads `h`, channel `c = d·h + i`:
//!
//! 1. `q̃, k̃, ṽ = W_q y, W_k y, W_v y`;
//! 2. causal depthwise conv (kernel K, f32 taps, tap K−1 on the current token), then SiLU;
//! 3. `g_c = lower_bound · σ(e^{A_log[h]} · ((W_fb W_fa y)_c + dt_bias_c))`, decay `α = e^g`;
//! 4. `β_h = σ((W_b y)_h)`;
//! 5. `q̂_h = q_h / √(Σq_h² + ε) · d^(−1/2)`, `k̂_h = k_h / √(Σk_h² + ε)`;
//! 6. `S′ = diag(α) S`, `u = β (v − S′ᵀ k̂)`, `S = S′ + k̂ uᵀ`, `o = Sᵀ q̂`;
//! 7. `o′_h = w_onorm ⊙ o_h / √(mean(o_h²) + ε) ⊙ σ((W_g y)_h)`;
//! 8. `out = W_o concat_h(o′_h)`.
//!
//! Two equivalent evaluations of step 6 ([`KdaForm`]): the recurrence
//! ([`KdaWeights::decode_step`], [`KdaForm::Recurrent`]), and the chunked form (chunk length `kda_chunk`,
//! [`deltafin_kernels::kda_chunked`]), in which every exponent is a partial sum of `g ≤ 0`
//! over a range of positions: the pairwise decays `e^{Γ_i − Γ_j}` are products of two factors
//! taken over tiles of at most 16 positions spanning at most 80 nats (FLA's `safe_gate`
//! sub-chunking), so nothing overflows and a decay over a long range underflows only towards
//! its true, negligible value.

use crate::error::ModelError;
use crate::model::linear::{Linear, apply_group};
use deltafin_kernels::{
    KdaRows, kda_chunked, kda_delta_step, l2_normalize, sigmoid_inplace, silu_inplace,
};
use deltafin_store::dims::ModelDims;
use rayon::prelude::*;

/// Which evaluation of the delta rule a KDA layer runs its rows with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KdaForm {
    /// Chunked (prefill; the reference's choice for more than one token).
    Chunked,
    /// Recurrent, token by token (bit-identical to decode).
    Recurrent,
}

impl KdaForm {
    /// The form `t` rows run with under the reference's mode selection: one row always takes
    /// the recurrent step, more rows this form.
    pub fn for_rows(self, t: usize) -> KdaForm {
        if t == 1 { KdaForm::Recurrent } else { self }
    }
}

/// Weights of one KDA layer (`model.layers.N.self_attn.*`), bf16 matrices and f32 vectors.
#[derive(Clone, Debug)]
pub struct KdaWeights {
    /// `q_proj.weight` `[H·d, D]`.
    pub q_proj: Linear,
    /// `k_proj.weight` `[H·d, D]`.
    pub k_proj: Linear,
    /// `v_proj.weight` `[H·d, D]`.
    pub v_proj: Linear,
    /// `q_conv1d.weight` `[H·d, 1, K]` flattened: tap `j` of channel `c` at `c·K + j`.
    pub q_conv: Vec<f32>,
    /// `k_conv1d.weight`, layout as `q_conv`.
    pub k_conv: Vec<f32>,
    /// `v_conv1d.weight`, layout as `q_conv`.
    pub v_conv: Vec<f32>,
    /// `f_a_proj.weight` `[r, D]` (gate low-rank down).
    pub f_a_proj: Linear,
    /// `f_b_proj.weight` `[H·d, r]` (gate low-rank up).
    pub f_b_proj: Linear,
    /// `b_proj.weight` `[H, D]` (write strength β).
    pub b_proj: Linear,
    /// `A_log` `[H]`: one scalar per head (the checkpoint stores it zero-padded; the loader
    /// checks the padding and keeps the first `H` entries, docs/K3.md §3.2).
    pub a_log: Vec<f32>,
    /// `dt_bias` `[H·d]`.
    pub dt_bias: Vec<f32>,
    /// `g_proj.weight` `[H·d, D]` (full-rank output gate).
    pub g_proj: Linear,
    /// `o_norm.weight` `[d]`, shared by all heads.
    pub o_norm: Vec<f32>,
    /// `o_proj.weight` `[D, H·d]`.
    pub o_proj: Linear,
}

/// Per-sequence state of one KDA layer (f32).
#[derive(Clone, Debug, PartialEq)]
pub struct KdaState {
    /// Recurrent states `S_h`, `[H, d (key), d (value)]`, row = key channel.
    pub recurrent: Vec<f32>,
    /// Pre-convolution inputs of the last `K − 1` tokens: `[3 (q,k,v), K − 1, H·d]`, oldest
    /// first; zero before the start of the sequence.
    pub conv: Vec<f32>,
}

impl KdaState {
    /// Zero state for a new sequence.
    pub fn new(dims: &ModelDims) -> KdaState {
        KdaState {
            recurrent: vec![0.0; dims.kda_recurrent_values()],
            conv: vec![0.0; dims.kda_conv_values()],
        }
    }
}

/// Per-token inputs of the recurrence, rows of `H·d` (β: rows of `H`).
struct Prepared {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    gate: Vec<f32>,
}

/// Causal depthwise conv + SiLU over `t` new rows of width `p`, continuing from `hist`
/// (`K − 1` rows) and leaving the last `K − 1` inputs in `hist`.
fn conv_silu(
    pre: &[f32],
    taps: &[f32],
    hist: &mut [f32],
    t: usize,
    p: usize,
    k: usize,
) -> Vec<f32> {
    let km1 = k - 1;
    let row = |tau: usize| -> &[f32] {
        if tau < km1 {
            &hist[tau * p..(tau + 1) * p]
        } else {
            &pre[(tau - km1) * p..(tau - km1 + 1) * p]
        }
    };
    // Per channel, the taps in order: `o_c = Σ_j w[c·K + j] · x_{t−K+1+j, c}`, summed from
    // j = 0 (the oldest input) as the reference does.
    let mut out = vec![0f32; t * p];
    let mut inputs: Vec<&[f32]> = Vec::with_capacity(k);
    for (ti, o) in out.chunks_exact_mut(p).enumerate() {
        inputs.clear();
        // Input at time ti − (K−1) + j is concatenated row ti + j.
        inputs.extend((0..k).map(|j| row(ti + j)));
        if let [x0, x1, x2, x3] = inputs[..] {
            // K = 4 (K3's kernel) with the channels zipped, no per-tap indexing: the same
            // operations in the same order as the general loop below.
            let xs = x0.iter().zip(x1).zip(x2).zip(x3);
            for ((oc, w), (((&a, &b), &c), &d)) in o.iter_mut().zip(taps.chunks_exact(4)).zip(xs) {
                *oc = 0.0 + w[0] * a + w[1] * b + w[2] * c + w[3] * d;
            }
        } else {
            for (c, (oc, w)) in o.iter_mut().zip(taps.chunks_exact(k)).enumerate() {
                let mut acc = 0f32;
                for (&wj, x) in w.iter().zip(&inputs) {
                    acc += wj * x[c];
                }
                *oc = acc;
            }
        }
        silu_inplace(o);
    }
    let mut new_hist = vec![0f32; km1 * p];
    for r in 0..km1 {
        new_hist[r * p..(r + 1) * p].copy_from_slice(row(t + r));
    }
    hist.copy_from_slice(&new_hist);
    out
}

impl KdaWeights {
    /// Steps 1–5 and the gate projection of step 7 for `t` rows.
    fn prepare(
        &self,
        dims: &ModelDims,
        y: &[f32],
        t: usize,
        state: &mut KdaState,
    ) -> Result<Prepared, ModelError> {
        let (h, d) = (dims.kda_heads, dims.kda_head_dim);
        let p = h * d;
        let km1 = dims.conv_kernel - 1;
        // The six projections of y in one parallel region.
        let outs = apply_group(
            &[
                (self.q_proj.product(), y),
                (self.k_proj.product(), y),
                (self.v_proj.product(), y),
                (self.f_a_proj.product(), y),
                (self.b_proj.product(), y),
                (self.g_proj.product(), y),
            ],
            t,
        )?;
        let Ok([qt, kt, vt, fa, mut beta, gate]) = <[Vec<f32>; 6]>::try_from(outs) else {
            unreachable!("apply_group returns one result per product")
        };
        let (hq, rest) = state.conv.split_at_mut(km1 * p);
        let (hk, hv) = rest.split_at_mut(km1 * p);
        let kk = dims.conv_kernel;
        let mut q = conv_silu(&qt, &self.q_conv, hq, t, p, kk);
        let mut k = conv_silu(&kt, &self.k_conv, hk, t, p, kk);
        let v = conv_silu(&vt, &self.v_conv, hv, t, p, kk);

        let mut g = vec![0f32; t * p];
        self.f_b_proj.matmul(&fa, t, &mut g)?;
        // e^{A_log[h]} once per head (the same value for each of its d channels).
        let a_exp: Vec<f32> = self.a_log[..h].iter().map(|a| a.exp()).collect();
        for row in g.chunks_exact_mut(p) {
            for ((gh, bh), &a) in row
                .chunks_exact_mut(d)
                .zip(self.dt_bias.chunks_exact(d))
                .zip(&a_exp)
            {
                for (gc, &b) in gh.iter_mut().zip(bh) {
                    *gc = a * (*gc + b);
                }
            }
            sigmoid_inplace(row);
            for gc in row.iter_mut() {
                *gc *= dims.gate_lower_bound;
            }
        }
        sigmoid_inplace(&mut beta);
        let qscale = 1.0 / (d as f32).sqrt();
        for head in q.chunks_exact_mut(d) {
            l2_normalize(head, dims.kda_l2_eps);
            for x in head.iter_mut() {
                *x *= qscale;
            }
        }
        for head in k.chunks_exact_mut(d) {
            l2_normalize(head, dims.kda_l2_eps);
        }
        Ok(Prepared {
            q,
            k,
            v,
            g,
            beta,
            gate,
        })
    }

    /// Steps 7–8: gated output norm per head, then `o_proj`.
    fn finish(
        &self,
        dims: &ModelDims,
        mut o: Vec<f32>,
        gate: &[f32],
        t: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let d = dims.kda_head_dim;
        let mut sg = gate.to_vec();
        sigmoid_inplace(&mut sg);
        for (oh, gh) in o.chunks_exact_mut(d).zip(sg.chunks_exact(d)) {
            let ms = oh.iter().map(|x| x * x).sum::<f32>() / d as f32;
            let inv = 1.0 / (ms + dims.kda_o_norm_eps).sqrt();
            for i in 0..d {
                oh[i] = self.o_norm[i] * (oh[i] * inv) * gh[i];
            }
        }
        let mut out = vec![0f32; t * self.o_proj.rows()];
        self.o_proj.matmul(&o, t, &mut out)?;
        Ok(out)
    }

    /// Run every head (in parallel) and gather the per-head outputs into rows of `H·d`.
    fn run_heads(
        &self,
        dims: &ModelDims,
        prep: &Prepared,
        t: usize,
        state: &mut KdaState,
        chunked: bool,
    ) -> Vec<f32> {
        let (h, d) = (dims.kda_heads, dims.kda_head_dim);
        let p = h * d;
        let per_head: Vec<Vec<f32>> = state
            .recurrent
            .par_chunks_mut(d * d)
            .enumerate()
            .map(|(hi, s)| {
                let io = HeadIo {
                    prep,
                    off: hi * d,
                    head: hi,
                    heads: h,
                    p,
                    d,
                };
                if chunked {
                    io.chunked(s, t, dims.kda_chunk)
                } else {
                    io.recurrent(s, t)
                }
            })
            .collect();
        let mut o = vec![0f32; t * p];
        for (hi, oh) in per_head.iter().enumerate() {
            for ti in 0..t {
                o[ti * p + hi * d..ti * p + (hi + 1) * d]
                    .copy_from_slice(&oh[ti * d..(ti + 1) * d]);
            }
        }
        o
    }

    /// One token through the layer with the recurrent form (decode). `y` has width D.
    pub fn decode_step(
        &self,
        dims: &ModelDims,
        y: &[f32],
        state: &mut KdaState,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward(dims, y, 1, state, KdaForm::Recurrent)
    }

    /// `t` tokens (`t` rows of D in `y`) through projections, heads and output, the heads in
    /// `form`. [`KdaForm::Recurrent`] runs the same floating-point operations as `t` calls of
    /// [`Self::decode_step`] (speculative verification relies on this bit-identity).
    pub fn forward(
        &self,
        dims: &ModelDims,
        y: &[f32],
        t: usize,
        state: &mut KdaState,
        form: KdaForm,
    ) -> Result<Vec<f32>, ModelError> {
        let prep = self.prepare(dims, y, t, state)?;
        let o = self.run_heads(dims, &prep, t, state, form == KdaForm::Chunked);
        self.finish(dims, o, &prep.gate, t)
    }
}

/// Accessors for one head's slice of the prepared rows.
struct HeadIo<'a> {
    prep: &'a Prepared,
    off: usize,
    head: usize,
    heads: usize,
    p: usize,
    d: usize,
}

impl HeadIo<'_> {
    fn q(&self, i: usize) -> &[f32] {
        &self.prep.q[i * self.p + self.off..i * self.p + self.off + self.d]
    }
    fn k(&self, i: usize) -> &[f32] {
        &self.prep.k[i * self.p + self.off..i * self.p + self.off + self.d]
    }
    fn v(&self, i: usize) -> &[f32] {
        &self.prep.v[i * self.p + self.off..i * self.p + self.off + self.d]
    }
    fn g(&self, i: usize) -> &[f32] {
        &self.prep.g[i * self.p + self.off..i * self.p + self.off + self.d]
    }
    fn beta(&self, i: usize) -> f32 {
        self.prep.beta[i * self.heads + self.head]
    }

    /// The delta rule token by token; returns `t` rows of `d`.
    fn recurrent(&self, s: &mut [f32], t: usize) -> Vec<f32> {
        let d = self.d;
        let mut o = vec![0f32; t * d];
        let mut u = vec![0f32; d];
        for ti in 0..t {
            let (q, k, v, g, beta) = (
                self.q(ti),
                self.k(ti),
                self.v(ti),
                self.g(ti),
                self.beta(ti),
            );
            let oi = &mut o[ti * d..(ti + 1) * d];
            kda_delta_step(s, q, k, v, g, beta, &mut u, oi);
        }
        o
    }

    /// The chunked form; returns `t` rows of `d`. See the module docs for the exponents and
    /// [`deltafin_kernels::kda_chunk`] for the tiles that keep them `O(t·d)`.
    fn chunked(&self, s: &mut [f32], t: usize, chunk: usize) -> Vec<f32> {
        let mut o = vec![0f32; t * self.d];
        let rows = KdaRows {
            q: &self.prep.q[self.off..],
            k: &self.prep.k[self.off..],
            v: &self.prep.v[self.off..],
            g: &self.prep.g[self.off..],
            stride: self.p,
            beta: &self.prep.beta[self.head..],
            beta_stride: self.heads,
            d: self.d,
        };
        kda_chunked(s, &rows, t, chunk, &mut o);
        o
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_util::{Rng, mv64, rel_l2, rel_l2_32, sig64, to64};

    /// A random KDA layer for `dims` with O(1) activations.
    pub(crate) fn random_kda(rng: &mut Rng, dims: &ModelDims) -> KdaWeights {
        let (dm, h, d) = (dims.hidden_size, dims.kda_heads, dims.kda_head_dim);
        let p = h * d;
        let k = dims.conv_kernel;
        let taps = |rng: &mut Rng| rng.vec(p * k, 0.8);
        let a_log = rng.vec(h, 1.0);
        KdaWeights {
            q_proj: rng.bf16_matrix(p, dm).into(),
            k_proj: rng.bf16_matrix(p, dm).into(),
            v_proj: rng.bf16_matrix(p, dm).into(),
            q_conv: taps(rng),
            k_conv: taps(rng),
            v_conv: taps(rng),
            f_a_proj: rng.bf16_matrix(d, dm).into(),
            f_b_proj: rng.bf16_matrix(p, d).into(),
            b_proj: rng.bf16_matrix(h, dm).into(),
            a_log,
            dt_bias: rng.vec(p, 1.0),
            g_proj: rng.bf16_matrix(p, dm).into(),
            o_norm: rng.around_one(d, 0.2),
            o_proj: rng.bf16_matrix(dm, p).into(),
        }
    }

    /// f64 state of the naive recurrent reference (FLA `naive_recurrent_kda`).
    pub(crate) struct Kda64 {
        s: Vec<f64>,
        hist: [Vec<Vec<f64>>; 3],
    }

    impl Kda64 {
        pub(crate) fn new(dims: &ModelDims) -> Kda64 {
            let p = dims.kda_width();
            let z = vec![vec![0f64; p]; dims.conv_kernel - 1];
            Kda64 {
                s: vec![0.0; dims.kda_recurrent_values()],
                hist: [z.clone(), z.clone(), z],
            }
        }
    }

    /// One token of the §4.3 equations in f64, written out directly.
    pub(crate) fn kda64_step(
        w: &KdaWeights,
        dims: &ModelDims,
        y: &[f64],
        st: &mut Kda64,
    ) -> Vec<f64> {
        let (h, d, kk) = (dims.kda_heads, dims.kda_head_dim, dims.conv_kernel);
        let p = h * d;
        let conv = |pre: Vec<f64>, taps: &[f32], hist: &mut Vec<Vec<f64>>| -> Vec<f64> {
            hist.push(pre);
            let out = (0..p)
                .map(|c| {
                    let z: f64 = (0..kk).map(|j| taps[c * kk + j] as f64 * hist[j][c]).sum();
                    z * sig64(z)
                })
                .collect();
            hist.remove(0);
            out
        };
        let [hq, hk, hv] = &mut st.hist;
        let q = conv(mv64(&w.q_proj, y), &w.q_conv, hq);
        let k = conv(mv64(&w.k_proj, y), &w.k_conv, hk);
        let v = conv(mv64(&w.v_proj, y), &w.v_conv, hv);
        let z = mv64(&w.f_b_proj, &mv64(&w.f_a_proj, y));
        let bl = mv64(&w.b_proj, y);
        let r = mv64(&w.g_proj, y);
        let mut o = vec![0f64; p];
        for hh in 0..h {
            let sl = hh * d..(hh + 1) * d;
            let a = (w.a_log[hh] as f64).exp();
            let g: Vec<f64> = sl
                .clone()
                .map(|c| dims.gate_lower_bound as f64 * sig64(a * (z[c] + w.dt_bias[c] as f64)))
                .collect();
            let beta = sig64(bl[hh]);
            let l2 = |x: &[f64]| {
                let n = (x.iter().map(|v| v * v).sum::<f64>() + dims.kda_l2_eps as f64).sqrt();
                x.iter().map(|v| v / n).collect::<Vec<f64>>()
            };
            let qh: Vec<f64> = l2(&q[sl.clone()])
                .iter()
                .map(|v| v / (d as f64).sqrt())
                .collect();
            let kh = l2(&k[sl.clone()]);
            let vh = &v[sl.clone()];
            let s = &mut st.s[hh * d * d..(hh + 1) * d * d];
            for i in 0..d {
                for j in 0..d {
                    s[i * d + j] *= g[i].exp();
                }
            }
            let u: Vec<f64> = (0..d)
                .map(|j| beta * (vh[j] - (0..d).map(|i| s[i * d + j] * kh[i]).sum::<f64>()))
                .collect();
            for i in 0..d {
                for j in 0..d {
                    s[i * d + j] += kh[i] * u[j];
                }
            }
            let oh: Vec<f64> = (0..d)
                .map(|j| (0..d).map(|i| s[i * d + j] * qh[i]).sum())
                .collect();
            let ms = oh.iter().map(|v| v * v).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + dims.kda_o_norm_eps as f64).sqrt();
            for j in 0..d {
                o[hh * d + j] = w.o_norm[j] as f64 * oh[j] * inv * sig64(r[hh * d + j]);
            }
        }
        mv64(&w.o_proj, &o)
    }

    fn setup(seed: u64) -> (ModelDims, KdaWeights) {
        let mut rng = Rng(seed);
        let dims = ModelDims {
            kda_heads: 3,
            kda_head_dim: 8,
            kda_chunk: 64,
            ..crate::model::forward::tests::tiny_dims()
        };
        let w = random_kda(&mut rng, &dims);
        (dims, w)
    }

    #[test]
    fn chunked_prefill_matches_stepwise_decode_and_f64() {
        let (dims, w) = setup(21);
        let dm = dims.hidden_size;
        let mut rng = Rng(99);
        for &t in &[1usize, 5, 64, 65, 150] {
            let y = rng.vec(t * dm, 1.0);
            let mut st_p = KdaState::new(&dims);
            let pre = w
                .forward(&dims, &y, t, &mut st_p, KdaForm::Chunked)
                .unwrap();
            let mut st_d = KdaState::new(&dims);
            let mut st_64 = Kda64::new(&dims);
            let mut dec = Vec::new();
            let mut ref64 = Vec::new();
            for ti in 0..t {
                let row = &y[ti * dm..(ti + 1) * dm];
                dec.extend(w.decode_step(&dims, row, &mut st_d).unwrap());
                ref64.extend(kda64_step(&w, &dims, &to64(row), &mut st_64));
            }
            let e_pd = rel_l2_32(&pre, &dec);
            let e_p64 = rel_l2(&pre, &ref64);
            let e_d64 = rel_l2(&dec, &ref64);
            let e_state = rel_l2_32(&st_p.recurrent, &st_d.recurrent);
            // Bound: f32 rounding of two different summation orders, ≤ 1e-5 relative L2.
            assert!(e_pd < 1e-5, "T={t}: prefill vs decode {e_pd}");
            assert!(
                e_p64 < 1e-5 && e_d64 < 1e-5,
                "T={t}: vs f64 {e_p64} {e_d64}"
            );
            assert!(e_state < 1e-5, "T={t}: state {e_state}");
            assert_eq!(st_p.conv, st_d.conv, "T={t}: conv windows");
            let e_s64 = rel_l2(&st_p.recurrent, &st_64.s);
            assert!(e_s64 < 1e-5, "T={t}: state vs f64 {e_s64}");
        }
    }

    #[test]
    fn prefill_continues_from_state() {
        // Two prefills of 40 + 70 tokens equal one of 110 (chunk boundaries differ).
        let (dims, w) = setup(5);
        let dm = dims.hidden_size;
        let y = Rng(8).vec(110 * dm, 1.0);
        let mut a = KdaState::new(&dims);
        let whole = w.forward(&dims, &y, 110, &mut a, KdaForm::Chunked).unwrap();
        let mut b = KdaState::new(&dims);
        let mut parts = w
            .forward(&dims, &y[..40 * dm], 40, &mut b, KdaForm::Chunked)
            .unwrap();
        parts.extend(
            w.forward(&dims, &y[40 * dm..], 70, &mut b, KdaForm::Chunked)
                .unwrap(),
        );
        assert!(rel_l2_32(&parts, &whole) < 1e-5);
        assert!(rel_l2_32(&b.recurrent, &a.recurrent) < 1e-5);
    }

    #[test]
    fn a_log_is_per_head() {
        // Changing head 1's A_log must change only head 1's gate, hence its channels of `g`.
        let (dims, w) = setup(13);
        let y = Rng(1).vec(dims.hidden_size, 1.0);
        let mut w2 = w.clone();
        w2.a_log[1] += 0.5;
        let p1 = w.prepare(&dims, &y, 1, &mut KdaState::new(&dims)).unwrap();
        let p2 = w2.prepare(&dims, &y, 1, &mut KdaState::new(&dims)).unwrap();
        let d = dims.kda_head_dim;
        for c in 0..dims.kda_width() {
            assert_eq!(p1.g[c] == p2.g[c], c / d != 1, "channel {c}");
            assert!(p1.g[c] > dims.gate_lower_bound && p1.g[c] < 0.0);
        }
    }
}

/// The CUDA kernels' CPU reference (`deltafin_kernels::reference`) is this module's
/// recurrent step, bit for bit.
#[cfg(test)]
mod cuda_reference_parity {
    use super::*;
    use crate::test_util::Rng;

    #[test]
    fn reference_kda_step_equals_recurrent_form() {
        let mut rng = Rng(91);
        let (h, d) = (3usize, 16usize);
        let prep = Prepared {
            q: rng.vec(h * d, 0.3),
            k: rng.vec(h * d, 0.3),
            v: rng.vec(h * d, 1.0),
            g: rng.vec(h * d, 0.5).iter().map(|x| -x.abs()).collect(),
            beta: rng.vec(h, 1.0).iter().map(|x| x.abs()).collect(),
            gate: Vec::new(),
        };
        for head in 0..h {
            let mut s = rng.vec(d * d, 0.5);
            let mut s_ref = s.clone();
            let io = HeadIo {
                prep: &prep,
                off: head * d,
                head,
                heads: h,
                p: h * d,
                d,
            };
            let o = io.recurrent(&mut s, 1);
            let sl = head * d..(head + 1) * d;
            let o_ref = deltafin_kernels::reference::kda_step(
                &mut s_ref,
                &prep.q[sl.clone()],
                &prep.k[sl.clone()],
                &prep.v[sl.clone()],
                &prep.g[sl],
                prep.beta[head],
            );
            assert_eq!(o, o_ref, "head {head} output");
            assert_eq!(s, s_ref, "head {head} state");
        }
    }
}
