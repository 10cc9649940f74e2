//! Latent MoE (docs/K3.md §4.6) and the expert-weight source.
//!
//! ```text
//! x_L = W_down y                                           D → Lr
//! h_e = W2_e · SiTU(W1_e x_L, W3_e x_L)   e ∈ I            MXFP4 experts, Lr → F → Lr
//! r   = Σ_{e ∈ I} w_e h_e                                  f32, in route order
//! R   = W_up · RMS_ε(r; routed_expert_norm)                Lr → D
//! Sh  = W_sd · SiTU(W_sg y, W_su y)                        fused shared experts
//! FFN(y) = R + Sh
//! ```
//!
//! When and where the experts' products run (reads, back-pressure, device, read hints)
//! is the [`ExpertSchedule`]'s business (`crate::moe_schedule`); this module is the math.

use crate::model::ModelError;
use crate::model::finite;
use crate::model::linear::{Linear, apply_group};
pub use crate::model::moe_schedule::{ExpertSchedule, validate_expert};
use crate::model::router::RouterWeights;
use crate::model::situ::SituMlp;
use deltafin_kernels::{
    GroupProduct, Weights, matmul, matmul_group, matmul_group_serial, matmul_serial,
    rms_norm_inplace, situ_glu,
};
use deltafin_store::dims::ModelDims;
use deltafin_tensor::Mxfp4Matrix;

pub use deltafin_experts::{ExpertError, ExpertSource, ExpertWeights};

/// All experts held in memory: `layers[l][e]` (dense layers hold an empty list).
#[derive(Clone, Debug, Default)]
pub struct InMemoryExperts {
    /// Per layer, per expert id.
    pub layers: Vec<Vec<ExpertWeights>>,
}

impl ExpertSource for InMemoryExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        self.layers
            .get(layer)
            .and_then(|l| l.get(expert))
            .cloned()
            .ok_or_else(|| ExpertError::Unavailable {
                layer,
                expert,
                message: "not present in the in-memory expert set".into(),
            })
    }
}

/// The non-expert weights of one MoE layer (`model.layers.N.block_sparse_moe.*`).
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `gate.weight` and `gate.e_score_correction_bias`.
    pub router: RouterWeights,
    /// `routed_expert_down_proj.weight` `[Lr, D]`.
    pub latent_down: Linear,
    /// `routed_expert_up_proj.weight` `[D, Lr]`.
    pub latent_up: Linear,
    /// `routed_expert_norm.weight` `[Lr]`.
    pub latent_norm: Vec<f32>,
    /// `shared_experts.{gate,up,down}_proj` (two experts fused, width Fs).
    pub shared: SituMlp,
}

impl MoeWeights {
    /// `t` rows of `y` (already normalised by `post_attention_layernorm`) through the MoE of
    /// layer `layer`. Tokens routed to the same expert are batched; each token's weighted sum
    /// runs in its route order, so a row's result does not depend on the batch.
    pub fn forward(
        &self,
        dims: &ModelDims,
        layer: usize,
        experts: &dyn ExpertSource,
        y: &[f32],
        t: usize,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_scheduled(dims, layer, y, t, &ExpertSchedule::new(experts))
    }

    /// [`MoeWeights::forward`] with the routed experts obtained and run as `schedule` says:
    /// from its source, on its device, with PILOT's guess for its next MoE layer. The
    /// result is bit-identical whatever the schedule.
    pub fn forward_scheduled(
        &self,
        dims: &ModelDims,
        layer: usize,
        y: &[f32],
        t: usize,
        schedule: &ExpertSchedule<'_>,
    ) -> Result<Vec<f32>, ModelError> {
        let lr = dims.latent_size;
        // Router logits and x_L = W_down y (and PILOT's router for the next MoE layer) in
        // one parallel region; the shared experts run later, beside the routed ones, so
        // expert reads start as early as possible.
        let pilot = schedule.pilot();
        let mut jobs = vec![
            (Weights::Bf16(&self.router.weight).into(), y),
            (self.latent_down.product(), y),
        ];
        if let Some((_, router)) = pilot {
            jobs.push((Weights::Bf16(&router.weight).into(), y));
        }
        let mut outs = apply_group(&jobs, t)?.into_iter();
        let (Some(logits), Some(xl)) = (outs.next(), outs.next()) else {
            unreachable!("apply_group returns one result per product")
        };
        let next_logits = outs.next();
        let routes = self.router.routes_from_logits(dims, &logits);
        let users = schedule.announce(dims, layer, &routes, next_logits.as_deref());
        // h_e for every routed expert, and SiTU(W_sg y, W_su y) of the shared experts.
        let (h, shared) = schedule.run(
            dims,
            layer,
            &users,
            &xl,
            || self.shared.activation(dims, y, t),
            |w, x, n, serial| expert_rows(dims, w, x, n, serial),
        )?;
        // r = Σ w_e h_e in route order, then the latent norm.
        let mut r = vec![0f32; t * lr];
        for (ti, route) in routes.iter().enumerate() {
            let rt = &mut r[ti * lr..(ti + 1) * lr];
            for (slot, &we) in route.weights.iter().enumerate() {
                for (a, &b) in rt.iter_mut().zip(h.row(ti, slot)) {
                    *a += we * b;
                }
            }
            rms_norm_inplace(rt, &self.latent_norm, dims.routed_expert_norm_eps);
        }
        // R = W_up r and the shared experts' down projection, together; FFN(y) = R + Sh.
        let outs = apply_group(
            &[
                (self.latent_up.product(), &r),
                (self.shared.down_proj.product(), &shared),
            ],
            t,
        )?;
        let Ok([mut out, sh]) = <[Vec<f32>; 2]>::try_from(outs) else {
            unreachable!("apply_group returns one result per product")
        };
        if !finite::add_checked(&mut out, &sh) {
            let site = fault_site(layer, y, &xl, &routes, &h, &shared);
            return Err(ModelError::NonFinite { site });
        }
        Ok(out)
    }
}

/// Where a non-finite MoE output of layer `layer` first appeared, in the order the values
/// were computed: its input, the latent down-projection, the router weights, the first
/// routed expert (token, then route order) whose output is not finite, the shared experts;
/// else the latent norm and up-projection. Only called on failure.
fn fault_site(
    layer: usize,
    y: &[f32],
    xl: &[f32],
    routes: &[crate::model::router::Route],
    h: &crate::model::moe_schedule::ExpertRows,
    shared: &[f32],
) -> String {
    let w = format!("model.layers.{layer}.block_sparse_moe");
    if !finite::all_finite(y) {
        return format!(
            "layer {layer}'s MoE input (model.layers.{layer}.post_attention_layernorm.weight or mlp_res)"
        );
    }
    if !finite::all_finite(xl) {
        return format!("layer {layer}'s latent down-projection ({w}.routed_expert_down_proj)");
    }
    for (ti, route) in routes.iter().enumerate() {
        if !finite::all_finite(&route.weights) {
            return format!("layer {layer}'s router weights ({w}.gate)");
        }
        for (slot, &e) in route.ids.iter().enumerate() {
            if !finite::all_finite(h.row(ti, slot)) {
                return format!(
                    "the output of routed expert {e} of layer {layer} (its MXFP4 weights or E8M0 scales)"
                );
            }
        }
    }
    if !finite::all_finite(shared) {
        return format!("layer {layer}'s shared experts ({w}.shared_experts)");
    }
    format!(
        "layer {layer}'s routed-expert norm or up-projection ({w}.routed_expert_norm, routed_expert_up_proj)"
    )
}

/// One expert over `n` gathered latent rows `x`: `W2 · SiTU(W1 x, W3 x)` per row,
/// `[n, Lr]`. With `serial` the three products stay on the calling thread (bit-identical
/// either way).
fn expert_rows(dims: &ModelDims, w: &ExpertWeights, x: &[f32], n: usize, serial: bool) -> Vec<f32> {
    let mm = |m: &Mxfp4Matrix, xs: &[f32], n: usize, ys: &mut [f32]| {
        if serial {
            matmul_serial(Weights::Mxfp4(m), xs, n, ys)
        } else {
            matmul(Weights::Mxfp4(m), xs, n, ys)
        }
    };
    let lr = dims.latent_size;
    let f = w.w1.rows();
    let mut g = vec![0f32; n * f];
    let mut u = vec![0f32; n * f];
    // w1 and w3 read the same rows: one group, one activation image.
    let mut gate_up = [
        GroupProduct {
            w: Weights::Mxfp4(&w.w1),
            xs: x,
            n,
            ys: &mut g,
        },
        GroupProduct {
            w: Weights::Mxfp4(&w.w3),
            xs: x,
            n,
            ys: &mut u,
        },
    ];
    if serial {
        matmul_group_serial(&mut gate_up);
    } else {
        matmul_group(&mut gate_up);
    }
    let mut a = vec![0f32; n * f];
    situ_glu(&g, &u, dims.situ_beta, dims.situ_linear_beta, &mut a);
    let mut he = vec![0f32; n * lr];
    mm(&w.w2, &a, n, &mut he);
    he
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::router::tests::route64;
    use crate::model::situ::tests::situ_mlp64;
    use crate::test_util::{Rng, mv64, mv64_mx, rel_l2, rel_l2_32, rms64, situ64, to64};

    pub(crate) fn random_moe(rng: &mut Rng, dims: &ModelDims) -> MoeWeights {
        let (dm, lr, fs) = (dims.hidden_size, dims.latent_size, dims.shared_intermediate);
        MoeWeights {
            router: RouterWeights {
                weight: rng.bf16_matrix_scaled(dims.num_experts, dm, 2.0),
                bias: rng.vec(dims.num_experts, 0.2),
            },
            latent_down: rng.bf16_matrix(lr, dm).into(),
            latent_up: rng.bf16_matrix(dm, lr).into(),
            latent_norm: rng.around_one(lr, 0.2),
            shared: SituMlp {
                gate_proj: rng.bf16_matrix_scaled(fs, dm, 2.0).into(),
                up_proj: rng.bf16_matrix_scaled(fs, dm, 2.0).into(),
                down_proj: rng.bf16_matrix(dm, fs).into(),
            },
        }
    }

    pub(crate) fn random_experts(
        rng: &mut Rng,
        dims: &ModelDims,
        layers: usize,
    ) -> InMemoryExperts {
        let (f, lr) = (dims.moe_intermediate, dims.latent_size);
        InMemoryExperts {
            layers: (0..layers)
                .map(|l| {
                    if dims.ffn_kind(l) == deltafin_store::dims::FfnKind::Dense {
                        return Vec::new();
                    }
                    (0..dims.num_experts)
                        .map(|_| ExpertWeights {
                            w1: rng.mxfp4_matrix(f, lr),
                            w2: rng.mxfp4_matrix(lr, f),
                            w3: rng.mxfp4_matrix(f, lr),
                        })
                        .collect()
                })
                .collect(),
        }
    }

    /// f64 reference of the latent MoE for one row.
    pub(crate) fn moe64(
        m: &MoeWeights,
        dims: &ModelDims,
        layer: usize,
        experts: &InMemoryExperts,
        y: &[f64],
    ) -> Vec<f64> {
        let (b1, b2) = (dims.situ_beta as f64, dims.situ_linear_beta as f64);
        let (ids, w) = route64(&m.router, dims, y);
        let xl = mv64(&m.latent_down, y);
        let mut r = vec![0f64; dims.latent_size];
        for (&e, &we) in ids.iter().zip(&w) {
            let ex = &experts.layers[layer][e];
            let a = situ64(&mv64_mx(&ex.w1, &xl), &mv64_mx(&ex.w3, &xl), b1, b2);
            for (ri, hi) in r.iter_mut().zip(mv64_mx(&ex.w2, &a)) {
                *ri += we * hi;
            }
        }
        let rn = rms64(&r, &m.latent_norm, dims.routed_expert_norm_eps as f64);
        let mut out = mv64(&m.latent_up, &rn);
        for (o, s) in out.iter_mut().zip(situ_mlp64(&m.shared, y, b1, b2)) {
            *o += s;
        }
        out
    }

    #[test]
    fn matches_f64_and_is_batch_invariant() {
        let mut rng = Rng(23);
        let dims = crate::model::forward::tests::tiny_dims();
        let m = random_moe(&mut rng, &dims);
        let ex = random_experts(&mut rng, &dims, 2);
        let dm = dims.hidden_size;
        let t = 9;
        let y = rng.vec(t * dm, 1.0);
        let out = m.forward(&dims, 1, &ex, &y, t).unwrap();
        for ti in 0..t {
            let row = &y[ti * dm..(ti + 1) * dm];
            let want = moe64(&m, &dims, 1, &ex, &to64(row));
            let e = rel_l2(&out[ti * dm..(ti + 1) * dm], &want);
            assert!(e < 1e-5, "row {ti}: {e}");
            let single = m.forward(&dims, 1, &ex, row, 1).unwrap();
            assert_eq!(rel_l2_32(&single, &out[ti * dm..(ti + 1) * dm]), 0.0);
        }
    }

    #[test]
    fn missing_or_misshapen_expert_is_an_error() {
        let mut rng = Rng(2);
        let dims = crate::model::forward::tests::tiny_dims();
        let m = random_moe(&mut rng, &dims);
        let y = rng.vec(dims.hidden_size, 1.0);
        let empty = InMemoryExperts::default();
        let e = m.forward(&dims, 1, &empty, &y, 1).unwrap_err().to_string();
        assert!(e.contains("layer 1"), "{e}");
        let mut ex = random_experts(&mut rng, &dims, 2);
        for x in ex.layers[1].iter_mut() {
            x.w2 = x.w1.clone();
        }
        let e = m.forward(&dims, 1, &ex, &y, 1).unwrap_err().to_string();
        assert!(e.contains("experts.") && e.contains(".w2"), "{e}");
    }
}
