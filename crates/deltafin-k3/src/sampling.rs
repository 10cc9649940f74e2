//! Seeded sampling that K3 still decides (docs/NUMERICS.md "Sampling").
//!
//! The emitted token at generated position `step` is a draw from K3's filtered distribution
//! with that position's own random number: `u = U(seed, step)`, from ChaCha20 keyed by the seed
//! with the position as its stream, so a token's randomness never depends on how many draws
//! came before. That makes a run reproducible bit for bit whatever the thread count, batch
//! width, streaming or drafting: verification asks this same rule for each verified row and
//! accepts a draft iff it equals the draw (identity acceptance), so a drafted run emits exactly
//! the ids of a plain one with the same seed.
//!
//! The filters, in vLLM's order: temperature, min-p, top-k, top-p. All of it runs in f64 in a
//! fixed order. Without a temperature (or 0) decoding is greedy and this module is not used.

use crate::generate::Choose;
use rand_chacha::ChaCha20Rng;
use rand_core::{RngCore, SeedableRng};

/// Sampling settings of one generation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature, > 0.
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest most-likely set whose probability reaches `top_p` (1: all).
    pub top_p: f64,
    /// Drop tokens less likely than `min_p` × the most likely one's probability (0: none).
    pub min_p: f64,
    /// The seed of every position's random number.
    pub seed: u64,
}

impl Sampling {
    /// Checked settings: temperature finite and > 0, `top_p` in (0, 1], `min_p` in [0, 1].
    pub fn new(
        temperature: f64,
        top_k: usize,
        top_p: f64,
        min_p: f64,
        seed: u64,
    ) -> Result<Sampling, String> {
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(format!("temperature {temperature} must be finite and > 0"));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(format!("top_p {top_p} must be in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&min_p) {
            return Err(format!("min_p {min_p} must be in [0, 1]"));
        }
        Ok(Sampling {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
        })
    }

    /// The random number of generated position `step`, uniform in [0, 1) (53 bits).
    pub fn uniform(&self, step: usize) -> f64 {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        let mut rng = ChaCha20Rng::from_seed(key);
        rng.set_stream(step as u64);
        (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// The filtered distribution over the ids `allowed` admits: `(id, weight)` with weights
    /// proportional to the probabilities (the largest is 1), in sampling order. Empty when no
    /// allowed id has a finite logit.
    pub fn distribution(&self, logits: &[f32], allowed: &dyn Fn(u32) -> bool) -> Vec<(u32, f64)> {
        let t = self.temperature;
        let mut max = f64::NEG_INFINITY;
        for (id, &l) in logits.iter().enumerate() {
            if l.is_finite() && allowed(id as u32) {
                max = max.max(f64::from(l) / t);
            }
        }
        if !max.is_finite() {
            return Vec::new();
        }
        // Temperature, then min-p (relative to the most likely token, whose weight is 1).
        let mut kept: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|&(id, l)| l.is_finite() && allowed(id as u32))
            .map(|(id, &l)| (id as u32, (f64::from(l) / t - max).exp()))
            .filter(|&(_, w)| w >= self.min_p)
            .collect();
        let by_weight = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.top_k > 0 && self.top_k < kept.len() {
            kept.select_nth_unstable_by(self.top_k - 1, by_weight);
            kept.truncate(self.top_k);
        }
        if self.top_p < 1.0 {
            let target = self.top_p * kept.iter().map(|x| x.1).sum::<f64>();
            // Sort only the head: every weight ≥ t, for the largest t of the ladder whose
            // head already reaches the target. Those are exactly the first entries of the
            // whole sorted list, so the nucleus is the same as after a full sort.
            for t in [0.5, 0.1, 1e-2, 1e-3, 1e-4, 1e-6, 0.0] {
                let head: f64 = kept.iter().filter(|x| x.1 >= t).map(|x| x.1).sum();
                if head >= target || t == 0.0 {
                    kept.retain(|x| x.1 >= t);
                    break;
                }
            }
            kept.sort_by(by_weight);
            let mut acc = 0.0;
            let mut n = 0;
            for &(_, w) in &kept {
                acc += w;
                n += 1;
                if acc >= target {
                    break;
                }
            }
            kept.truncate(n.max(1));
        } else if self.top_k > 0 {
            kept.sort_by(by_weight);
        }
        kept
    }

    /// The draw of position `step` from `logits` restricted to `allowed` (`None` when nothing
    /// is allowed).
    pub fn sample(
        &self,
        step: usize,
        logits: &[f32],
        allowed: &dyn Fn(u32) -> bool,
    ) -> Option<u32> {
        let dist = self.distribution(logits, allowed);
        let total: f64 = dist.iter().map(|x| x.1).sum();
        let target = self.uniform(step) * total;
        let mut acc = 0.0;
        for &(id, w) in &dist {
            acc += w;
            if target < acc {
                return Some(id);
            }
        }
        dist.last().map(|x| x.0)
    }
}

/// The sampling token rule: every position's draw, from the whole vocabulary.
#[derive(Clone, Copy, Debug)]
pub struct Sampler(pub Sampling);

impl Choose for Sampler {
    fn choose(&mut self, step: usize, logits: &[f32]) -> Result<u32, String> {
        self.0
            .sample(step, logits, &|_| true)
            .ok_or_else(|| "no token has a finite logit".into())
    }
    fn accept(&mut self, _id: u32) -> Result<(), String> {
        Ok(())
    }
}

/// A fresh seed for a request that names none (reported back so the run can be repeated).
pub fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    // JSON clients read integers as doubles: keep seeds exact there.
    h.finish() & ((1u64 << 53) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t: f64, k: usize, p: f64, m: f64) -> Sampling {
        Sampling::new(t, k, p, m, 42).unwrap()
    }

    #[test]
    fn uniform_is_keyed_by_seed_and_position_only() {
        let a = s(1.0, 0, 1.0, 0.0);
        let b = Sampling { seed: 43, ..a };
        assert_eq!(a.uniform(5), a.uniform(5));
        assert_ne!(a.uniform(5), a.uniform(6));
        assert_ne!(a.uniform(5), b.uniform(5));
        for step in 0..1000 {
            let u = a.uniform(step);
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn filters_apply_in_order() {
        // Probabilities ∝ e^{l}: 1, e^-1, e^-2, e^-3, e^-4.
        let l = [0.0f32, -1.0, -2.0, -3.0, -4.0];
        let ids = |x: Sampling| -> Vec<u32> {
            let mut v: Vec<u32> = x.distribution(&l, &|_| true).iter().map(|d| d.0).collect();
            v.sort();
            v
        };
        assert_eq!(ids(s(1.0, 0, 1.0, 0.0)), vec![0, 1, 2, 3, 4]);
        assert_eq!(ids(s(1.0, 2, 1.0, 0.0)), vec![0, 1]);
        // min-p 0.2 keeps weights ≥ 0.2: e^-1 = 0.37 yes, e^-2 = 0.135 no.
        assert_eq!(ids(s(1.0, 0, 1.0, 0.2)), vec![0, 1]);
        // At temperature 2 the weights are e^{-i/2}: e^-1.5 = 0.22 passes min-p 0.2.
        assert_eq!(ids(s(2.0, 0, 1.0, 0.2)), vec![0, 1, 2, 3]);
        // top-p 0.6: p0 = 0.636 reaches it alone.
        assert_eq!(ids(s(1.0, 0, 0.6, 0.0)), vec![0]);
        assert_eq!(ids(s(1.0, 0, 0.9, 0.0)), vec![0, 1, 2]);
        // Disallowed ids never appear.
        let d = s(1.0, 0, 1.0, 0.0).distribution(&l, &|id| id != 0);
        assert_eq!(d[0], (1, 1.0));
    }

    #[test]
    fn draws_follow_the_distribution() {
        let l = [0.3f32, 1.2, -0.5, 0.9, f32::NEG_INFINITY, 0.0];
        let x = Sampling::new(0.8, 0, 1.0, 0.0, 0).unwrap();
        let dist = x.distribution(&l, &|_| true);
        let total: f64 = dist.iter().map(|d| d.1).sum();
        let n = 20_000;
        let mut counts = [0usize; 6];
        for seed in 0..n {
            let y = Sampling { seed, ..x };
            counts[y.sample(0, &l, &|_| true).unwrap() as usize] += 1;
        }
        assert_eq!(counts[4], 0);
        let chi2: f64 = dist
            .iter()
            .map(|&(id, w)| {
                let e = w / total * n as f64;
                (counts[id as usize] as f64 - e).powi(2) / e
            })
            .sum();
        // 4 degrees of freedom: P(χ² > 18.47) = 0.001.
        assert!(chi2 < 18.47, "chi2 {chi2}: {counts:?}");
    }

    #[test]
    fn the_nucleus_equals_the_full_sort_prefix() {
        // A flat-ish row over many ids, where the head ladder matters.
        let l: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 1000) as f32 / 250.0)
            .collect();
        for top_p in [0.05, 0.3, 0.95, 0.999] {
            let x = s(1.0, 0, top_p, 0.0);
            let got = x.distribution(&l, &|_| true);
            let mut all: Vec<(u32, f64)> = l
                .iter()
                .enumerate()
                .map(|(i, &v)| (i as u32, (f64::from(v) - 3.996).exp()))
                .collect();
            all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let total: f64 = all.iter().map(|x| x.1).sum();
            let (mut acc, mut n) = (0.0, 0);
            for &(_, w) in &all {
                acc += w;
                n += 1;
                if acc >= top_p * total {
                    break;
                }
            }
            let want: Vec<u32> = all[..n].iter().map(|x| x.0).collect();
            let got: Vec<u32> = got.iter().map(|x| x.0).collect();
            assert_eq!(got, want, "top_p {top_p}");
        }
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(Sampling::new(0.0, 0, 1.0, 0.0, 1).is_err());
        assert!(Sampling::new(f64::NAN, 0, 1.0, 0.0, 1).is_err());
        assert!(Sampling::new(1.0, 0, 0.0, 0.0, 1).is_err());
        assert!(Sampling::new(1.0, 0, 1.0, 1.5, 1).is_err());
    }
}
