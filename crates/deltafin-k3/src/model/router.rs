//! The MoE router `KimiMoEGate` (docs/K3.md §4.5).
//!
//! ```text
//! s   = σ(W_r y)                                   (f32)
//! I   = top-k of (s + b)                           b: e_score_correction_bias, selection only
//! w_e = s_e / (Σ_{e' ∈ I} s_e' + ε) · routed_scaling_factor
//! ```
//!
//! Deterministic order (it fixes the MoE summation order): descending `s + b`, ties to the
//! lower expert id. The sum in the renormalisation runs in that order too.

use deltafin_kernels::{matmul_bf16, sigmoid};
use deltafin_store::dims::ModelDims;
use deltafin_tensor::Bf16Matrix;

/// Router weights of one MoE layer.
#[derive(Clone, Debug)]
pub struct RouterWeights {
    /// `gate.weight` `[num_experts, D]`.
    pub weight: Bf16Matrix,
    /// `gate.e_score_correction_bias` `[num_experts]`.
    pub bias: Vec<f32>,
}

/// The experts chosen for one token, in the deterministic route order.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// Expert ids.
    pub ids: Vec<usize>,
    /// Their weights `w_e`.
    pub weights: Vec<f32>,
}

impl RouterWeights {
    /// Route `t` rows of `y`.
    pub fn route(&self, dims: &ModelDims, y: &[f32], t: usize) -> Vec<Route> {
        let ne = self.weight.rows();
        let mut logits = vec![0f32; t * ne];
        matmul_bf16(&self.weight, y, t, &mut logits);
        self.routes_from_logits(dims, &logits)
    }

    /// [`RouterWeights::route`] from precomputed logits `W_r y` (rows of `num_experts`).
    pub fn routes_from_logits(&self, dims: &ModelDims, logits: &[f32]) -> Vec<Route> {
        logits
            .chunks_exact(self.weight.rows().max(1))
            .map(|l| self.select(dims, l))
            .collect()
    }

    /// Top-k selection and weights from one row of router logits.
    pub fn select(&self, dims: &ModelDims, logits: &[f32]) -> Route {
        let s: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
        let key: Vec<f32> = s.iter().zip(&self.bias).map(|(a, b)| a + b).collect();
        let mut order: Vec<usize> = (0..s.len()).collect();
        // Descending key, ties to the lower id (total order; a NaN sorts first).
        order.sort_by(|&a, &b| key[b].total_cmp(&key[a]).then(a.cmp(&b)));
        order.truncate(dims.experts_per_token);
        let mut sum = 0f32;
        for &e in &order {
            sum += s[e];
        }
        let denom = sum + dims.router_renorm_eps;
        let weights = order
            .iter()
            .map(|&e| s[e] / denom * dims.routed_scaling_factor)
            .collect();
        Route {
            ids: order,
            weights,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_util::{Rng, mv64, sig64, to64};

    /// f64 reference: `(ids, weights)` with the same deterministic order.
    pub(crate) fn route64(
        r: &RouterWeights,
        dims: &ModelDims,
        y: &[f64],
    ) -> (Vec<usize>, Vec<f64>) {
        let s: Vec<f64> = mv64(&r.weight, y).into_iter().map(sig64).collect();
        let mut ids: Vec<usize> = (0..s.len()).collect();
        ids.sort_by(|&a, &b| {
            let (ka, kb) = (s[a] + r.bias[a] as f64, s[b] + r.bias[b] as f64);
            kb.partial_cmp(&ka).unwrap().then(a.cmp(&b))
        });
        ids.truncate(dims.experts_per_token);
        let z: f64 = ids.iter().map(|&e| s[e]).sum::<f64>() + dims.router_renorm_eps as f64;
        let w = ids
            .iter()
            .map(|&e| s[e] / z * dims.routed_scaling_factor as f64)
            .collect();
        (ids, w)
    }

    #[test]
    fn matches_f64_and_breaks_ties_to_lower_id() {
        let mut rng = Rng(17);
        let dims = ModelDims {
            num_experts: 24,
            experts_per_token: 5,
            routed_scaling_factor: 2.5,
            ..crate::model::forward::tests::tiny_dims()
        };
        let r = RouterWeights {
            weight: rng.bf16_matrix(24, dims.hidden_size),
            bias: rng.vec(24, 0.3),
        };
        let y = rng.vec(3 * dims.hidden_size, 1.0);
        let routes = r.route(&dims, &y, 3);
        for (ti, route) in routes.iter().enumerate() {
            let (ids, w) = route64(
                &r,
                &dims,
                &to64(&y[ti * dims.hidden_size..(ti + 1) * dims.hidden_size]),
            );
            assert_eq!(route.ids, ids);
            for (a, b) in route.weights.iter().zip(&w) {
                assert!((*a as f64 - b).abs() < 1e-6 * b.abs().max(1.0));
            }
        }
        // Ties: all-equal logits and zero bias pick ids 0..k in order, weights scaling/k.
        let flat = RouterWeights {
            weight: r.weight.clone(),
            bias: vec![0.0; 24],
        };
        let route = flat.select(&dims, &[0.25; 24]);
        assert_eq!(route.ids, vec![0, 1, 2, 3, 4]);
        for w in route.weights {
            assert!((w - 2.5 / 5.0).abs() < 1e-6);
        }
        // The bias selects but does not weight.
        let mut bias = vec![0.0; 24];
        bias[23] = 10.0;
        let biased = RouterWeights {
            weight: r.weight.clone(),
            bias,
        };
        let route = biased.select(&dims, &[0.0; 24]);
        assert_eq!(route.ids, vec![23, 0, 1, 2, 3]);
    }
}
