//! The dense pieces both drafters are built from (DSpark, docs/K3.md §9.3, and Qwen3, §10):
//! batched bf16 products, row-wise RMSNorm, the residual add and the SwiGLU MLP
//! `down_proj · (silu(gate_proj · y) ⊙ up_proj · y)`.

use crate::tensors::{TensorIssue, Tensors};
use deltafin_kernels::{matmul_bf16, rms_norm, silu};
use deltafin_tensor::{Bf16Matrix, TensorError};

/// `w · x` for `n` rows of `x`: `n` rows of `w.rows()` values.
pub(crate) fn matmul(w: &Bf16Matrix, x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * w.rows()];
    matmul_bf16(w, x, n, &mut out);
    out
}

/// RMSNorm of every row of `x` (rows of `w.len()` values) with weight `w`.
pub(crate) fn rms_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (a, o) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        rms_norm(a, w, eps, o);
    }
    out
}

/// The residual add `x += o`.
pub(crate) fn add_into(x: &mut [f32], o: &[f32]) {
    x.iter_mut().zip(o).for_each(|(a, b)| *a += b);
}

/// A SwiGLU MLP: `mlp.gate_proj.weight` and `mlp.up_proj.weight` `[F, D]`,
/// `mlp.down_proj.weight` `[D, F]`.
#[derive(Clone, Debug)]
pub struct SwiGlu {
    /// `gate_proj.weight` `[F, D]`.
    pub gate_proj: Bf16Matrix,
    /// `up_proj.weight` `[F, D]`.
    pub up_proj: Bf16Matrix,
    /// `down_proj.weight` `[D, F]`.
    pub down_proj: Bf16Matrix,
}

impl SwiGlu {
    /// Read `{prefix}.gate_proj.weight`, `.up_proj.weight` and `.down_proj.weight` for width
    /// `d` and intermediate size `f`.
    pub(crate) fn read<E: From<TensorIssue> + From<TensorError>>(
        rd: &mut Tensors<'_, E>,
        prefix: &str,
        d: usize,
        f: usize,
    ) -> Result<SwiGlu, E> {
        Ok(SwiGlu {
            gate_proj: rd.matrix(&format!("{prefix}.gate_proj.weight"), f, d)?,
            up_proj: rd.matrix(&format!("{prefix}.up_proj.weight"), f, d)?,
            down_proj: rd.matrix(&format!("{prefix}.down_proj.weight"), d, f)?,
        })
    }

    /// The MLP of `n` rows of `y`.
    pub fn forward(&self, y: &[f32], n: usize) -> Vec<f32> {
        let g = matmul(&self.gate_proj, y, n);
        let u = matmul(&self.up_proj, y, n);
        let act: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
        matmul(&self.down_proj, &act, n)
    }
}

/// f64 references of the pieces above, for the drafters' model tests.
#[cfg(test)]
pub(crate) mod reference {
    use super::SwiGlu;
    use deltafin_tensor::Bf16Matrix;

    /// Row `r` of `w`, widened to f64.
    pub(crate) fn row(w: &Bf16Matrix, r: usize) -> Vec<f64> {
        w.row(r).iter().map(|v| v.to_f64()).collect()
    }

    /// `w · x`.
    pub(crate) fn mv(w: &Bf16Matrix, x: &[f64]) -> Vec<f64> {
        (0..w.rows())
            .map(|r| w.row(r).iter().zip(x).map(|(a, b)| a.to_f64() * b).sum())
            .collect()
    }

    /// RMSNorm of one row.
    pub(crate) fn rms(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, &w)| v * inv * w as f64).collect()
    }

    /// The SwiGLU MLP of one row.
    pub(crate) fn swiglu(m: &SwiGlu, y: &[f64]) -> Vec<f64> {
        let g = mv(&m.gate_proj, y);
        let u = mv(&m.up_proj, y);
        let a: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        mv(&m.down_proj, &a)
    }
}
