//! Absorbed latent attention of one query position (docs/K3.md §4.4), all heads of a group
//! at once, so each cached row is read once per query position rather than once per head:
//!
//! ```text
//! score_h(s) = (q_lat_h · ĉ(s) + q_tail_h · kt(s)) · scale,   s < n
//! p_h = softmax(score_h);   ctx_h = Σ_s p_h(s) ĉ(s)
//! ```
//!
//! Every dot product has one fixed order (16 lane sums, then a fixed pairwise reduction) and
//! every head's values are computed by the same operations whatever the head group or the
//! backend, so a row's result does not depend on how rows and heads are split into tasks.

use crate::kda_chunk::dot;
use crate::ops::softmax_inplace;
use half::bf16;

/// A cached value the attention can widen to f32.
pub trait CacheValue: Copy + Send + Sync {
    /// The value as f32 (exact).
    fn widen(self) -> f32;
}

impl CacheValue for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl CacheValue for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

crate::simd::simd_versions! {
    /// One query position over the first `n` cached rows for `heads` heads: `q_lat` holds
    /// `heads` rows of `kvl`, `q_tail` `heads` rows of `dr`; `latent` / `tail` hold at least `n`
    /// rows of `kvl` / `dr`. Writes the probabilities to `p` (`heads` rows of `n`) and the
    /// contexts to `ctx` (`heads` rows of `kvl`). The same values as
    /// [`causal_latent_attention`] with one query.
    ///
    /// # Panics
    /// If a length disagrees with `heads`, `n` or the row widths.
    pub fn latent_attention<E: CacheValue>(q_lat: &[f32], q_tail: &[f32], latent: &[E],
        tail: &[E], heads: usize, n: usize, scale: f32, p: &mut [f32], ctx: &mut [f32])
        = latent_attention_body;
}

crate::simd::simd_versions! {
    /// `queries` consecutive query positions, causally: query `i` (`0..queries`) attends to
    /// the first `n0 + i` cached rows. `q_lat` / `q_tail` / `ctx` hold `queries × heads` rows
    /// (query-major) of `kvl` / `dr` / `kvl`; `p` holds as many rows of `n0 + queries − 1`
    /// (the probabilities of query `i` fill the first `n0 + i` of its rows, the rest is left
    /// as it was).
    ///
    /// Blocked for long prompts: cached rows are widened in tiles of [`KEY_TILE`], once per
    /// block of queries, and each tile serves every (query, head) row of the block from the
    /// cache. Every (query, head) value is computed by the operations of the one-query form
    /// in the same order (each dot product in 16 lane sums and the fixed pairwise reduction,
    /// [`softmax_inplace`], each context element summed over the cached rows in order), so a
    /// query's bits do not depend on the block it is in, on the head grouping, or on the
    /// backend.
    ///
    /// # Panics
    /// If a length disagrees with `queries`, `heads`, `n0` or the row widths, or `n0` is 0.
    pub fn causal_latent_attention<E: CacheValue>(q_lat: &[f32], q_tail: &[f32],
        latent: &[E], tail: &[E], heads: usize, queries: usize, n0: usize, scale: f32,
        p: &mut [f32], ctx: &mut [f32]) = causal_latent_attention_body;
}

/// [`latent_attention`]: one query of [`causal_latent_attention_body`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn latent_attention_body<E: CacheValue>(
    q_lat: &[f32],
    q_tail: &[f32],
    latent: &[E],
    tail: &[E],
    heads: usize,
    n: usize,
    scale: f32,
    p: &mut [f32],
    ctx: &mut [f32],
) {
    assert!(n > 0, "latent_attention: no cached rows");
    causal_latent_attention_body(q_lat, q_tail, latent, tail, heads, 1, n, scale, p, ctx);
}

/// Cached rows widened per tile.
const KEY_TILE: usize = 16;

/// [`causal_latent_attention`]: the checks, then the operations (compiled once per backend,
/// the same operations on each).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn causal_latent_attention_body<E: CacheValue>(
    q_lat: &[f32],
    q_tail: &[f32],
    latent: &[E],
    tail: &[E],
    heads: usize,
    queries: usize,
    n0: usize,
    scale: f32,
    p: &mut [f32],
    ctx: &mut [f32],
) {
    assert!(
        heads > 0 && queries > 0,
        "latent_attention: no heads or queries"
    );
    assert!(n0 > 0, "latent_attention: no cached rows");
    let rows = heads * queries;
    let (kvl, dr) = (q_lat.len() / rows, q_tail.len() / rows);
    let stride = n0 + queries - 1;
    assert_eq!(q_lat.len(), rows * kvl, "latent_attention: q_lat length");
    assert_eq!(q_tail.len(), rows * dr, "latent_attention: q_tail length");
    assert!(
        latent.len() >= stride * kvl,
        "latent_attention: latent rows"
    );
    assert!(tail.len() >= stride * dr, "latent_attention: tail rows");
    assert_eq!(
        p.len(),
        rows * stride,
        "latent_attention: probability length"
    );
    assert_eq!(ctx.len(), rows * kvl, "latent_attention: context length");
    // Keys seen by row r (query r / heads).
    let len = |r: usize| n0 + r / heads;
    let mut cw = vec![0f32; KEY_TILE * kvl];
    let mut tw = vec![0f32; KEY_TILE * dr];

    // Scores, one tile of cached rows at a time (widened once for every row of the block).
    for s0 in (0..stride).step_by(KEY_TILE) {
        let s1 = (s0 + KEY_TILE).min(stride);
        widen_row(&latent[s0 * kvl..s1 * kvl], &mut cw[..(s1 - s0) * kvl]);
        widen_row(&tail[s0 * dr..s1 * dr], &mut tw[..(s1 - s0) * dr]);
        for r in 0..rows {
            let e = s1.min(len(r));
            let (ql, qt) = (
                &q_lat[r * kvl..(r + 1) * kvl],
                &q_tail[r * dr..(r + 1) * dr],
            );
            for s in s0..e {
                let k = s - s0;
                let a = dot(ql, &cw[k * kvl..(k + 1) * kvl]);
                let b = dot(qt, &tw[k * dr..(k + 1) * dr]);
                p[r * stride + s] = (a + b) * scale;
            }
        }
    }
    for r in 0..rows {
        softmax_inplace(&mut p[r * stride..r * stride + len(r)]);
    }
    // Contexts: ctx_r = Σ_s p_r(s) ĉ(s), s in order.
    ctx.fill(0.0);
    for s0 in (0..stride).step_by(KEY_TILE) {
        let s1 = (s0 + KEY_TILE).min(stride);
        widen_row(&latent[s0 * kvl..s1 * kvl], &mut cw[..(s1 - s0) * kvl]);
        for (r, ch) in ctx.chunks_exact_mut(kvl).enumerate() {
            let e = s1.min(len(r));
            for s in s0..e {
                let ps = p[r * stride + s];
                let k = s - s0;
                for (a, &b) in ch.iter_mut().zip(&cw[k * kvl..(k + 1) * kvl]) {
                    *a += ps * b;
                }
            }
        }
    }
}

#[inline(always)]
fn widen_row<E: CacheValue>(x: &[E], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v.widen();
    }
}

/// `Σ w_c x_c` over a bf16 row, in the fixed order of [`latent_attention`]'s dot products.
///
/// # Panics
/// If the lengths differ.
pub fn dot_bf16_f32(w: &[bf16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_bf16_f32: lengths");
    dot_widened(w, x, |v| v.widen())
}

/// `Σ (s·q_c) x_c` over a row-int8 row with scale `s` (each weight dequantised as `s·q`, then
/// multiplied), in the fixed order of [`dot_bf16_f32`].
///
/// # Panics
/// If the lengths differ.
pub fn dot_i8_f32(q: &[i8], s: f32, x: &[f32]) -> f32 {
    assert_eq!(q.len(), x.len(), "dot_i8_f32: lengths");
    dot_widened(q, x, |v| s * v as f32)
}

/// `out_c += alpha · (s·q_c)` over a row-int8 row with scale `s`: each element on its own, so
/// every backend gives the same bits.
///
/// # Panics
/// If the lengths differ.
pub fn axpy_i8_f32(q: &[i8], s: f32, alpha: f32, out: &mut [f32]) {
    assert_eq!(q.len(), out.len(), "axpy_i8_f32: lengths");
    axpy_widened(q, alpha, out, |v| s * v as f32)
}

/// `out_c += alpha · w_c` over a bf16 row, element by element (the same bits on every backend).
///
/// # Panics
/// If the lengths differ.
pub fn axpy_bf16_f32(w: &[bf16], alpha: f32, out: &mut [f32]) {
    assert_eq!(w.len(), out.len(), "axpy_bf16_f32: lengths");
    axpy_widened(w, alpha, out, |v| v.widen())
}

crate::simd::simd_versions! {
    /// `out_c += alpha · widen(w_c)`, compiled for the selected backend.
    #[inline(always)]
    fn axpy_widened<T: Copy>(w: &[T], alpha: f32, out: &mut [f32], widen: impl Fn(T) -> f32) =
        axpy_widened_body;
}

#[inline(always)]
fn axpy_widened_body<T: Copy>(w: &[T], alpha: f32, out: &mut [f32], widen: impl Fn(T) -> f32) {
    for (a, &v) in out.iter_mut().zip(w) {
        *a += alpha * widen(v);
    }
}

crate::simd::simd_versions! {
    /// `Σ widen(w_c) x_c` in 16 lane sums and [`crate::kda_chunk::reduce_lanes`], compiled for
    /// the selected backend (the same operations, so the same bits, on each).
    #[inline(always)]
    fn dot_widened<T: Copy>(w: &[T], x: &[f32], widen: impl Fn(T) -> f32) -> f32 = dot_widened_body;
}

#[inline(always)]
fn dot_widened_body<T: Copy>(w: &[T], x: &[f32], widen: impl Fn(T) -> f32) -> f32 {
    let mut lanes = [0f32; 16];
    let (wc, xc) = (w.chunks_exact(16), x.chunks_exact(16));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for l in 0..16 {
            lanes[l] += widen(a[l]) * b[l];
        }
    }
    for (l, (&a, b)) in wr.iter().zip(xr).enumerate() {
        lanes[l] += widen(a) * b;
    }
    crate::kda_chunk::reduce_lanes(lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f64_and_is_head_group_invariant() {
        let (heads, kvl, dr, n) = (4, 40, 8, 23);
        let v = |i: usize| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.7;
        let q_lat: Vec<f32> = (0..heads * kvl).map(v).collect();
        let q_tail: Vec<f32> = (0..heads * dr).map(|i| v(i + 7)).collect();
        let latent: Vec<bf16> = (0..n * kvl).map(|i| bf16::from_f32(v(i + 3))).collect();
        let tail: Vec<bf16> = (0..n * dr).map(|i| bf16::from_f32(v(i + 11))).collect();
        let scale = 0.3;
        let mut p = vec![0f32; heads * n];
        let mut ctx = vec![0f32; heads * kvl];
        latent_attention(
            &q_lat, &q_tail, &latent, &tail, heads, n, scale, &mut p, &mut ctx,
        );
        for hh in 0..heads {
            let sc: Vec<f64> = (0..n)
                .map(|s| {
                    let a: f64 = (0..kvl)
                        .map(|c| q_lat[hh * kvl + c] as f64 * latent[s * kvl + c].to_f64())
                        .sum();
                    let b: f64 = (0..dr)
                        .map(|c| q_tail[hh * dr + c] as f64 * tail[s * dr + c].to_f64())
                        .sum();
                    (a + b) * scale as f64
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
            for c in 0..kvl {
                let want: f64 = (0..n)
                    .map(|s| (sc[s] - m).exp() / z * latent[s * kvl + c].to_f64())
                    .sum();
                let got = ctx[hh * kvl + c] as f64;
                assert!(
                    (got - want).abs() < 1e-5,
                    "head {hh} c {c}: {got} vs {want}"
                );
            }
            // One head alone gives the same bits as inside the group.
            let mut p1 = vec![0f32; n];
            let mut c1 = vec![0f32; kvl];
            latent_attention(
                &q_lat[hh * kvl..(hh + 1) * kvl],
                &q_tail[hh * dr..(hh + 1) * dr],
                &latent,
                &tail,
                1,
                n,
                scale,
                &mut p1,
                &mut c1,
            );
            assert_eq!(&c1[..], &ctx[hh * kvl..(hh + 1) * kvl]);
            assert_eq!(&p1[..], &p[hh * n..(hh + 1) * n]);
        }
    }

    /// The one-query form, written out plainly: each score a 16-lane dot product, the
    /// softmax of `ops::softmax_inplace`, each context element summed over the rows in order.
    fn one_query(
        q_lat: &[f32],
        q_tail: &[f32],
        latent: &[bf16],
        tail: &[bf16],
        n: usize,
        scale: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let (kvl, dr) = (q_lat.len(), q_tail.len());
        let w = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        let mut p: Vec<f32> = (0..n)
            .map(|s| {
                let a = portable_dot(q_lat, &w(&latent[s * kvl..(s + 1) * kvl]), |v| v);
                let b = portable_dot(q_tail, &w(&tail[s * dr..(s + 1) * dr]), |v| v);
                (a + b) * scale
            })
            .collect();
        crate::ops::softmax_inplace(&mut p);
        let mut ctx = vec![0f32; kvl];
        for (s, &ps) in p.iter().enumerate() {
            for (a, b) in ctx.iter_mut().zip(w(&latent[s * kvl..(s + 1) * kvl])) {
                *a += ps * b;
            }
        }
        (p, ctx)
    }

    #[test]
    fn causal_blocks_give_every_query_the_one_query_bits() {
        let v = |i: usize| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.9;
        // (heads, kvl, dr, n0, queries): widths on and off the 16-lane and 32-column steps,
        // blocks shorter and longer than a key tile, one head and several.
        for &(heads, kvl, dr, n0, queries) in &[
            (8, 256, 32, 1, 40),
            (8, 64, 16, 37, 9),
            (3, 40, 8, 5, 21),
            (1, 17, 3, 1, 1),
            (5, 33, 7, 16, 17),
            (2, 96, 32, 100, 3),
        ] {
            let rows = heads * queries;
            let total = n0 + queries - 1;
            let q_lat: Vec<f32> = (0..rows * kvl).map(|i| v(i * 3 + 1)).collect();
            let q_tail: Vec<f32> = (0..rows * dr).map(|i| v(i + 7)).collect();
            let latent: Vec<bf16> = (0..total * kvl).map(|i| bf16::from_f32(v(i + 3))).collect();
            let tail: Vec<bf16> = (0..total * dr)
                .map(|i| bf16::from_f32(v(i * 5 + 11)))
                .collect();
            let scale = 0.37;
            let mut p = vec![0f32; rows * total];
            let mut ctx = vec![0f32; rows * kvl];
            causal_latent_attention(
                &q_lat, &q_tail, &latent, &tail, heads, queries, n0, scale, &mut p, &mut ctx,
            );
            for r in 0..rows {
                let n = n0 + r / heads;
                let (pw, cw) = one_query(
                    &q_lat[r * kvl..(r + 1) * kvl],
                    &q_tail[r * dr..(r + 1) * dr],
                    &latent,
                    &tail,
                    n,
                    scale,
                );
                let case = (heads, kvl, dr, n0, queries, r);
                assert_eq!(&p[r * total..r * total + n], &pw[..], "{case:?}");
                assert_eq!(&ctx[r * kvl..(r + 1) * kvl], &cw[..], "{case:?}");
            }
            // One query of the block alone, through the one-query entry.
            let i = queries - 1;
            let n = n0 + i;
            let mut p1 = vec![0f32; heads * n];
            let mut c1 = vec![0f32; heads * kvl];
            latent_attention(
                &q_lat[i * heads * kvl..],
                &q_tail[i * heads * dr..],
                &latent,
                &tail,
                heads,
                n,
                scale,
                &mut p1,
                &mut c1,
            );
            assert_eq!(&c1[..], &ctx[i * heads * kvl..]);
        }
    }

    #[test]
    fn bf16_dot_matches_portable_body() {
        let w: Vec<bf16> = (0..75)
            .map(|i| bf16::from_f32(i as f32 * 0.01 - 0.3))
            .collect();
        let x: Vec<f32> = (0..75).map(|i| (i as f32 * 0.37).sin()).collect();
        let want: f64 = w.iter().zip(&x).map(|(a, &b)| a.to_f64() * b as f64).sum();
        let got = dot_bf16_f32(&w, &x);
        assert!((got as f64 - want).abs() < 1e-5);
        assert_eq!(
            got.to_bits(),
            portable_dot(&w, &x, |v| v.to_f32()).to_bits()
        );
    }

    /// The lane order of [`dot_widened`] written out plainly.
    fn portable_dot<T: Copy>(w: &[T], x: &[f32], widen: impl Fn(T) -> f32) -> f32 {
        let mut lanes = [0f32; 16];
        for (c, (&a, &b)) in w.iter().zip(x).enumerate() {
            lanes[c % 16] += widen(a) * b;
        }
        crate::kda_chunk::reduce_lanes(lanes)
    }

    #[test]
    fn int8_dot_and_the_axpys_match_the_portable_order() {
        for len in [1usize, 15, 16, 17, 75, 256] {
            let q: Vec<i8> = (0..len).map(|i| (i * 53 % 255) as i32 as i8).collect();
            let x: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let s = 0.0123f32;
            let want: f64 = q
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (s * a as f32) as f64 * b as f64)
                .sum();
            let got = dot_i8_f32(&q, s, &x);
            assert!((got as f64 - want).abs() < 1e-5, "{len}: {got} vs {want}");
            assert_eq!(
                got.to_bits(),
                portable_dot(&q, &x, |v| s * v as f32).to_bits(),
                "{len}"
            );
            let mut out: Vec<f32> = (0..len).map(|i| i as f32 * 0.5).collect();
            let mut want = out.clone();
            for (a, &v) in want.iter_mut().zip(&q) {
                *a += -1.5 * (s * v as f32);
            }
            axpy_i8_f32(&q, s, -1.5, &mut out);
            assert_eq!(out, want, "{len}");
            let w: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let mut want = out.clone();
            for (a, &v) in want.iter_mut().zip(&w) {
                *a += 0.25 * v.to_f32();
            }
            axpy_bf16_f32(&w, 0.25, &mut out);
            assert_eq!(out, want, "{len}");
        }
    }
}
