//! Attention Residuals (docs/K3.md §4.2): a softmax mix across depth, per position.
//!
//! ```text
//! AR(P; S; w_norm, w_proj):
//!     V_j = S_j (j < n), V_n = P
//!     u   = w_norm ⊙ w_proj                                  (f32)
//!     s_j = Σ_c u_c · V_j,c / √(mean_c(V_j²) + ε)            (not rounded)
//!     α   = softmax_j(s)
//!     AR  = Σ_j α_j · V_j                                    (the raw candidates)
//! ```

use deltafin_kernels::{reduce_lanes, softmax_inplace};

/// One AttnRes site: `*_res_norm.weight` and `*_res_proj.weight` (read as a vector), widened
/// to f32.
#[derive(Clone, Debug)]
pub struct AttnResWeights {
    /// `*_res_norm.weight` `[D]`.
    pub norm: Vec<f32>,
    /// `*_res_proj.weight` `[1, D]` as a vector.
    pub proj: Vec<f32>,
}

impl AttnResWeights {
    /// Mix one position: `snapshots` are `S_0..S_{n−1}` and `partial` is `P`, each of width D.
    ///
    /// # Panics
    /// If a candidate or `out` has a width other than D (internal invariant).
    pub fn mix(&self, snapshots: &[&[f32]], partial: &[f32], eps: f32, out: &mut [f32]) {
        let d = self.norm.len();
        assert_eq!(self.proj.len(), d, "AttnRes: proj width");
        assert_eq!(partial.len(), d, "AttnRes: partial-sum width");
        assert_eq!(out.len(), d, "AttnRes: output width");
        let n = snapshots.len() + 1;
        let cand = |j: usize| {
            if j < snapshots.len() {
                snapshots[j]
            } else {
                partial
            }
        };
        let mut scores = [0f32; 32];
        let mut scores_vec;
        let s: &mut [f32] = if n <= scores.len() {
            &mut scores[..n]
        } else {
            scores_vec = vec![0f32; n];
            &mut scores_vec
        };
        for (j, sj) in s.iter_mut().enumerate() {
            let v = cand(j);
            assert_eq!(v.len(), d, "AttnRes: snapshot width");
            let (sq, dot) = self.sq_and_dot(v);
            *sj = dot / (sq / d as f32 + eps).sqrt();
        }
        softmax_inplace(s);
        out.fill(0.0);
        for (j, &a) in s.iter().enumerate() {
            for (o, &v) in out.iter_mut().zip(cand(j)) {
                *o += a * v;
            }
        }
    }

    /// `(Σ_c V_c², Σ_c u_c·V_c)` with `u_c = norm_c · proj_c`, each in 16 lane sums (column
    /// `c` in lane `c mod 16`) and a fixed pairwise reduction: independent chains the CPU
    /// overlaps, where one running sum per quantity waited on every addition.
    fn sq_and_dot(&self, v: &[f32]) -> (f32, f32) {
        let (mut sq, mut dot) = ([0f32; 16], [0f32; 16]);
        let (vc, nc, pc) = (
            v.chunks_exact(16),
            self.norm.chunks_exact(16),
            self.proj.chunks_exact(16),
        );
        let (vr, nr, pr) = (vc.remainder(), nc.remainder(), pc.remainder());
        for ((v, n), p) in vc.zip(nc).zip(pc) {
            for l in 0..16 {
                sq[l] += v[l] * v[l];
                dot[l] += (n[l] * p[l]) * v[l];
            }
        }
        for (l, ((&v, &n), &p)) in vr.iter().zip(nr).zip(pr).enumerate() {
            sq[l] += v * v;
            dot[l] += (n * p) * v;
        }
        (reduce_lanes(sq), reduce_lanes(dot))
    }

    /// Mix `t` positions at once: each snapshot and `partial` hold `t` rows of width D.
    pub fn mix_rows(
        &self,
        snapshots: &[Vec<f32>],
        partial: &[f32],
        t: usize,
        eps: f32,
    ) -> Vec<f32> {
        let d = self.norm.len();
        let mut out = vec![0f32; t * d];
        let mut rows: Vec<&[f32]> = Vec::with_capacity(snapshots.len());
        for (r, o) in out.chunks_exact_mut(d).enumerate() {
            rows.clear();
            rows.extend(snapshots.iter().map(|s| &s[r * d..(r + 1) * d]));
            self.mix(&rows, &partial[r * d..(r + 1) * d], eps, o);
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_util::{Rng, rel_l2};

    /// f64 reference of `AR` for one position.
    pub(crate) fn attn_res64(w: &AttnResWeights, cands: &[Vec<f64>], eps: f64) -> Vec<f64> {
        let d = w.norm.len();
        let u: Vec<f64> = (0..d)
            .map(|c| (w.norm[c] * w.proj[c]) as f64) // f32 product, as the reference
            .collect();
        let s: Vec<f64> = cands
            .iter()
            .map(|v| {
                let ms = v.iter().map(|x| x * x).sum::<f64>() / d as f64;
                let r = (ms + eps).sqrt();
                (0..d).map(|c| u[c] * v[c] / r).sum()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..d)
            .map(|c| cands.iter().zip(&e).map(|(v, a)| a / z * v[c]).sum())
            .collect()
    }

    #[test]
    fn matches_f64_reference() {
        let mut rng = Rng(3);
        let d = 48;
        let w = AttnResWeights {
            norm: rng.around_one(d, 0.3),
            proj: rng.vec(d, 0.5),
        };
        for n in [1usize, 2, 5, 9, 40] {
            let cands: Vec<Vec<f32>> = (0..n).map(|j| rng.vec(d, 1.0 + j as f32)).collect();
            let snaps: Vec<&[f32]> = cands[..n - 1].iter().map(|v| v.as_slice()).collect();
            let mut out = vec![0f32; d];
            w.mix(&snaps, &cands[n - 1], 1e-5, &mut out);
            let c64: Vec<Vec<f64>> = cands
                .iter()
                .map(|v| v.iter().map(|&x| x as f64).collect())
                .collect();
            let want = attn_res64(&w, &c64, 1e-5);
            let e = rel_l2(&out, &want);
            assert!(e < 1e-6, "n={n}: rel L2 {e}");
        }
    }

    #[test]
    fn mixes_raw_candidates_per_row() {
        // Two positions with swapped candidates must give independent results.
        let d = 8;
        let w = AttnResWeights {
            norm: vec![1.0; d],
            proj: vec![1.0; d],
        };
        let a: Vec<f32> = (0..d).map(|c| c as f32).collect();
        let b: Vec<f32> = vec![-3.0; d];
        let snap = [a.clone(), b.clone()].concat();
        let part = [b.clone(), a.clone()].concat();
        let out = w.mix_rows(&[snap], &part, 2, 1e-5);
        let mut one = vec![0f32; d];
        w.mix(&[&a], &b, 1e-5, &mut one);
        assert_eq!(&out[..d], &one[..]);
        w.mix(&[&b], &a, 1e-5, &mut one);
        assert_eq!(&out[d..], &one[..]);
    }
}
