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
    /// contexts to `ctx` (`heads` rows of `kvl`).
    ///
    /// # Panics
    /// If a length disagrees with `heads`, `n` or the row widths.
    pub fn latent_attention<E: CacheValue>(q_lat: &[f32], q_tail: &[f32], latent: &[E],
        tail: &[E], heads: usize, n: usize, scale: f32, p: &mut [f32], ctx: &mut [f32])
        = latent_attention_body;
}

/// [`latent_attention`]: the checks, then the operations (compiled once per backend, the same
/// operations on each).
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
    assert!(heads > 0, "latent_attention: no heads");
    let (kvl, dr) = (q_lat.len() / heads, q_tail.len() / heads);
    assert_eq!(q_lat.len(), heads * kvl, "latent_attention: q_lat length");
    assert_eq!(q_tail.len(), heads * dr, "latent_attention: q_tail length");
    assert!(latent.len() >= n * kvl, "latent_attention: latent rows");
    assert!(tail.len() >= n * dr, "latent_attention: tail rows");
    assert_eq!(p.len(), heads * n, "latent_attention: probability length");
    assert_eq!(ctx.len(), heads * kvl, "latent_attention: context length");
    let mut cw = vec![0f32; kvl];
    let mut tw = vec![0f32; dr];
    for s in 0..n {
        widen_row(&latent[s * kvl..(s + 1) * kvl], &mut cw);
        widen_row(&tail[s * dr..(s + 1) * dr], &mut tw);
        for hh in 0..heads {
            let a = dot(&q_lat[hh * kvl..(hh + 1) * kvl], &cw);
            let b = dot(&q_tail[hh * dr..(hh + 1) * dr], &tw);
            p[hh * n + s] = (a + b) * scale;
        }
    }
    for ph in p.chunks_exact_mut(n) {
        softmax_inplace(ph);
    }
    ctx.fill(0.0);
    for s in 0..n {
        widen_row(&latent[s * kvl..(s + 1) * kvl], &mut cw);
        for (hh, ch) in ctx.chunks_exact_mut(kvl).enumerate() {
            let ps = p[hh * n + s];
            for (a, &b) in ch.iter_mut().zip(&cw) {
                *a += ps * b;
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
