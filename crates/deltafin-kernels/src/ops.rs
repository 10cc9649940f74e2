//! Element-wise operations in f32 (docs/K3.md §4.0, §4.8).

/// Sum of squares with independent accumulators (fixed order).
#[inline]
fn sum_sq(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let main = x.len() - x.len() % 8;
    for c in (0..main).step_by(8) {
        for k in 0..8 {
            acc[k] += x[c + k] * x[c + k];
        }
    }
    let tail: f32 = x[main..].iter().map(|v| v * v).sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `out = w ⊙ x / √(mean(x²) + eps)`.
///
/// # Panics
/// If `x`, `w`, `out` differ in length.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), w.len(), "rms_norm: weight length");
    assert_eq!(x.len(), out.len(), "rms_norm: output length");
    let inv = 1.0 / (sum_sq(x) / x.len() as f32 + eps).sqrt();
    for ((o, &v), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (v * inv);
    }
}

/// In-place [`rms_norm`].
///
/// # Panics
/// If `x` and `w` differ in length.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    assert_eq!(x.len(), w.len(), "rms_norm_inplace: weight length");
    let inv = 1.0 / (sum_sq(x) / x.len() as f32 + eps).sqrt();
    for (v, &wi) in x.iter_mut().zip(w) {
        *v = wi * (*v * inv);
    }
}

/// `σ(x) = 1 / (1 + e^(−x))`, with the vectorisable `e^x` of [`crate::vmath`] (bit-identical
/// to [`crate::vmath::sigmoid_inplace`] on every element).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    crate::vmath::sigmoid_one(x)
}

/// `SiLU(x) = x · σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Numerically stable softmax in place (max subtracted). An empty slice is left as is.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        // All −∞ (or empty / NaN): nothing sensible to normalise; leave NaN to propagate.
        if x.is_empty() || max.is_nan() {
            return;
        }
    }
    for v in x.iter_mut() {
        *v -= max;
    }
    crate::vmath::exp_inplace(x);
    let mut sum = 0f32;
    for v in x.iter() {
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// SiTU-GLU (docs/K3.md §4.8): `out = [β₁·tanh(g/β₁)·σ(g)] · [β₂·tanh(u/β₂)]`; σ takes the
/// raw `g`. Computed by [`crate::vmath::situ_glu`] (vectorised, bit-identical on every
/// backend and at every slice position).
///
/// # Panics
/// If `g`, `u`, `out` differ in length.
pub fn situ_glu(g: &[f32], u: &[f32], beta1: f32, beta2: f32, out: &mut [f32]) {
    crate::vmath::situ_glu(g, u, beta1, beta2, out)
}

/// `x ← x / √(Σ x² + eps)` (FLA `l2norm`: the epsilon is inside the root).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let inv = 1.0 / (sum_sq(x) + eps).sqrt();
    for v in x.iter_mut() {
        *v *= inv;
    }
}

crate::simd::simd_versions! {
    /// One step of the KDA delta rule for one head (docs/K3.md §4.3 step 6), the state `s`
    /// row-major `[d (key), d (value)]`, `d = q.len()`:
    ///
    /// ```text
    /// S′ = diag(e^g) S;   u = β (v − S′ᵀ k̂);   S = S′ + k̂ uᵀ;   o += Sᵀ q̂
    /// ```
    ///
    /// Every value is computed by the same element-wise f32 operations in the same order on
    /// every backend (a multiply, then a subtract or add: never fused), so the result does not
    /// depend on the vector width; the AVX-512 and AVX2 builds only process more columns per
    /// instruction. The state is read twice and written once: the first pass forms `S′` only in
    /// registers for `u`, the second forms it again (the same products, so the same values) and
    /// stores `S` — a third less state traffic than storing `S′` in between (decode on `mini`,
    /// int8 spine: 1.022×; docs/PERFORMANCE.md, "Kernel and scheduling details that each
    /// measured a gain"). `u` is scratch of `d` values; `o` (of `d` values) is accumulated into.
    ///
    /// # Panics
    /// If the lengths disagree (`s.len() == d²`, every vector of length `d`).
    pub fn kda_delta_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: f32,
        u: &mut [f32], o: &mut [f32]) = kda_delta_step_body;
}

/// [`kda_delta_step`]: the checks, then the operations (compiled once per backend). The inner
/// loops run over whole rows through `zip`, so they carry no bounds checks and vectorise over
/// the value columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn kda_delta_step_body(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    u: &mut [f32],
    o: &mut [f32],
) {
    let d = q.len();
    assert_eq!(s.len(), d * d, "kda_delta_step: state size");
    for (n, len) in [("k", k.len()), ("v", v.len()), ("g", g.len())] {
        assert_eq!(len, d, "kda_delta_step: {n} length");
    }
    assert_eq!(u.len(), d, "kda_delta_step: scratch length");
    assert_eq!(o.len(), d, "kda_delta_step: output length");
    // u = β (v − S′ᵀ k̂) with S′ = diag(α) S, S′ not stored: this pass only reads the state.
    u.copy_from_slice(v);
    for ((row, &gr), &kr) in s.chunks_exact(d).zip(g).zip(k) {
        let alpha = crate::vmath::exp_one(gr);
        for (&x, ui) in row.iter().zip(u.iter_mut()) {
            *ui -= kr * (x * alpha);
        }
    }
    for ui in u.iter_mut() {
        *ui *= beta;
    }
    // S = S′ + k̂ uᵀ (S′ formed again: the same products, so the same values);  o += Sᵀ q̂
    for (((row, &gr), &kr), &qr) in s.chunks_exact_mut(d).zip(g).zip(k).zip(q) {
        let alpha = crate::vmath::exp_one(gr);
        for ((x, &ui), oc) in row.iter_mut().zip(u.iter()).zip(o.iter_mut()) {
            *x = *x * alpha + kr * ui;
            *oc += qr * *x;
        }
    }
}

/// Index of the first maximum (torch `argmax` semantics; a NaN counts as the maximum).
/// `None` for an empty slice. Long slices (a vocabulary of logits) are scanned in parallel
/// chunks; the combination (first NaN, else the largest value at its lowest index) gives the
/// serial scan's answer whatever the split.
pub fn argmax(x: &[f32]) -> Option<usize> {
    use rayon::prelude::*;
    /// Values per parallel chunk.
    const CHUNK: usize = 8192;
    if x.len() < 4 * CHUNK || rayon::current_num_threads() == 1 {
        return argmax_serial(x).map(|(i, _)| i);
    }
    x.par_chunks(CHUNK)
        .enumerate()
        .filter_map(|(c, part)| argmax_serial(part).map(|(i, v)| (c * CHUNK + i, v)))
        .reduce_with(|a, b| {
            let (first, second) = if a.0 <= b.0 { (a, b) } else { (b, a) };
            // `first` lies before `second`: it wins unless `second` is strictly larger or is
            // a NaN that `first` is not.
            match (first.1.is_nan(), second.1.is_nan()) {
                (true, _) => first,
                (false, true) => second,
                (false, false) if second.1 > first.1 => second,
                _ => first,
            }
        })
        .map(|(i, _)| i)
}

/// The serial scan behind [`argmax`]: index and value of the first NaN, else of the first
/// maximum.
fn argmax_serial(x: &[f32]) -> Option<(usize, f32)> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            return Some((i, v));
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64, rel: f64) {
        assert!(
            (a as f64 - b).abs() <= rel * b.abs().max(1e-30) + 1e-12,
            "{a} vs {b}"
        );
    }

    #[test]
    fn rms_norm_matches_f64() {
        let x: Vec<f32> = (0..37).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
        let w: Vec<f32> = (0..37).map(|i| 0.5 + i as f32 * 0.01).collect();
        let mut out = vec![0f32; 37];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 37.0;
        for i in 0..37 {
            close(out[i], w[i] as f64 * x[i] as f64 / (ms + 1e-5).sqrt(), 1e-6);
        }
        let mut y = x.clone();
        rms_norm_inplace(&mut y, &w, 1e-5);
        assert_eq!(y, out);
    }

    #[test]
    fn parallel_argmax_equals_the_serial_scan() {
        let pools = crate::test_shared::pools();
        let mut seed = 0x9e37_79b9_u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for case in 0..40 {
            let n = [40_000, 65_536, 100_003, 163_840][case % 4];
            // Few distinct values, so the maximum is tied across chunks.
            let mut x: Vec<f32> = (0..n).map(|_| (next() % 7) as f32 - 3.0).collect();
            match case % 5 {
                1 => x[(next() as usize) % n] = f32::NAN,
                2 => {
                    x[(next() as usize) % n] = f32::NAN;
                    x[(next() as usize) % n] = f32::NAN;
                }
                3 => x.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                4 => x[n - 1] = 100.0,
                _ => {}
            }
            let want = argmax_serial(&x).map(|(i, _)| i);
            for pool in &pools {
                assert_eq!(pool.install(|| argmax(&x)), want, "case {case}, n {n}");
            }
        }
    }

    #[test]
    fn softmax_and_argmax() {
        let mut x = vec![1.0f32, 3.0, 3.0, -2.0, 1000.0];
        assert_eq!(argmax(&x), Some(4));
        x[4] = 0.0;
        assert_eq!(argmax(&x), Some(1), "first index of the maximum");
        assert_eq!(argmax(&[]), None);
        softmax_inplace(&mut x);
        let e: Vec<f64> = [1.0f64, 3.0, 3.0, -2.0, 0.0]
            .iter()
            .map(|v| v.exp())
            .collect();
        let s: f64 = e.iter().sum();
        for i in 0..5 {
            close(x[i], e[i] / s, 1e-6);
        }
        let mut big = vec![1000.0f32, 1001.0];
        softmax_inplace(&mut big);
        close(big[1], 1.0 / (1.0 + (-1.0f64).exp()), 1e-6);
    }

    #[test]
    fn situ_matches_definition() {
        let g = [-30.0f32, -1.0, 0.0, 0.3, 2.0, 9.0];
        let u = [100.0f32, -0.5, 3.0, -40.0, 0.1, 25.0];
        let mut out = [0f32; 6];
        situ_glu(&g, &u, 4.0, 25.0, &mut out);
        for i in 0..6 {
            let (gd, ud) = (g[i] as f64, u[i] as f64);
            let want = 4.0 * (gd / 4.0).tanh() / (1.0 + (-gd).exp()) * (25.0 * (ud / 25.0).tanh());
            close(out[i], want, 1e-6);
        }
        close(silu(2.0), 2.0 / (1.0 + (-2.0f64).exp()), 1e-6);
    }

    #[test]
    fn l2_eps_inside_root() {
        let mut x = vec![3.0f32, 4.0];
        l2_normalize(&mut x, 1e-6);
        close(x[0], 3.0 / (25.0f64 + 1e-6).sqrt(), 1e-7);
        let mut z = vec![0f32; 3];
        l2_normalize(&mut z, 1e-6);
        assert_eq!(z, vec![0.0; 3]);
    }
}
