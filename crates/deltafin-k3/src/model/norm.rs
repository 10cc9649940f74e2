//! RMS normalisation over rows (docs/K3.md §4.0 `RMS_ε`, computed in f32 without the BF16
//! rounding step, per the f32-activation policy).

use deltafin_kernels::rms_norm;

/// Normalise each row of `xs` (row width `w.len()`) into `out`: `w ⊙ x / √(mean(x²) + eps)`.
///
/// # Panics
/// If `xs` is not a whole number of rows or `out` differs in length (internal invariants).
pub fn rms_norm_rows(xs: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert_eq!(xs.len() % d, 0, "rms_norm_rows: ragged input");
    assert_eq!(xs.len(), out.len(), "rms_norm_rows: output length");
    for (x, o) in xs.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        rms_norm(x, w, eps, o);
    }
}

/// [`rms_norm_rows`] returning a new buffer.
pub fn rms_norm_rows_new(xs: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; xs.len()];
    rms_norm_rows(xs, w, eps, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{Rng, rel_l2, rms64, to64};

    #[test]
    fn rows_match_f64() {
        let mut rng = Rng(7);
        let (d, t) = (24, 5);
        let xs = rng.vec(d * t, 3.0);
        let w = rng.around_one(d, 0.2);
        let out = rms_norm_rows_new(&xs, &w, 1e-5);
        for r in 0..t {
            let want = rms64(&to64(&xs[r * d..(r + 1) * d]), &w, 1e-5);
            assert!(rel_l2(&out[r * d..(r + 1) * d], &want) < 1e-6);
        }
    }
}
