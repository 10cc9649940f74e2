//! SiTU-GLU MLP (docs/K3.md §4.8): the dense layer-0 MLP (§4.7) and the fused shared experts
//! of every MoE layer (§4.6) share this form: `down · SiTU(gate·y, up·y)`.

use crate::error::ModelError;
use crate::model::linear::{Linear, apply_group};
use deltafin_kernels::situ_glu;
use deltafin_store::dims::ModelDims;

/// A SiTU-GLU MLP (bf16 or row-int8 weights, [`Linear`]): `gate_proj`, `up_proj` `[F, D]`, `down_proj` `[D, F]`.
#[derive(Clone, Debug)]
pub struct SituMlp {
    /// `gate_proj.weight` `[F, D]`.
    pub gate_proj: Linear,
    /// `up_proj.weight` `[F, D]`.
    pub up_proj: Linear,
    /// `down_proj.weight` `[D, F]`.
    pub down_proj: Linear,
}

/// Layer 0's dense MLP (`mlp.{gate,up,down}_proj`).
pub type DenseMlp = SituMlp;

impl SituMlp {
    /// Intermediate width F.
    pub fn intermediate(&self) -> usize {
        self.gate_proj.rows()
    }

    /// `out[t] = W_down · SiTU(W_gate y_t, W_up y_t)` for `n` rows of `ys`.
    pub fn forward(&self, dims: &ModelDims, ys: &[f32], n: usize) -> Result<Vec<f32>, ModelError> {
        let a = self.activation(dims, ys, n)?;
        self.down_proj.apply(&a, n)
    }

    /// `SiTU(W_gate y_t, W_up y_t)` for `n` rows of `ys`, the two products in one parallel
    /// region: the input of `down_proj`.
    pub fn activation(
        &self,
        dims: &ModelDims,
        ys: &[f32],
        n: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let gu = apply_group(
            &[(self.gate_proj.product(), ys), (self.up_proj.product(), ys)],
            n,
        )?;
        let Ok([g, u]) = <[Vec<f32>; 2]>::try_from(gu) else {
            unreachable!("apply_group returns one result per product")
        };
        Ok(self.situ(dims, &g, &u))
    }

    /// `SiTU(g, u)` elementwise (`g`, `u`: the gate and up products).
    pub fn situ(&self, dims: &ModelDims, g: &[f32], u: &[f32]) -> Vec<f32> {
        let mut a = vec![0f32; g.len()];
        situ_glu(g, u, dims.situ_beta, dims.situ_linear_beta, &mut a);
        a
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_util::{Rng, mv64, rel_l2, situ64, to64};

    /// f64 reference of the SiTU-GLU MLP for one row.
    pub(crate) fn situ_mlp64(m: &SituMlp, y: &[f64], b1: f64, b2: f64) -> Vec<f64> {
        let g = mv64(&m.gate_proj, y);
        let u = mv64(&m.up_proj, y);
        mv64(&m.down_proj, &situ64(&g, &u, b1, b2))
    }

    #[test]
    fn matches_f64_reference() {
        let mut rng = Rng(11);
        let (d, f, n) = (40, 72, 3);
        let m = SituMlp {
            gate_proj: rng.bf16_matrix_scaled(f, d, 3.0).into(),
            up_proj: rng.bf16_matrix_scaled(f, d, 20.0).into(),
            down_proj: rng.bf16_matrix(d, f).into(),
        };
        let dims = ModelDims {
            situ_beta: 4.0,
            situ_linear_beta: 25.0,
            ..crate::model::forward::tests::tiny_dims()
        };
        let ys = rng.vec(n * d, 1.5);
        let out = m.forward(&dims, &ys, n).unwrap();
        for t in 0..n {
            let want = situ_mlp64(&m, &to64(&ys[t * d..(t + 1) * d]), 4.0, 25.0);
            let e = rel_l2(&out[t * d..(t + 1) * d], &want);
            assert!(e < 1e-5, "row {t}: rel L2 {e}");
        }
    }
}
