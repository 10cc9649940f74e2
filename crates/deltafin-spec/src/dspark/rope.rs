//! YaRN rotary embedding of the 64-wide MLA tail (docs/K3.md §9.3, DeepSeek-V3 convention):
//!
//! ```text
//! inv_extra_i = θ^(−2i/d),   inv_inter_i = inv_extra_i / factor          i = 0 … d/2 − 1
//! low  = floor( d·ln(L / (β_fast·2π)) / (2·ln θ) ),   high = ceil( d·ln(L / (β_slow·2π)) / (2·ln θ) )
//! ramp_i = clamp((i − low) / (high − low), 0, 1)
//! inv_freq_i = inv_inter_i · ramp_i + inv_extra_i · (1 − ramp_i)
//! rotate the pair (2i, 2i+1) by p · inv_freq_i, cos/sin scaled by mscale(f, m)/mscale(f, m_all)
//! attention scale = (nope + rope)^(−1/2) · mscale(f, m_all)²,   mscale(f, m) = 0.1·m·ln f + 1
//! ```

use super::config::YarnConfig;

/// `0.1·m·ln(f) + 1` (1 for `f ≤ 1`).
pub fn yarn_mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * factor.ln() + 1.0
    }
}

/// Precomputed YaRN frequencies for one rotary width.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    /// Rotation speed of pair `i`.
    pub inv_freq: Vec<f64>,
    /// Multiplier of cos and sin.
    pub cos_sin_scale: f64,
    /// Softmax scale of the attention scores.
    pub attn_scale: f32,
    /// The correction range `(low, high)` after clamping to `[0, d − 1]`.
    pub range: (usize, usize),
}

fn correction_dim(rotations: f64, dim: usize, base: f64, max_pos: usize) -> f64 {
    dim as f64 * (max_pos as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
        / (2.0 * base.ln())
}

impl Yarn {
    /// Frequencies for a rotary tail of `dim` values and heads of `qk_head_dim`.
    pub fn new(cfg: &YarnConfig, dim: usize, qk_head_dim: usize) -> Yarn {
        let half = dim / 2;
        let low = correction_dim(
            cfg.beta_fast,
            dim,
            cfg.rope_theta,
            cfg.original_max_position_embeddings,
        )
        .floor()
        .max(0.0) as usize;
        let high = (correction_dim(
            cfg.beta_slow,
            dim,
            cfg.rope_theta,
            cfg.original_max_position_embeddings,
        )
        .ceil() as usize)
            .min(dim.saturating_sub(1));
        let (lo, hi) = (
            low as f64,
            if high == low {
                high as f64 + 0.001
            } else {
                high as f64
            },
        );
        let inv_freq = (0..half)
            .map(|i| {
                let extra = cfg.rope_theta.powf(-(2.0 * i as f64) / dim as f64);
                let inter = extra / cfg.factor;
                let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                inter * ramp + extra * (1.0 - ramp)
            })
            .collect();
        let m_all = yarn_mscale(cfg.factor, cfg.mscale_all_dim);
        Yarn {
            inv_freq,
            cos_sin_scale: yarn_mscale(cfg.factor, cfg.mscale) / m_all,
            attn_scale: ((qk_head_dim as f64).powf(-0.5) * m_all * m_all) as f32,
            range: (low, high),
        }
    }

    /// Rotate `x` (one tail, interleaved pairs) in place for position `pos`.
    pub fn rotate(&self, x: &mut [f32], pos: usize) {
        for (pair, &f) in x.chunks_exact_mut(2).zip(&self.inv_freq) {
            let (s, c) = (pos as f64 * f).sin_cos();
            let (c, s) = (
                (c * self.cos_sin_scale) as f32,
                (s * self.cos_sin_scale) as f32,
            );
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The released DSpark `rope_parameters`.
    pub(crate) fn real() -> YarnConfig {
        YarnConfig {
            rope_theta: 50000.0,
            factor: 32.0,
            original_max_position_embeddings: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        }
    }

    #[test]
    fn real_config_frequencies_follow_the_spec() {
        let y = Yarn::new(&real(), 64, 192);
        assert_eq!(y.range, (15, 26));
        assert_eq!(y.inv_freq.len(), 32);
        for (i, &f) in y.inv_freq.iter().enumerate() {
            let extra = 50000f64.powf(-(2.0 * i as f64) / 64.0);
            let ramp = ((i as f64 - 15.0) / 11.0).clamp(0.0, 1.0);
            let want = extra / 32.0 * ramp + extra * (1.0 - ramp);
            assert!((f - want).abs() <= 1e-15 * want, "i={i}: {f} vs {want}");
        }
        // Below the range: pure extrapolation; above: pure interpolation.
        assert_eq!(y.inv_freq[0], 1.0);
        assert!((y.inv_freq[31] - 50000f64.powf(-62.0 / 64.0) / 32.0).abs() < 1e-18);
        assert_eq!(y.cos_sin_scale, 1.0);
        let m = 0.1 * 32f64.ln() + 1.0;
        assert!((m - 1.346574).abs() < 1e-6);
        let want = 192f64.powf(-0.5) * 1.813260;
        assert!(((y.attn_scale as f64) - want).abs() < 1e-6 * want);
    }

    #[test]
    fn rotation_matches_f64_and_preserves_norm() {
        let y = Yarn::new(&real(), 64, 192);
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0)
            .collect();
        for pos in [0usize, 1, 17, 4096, 100_000] {
            let mut r = x.clone();
            y.rotate(&mut r, pos);
            for i in 0..32 {
                let ang = pos as f64 * y.inv_freq[i];
                let (a, b) = (x[2 * i] as f64, x[2 * i + 1] as f64);
                let want = [a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()];
                for k in 0..2 {
                    assert!(
                        (r[2 * i + k] as f64 - want[k]).abs() < 1e-5,
                        "pos {pos} i {i}"
                    );
                }
            }
            let n0: f32 = x.iter().map(|v| v * v).sum();
            let n1: f32 = r.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-4 * n0);
        }
        // Relative positions: q(p)·k(s) depends only on p − s.
        let k: Vec<f32> = (0..64).map(|i| ((i * 13 % 7) as f32 - 3.0) / 2.0).collect();
        let dot = |p: usize, s: usize| {
            let (mut a, mut b) = (x.clone(), k.clone());
            y.rotate(&mut a, p);
            y.rotate(&mut b, s);
            a.iter().zip(&b).map(|(u, v)| (u * v) as f64).sum::<f64>()
        };
        assert!((dot(10, 3) - dot(107, 100)).abs() < 1e-3);
    }

    #[test]
    fn tiny_tail_range() {
        // The synthesized tiny DSpark rotates an 8-wide tail.
        let y = Yarn::new(&real(), 8, 24);
        assert_eq!(y.range, (1, 4));
        assert_eq!(y.inv_freq.len(), 4);
    }
}
