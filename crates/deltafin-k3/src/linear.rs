//! A quantizable spine projection `y = W·x`: the original BF16 matrix or its row-int8 form
//! (product-contract §4.6, `W[r, c] ≈ f16(scale_r) · q[r, c]`).
//!
//! Every spine matrix that `--spine int8` may quantize is a [`Linear`]; the matrices that are
//! never quantized (the embedding, the router) stay [`Bf16Matrix`] in the model's types, so a
//! quantized router cannot be built by mistake.

use deltafin_kernels::{GroupProduct, Weights, matmul, matmul_group};
use deltafin_tensor::{Bf16Matrix, RowInt8Matrix};

/// One spine projection in either resident format.
#[derive(Clone, Debug)]
pub enum Linear {
    /// The checkpoint's BF16 bytes (weight-exact).
    Bf16(Bf16Matrix),
    /// Row-int8 codes with one f16 scale per output row (quantized, not weight-exact).
    RowInt8(RowInt8Matrix),
}

impl Linear {
    /// Output rows.
    pub fn rows(&self) -> usize {
        self.weights().rows()
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.weights().cols()
    }

    /// The kernels' view of the matrix.
    pub fn weights(&self) -> Weights<'_> {
        match self {
            Linear::Bf16(m) => Weights::Bf16(m),
            Linear::RowInt8(m) => Weights::RowInt8(m),
        }
    }

    /// `ys[b] = W·xs[b]` for `n` row-major input rows (row-invariant, see `deltafin-kernels`).
    pub fn matmul(&self, xs: &[f32], n: usize, ys: &mut [f32]) {
        matmul(self.weights(), xs, n, ys);
    }

    /// `W·xs[b]` for `n` input rows into a new buffer of `n · rows` values.
    pub fn apply(&self, xs: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * self.rows()];
        self.matmul(xs, n, &mut out);
        out
    }

    /// `"bf16"` or `"row-int8"`.
    pub fn dtype(&self) -> &'static str {
        self.weights().dtype()
    }

    /// The BF16 matrix, if this projection is not quantized.
    pub fn as_bf16(&self) -> Option<&Bf16Matrix> {
        match self {
            Linear::Bf16(m) => Some(m),
            Linear::RowInt8(_) => None,
        }
    }

    /// Row `r` of the effective weights in f32 (`out.len() == cols`): the bf16 values, or
    /// `scale_r · q[r, ·]`.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            Linear::Bf16(m) => {
                for (o, v) in out.iter_mut().zip(m.row(r)) {
                    *o = v.to_f32();
                }
            }
            Linear::RowInt8(m) => m.dequantize_row(r, out),
        }
    }
}

/// Several products in one parallel region (one fork/join instead of one per matrix):
/// `ws[i]·xs[i]` over `n` rows each, returned in order. Every result is bit-identical to its
/// own [`Linear::apply`] (`deltafin_kernels::matmul_group`).
pub fn apply_group(jobs: &[(Weights<'_>, &[f32])], n: usize) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = jobs.iter().map(|(w, _)| vec![0f32; n * w.rows()]).collect();
    let mut group: Vec<GroupProduct<'_>> = jobs
        .iter()
        .zip(outs.iter_mut())
        .map(|(&(w, xs), ys)| GroupProduct { w, xs, n, ys })
        .collect();
    matmul_group(&mut group);
    drop(group);
    outs
}

impl From<Bf16Matrix> for Linear {
    fn from(m: Bf16Matrix) -> Linear {
        Linear::Bf16(m)
    }
}

impl From<RowInt8Matrix> for Linear {
    fn from(m: RowInt8Matrix) -> Linear {
        Linear::RowInt8(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::Rng;
    use deltafin_kernels::{matmul_bf16, matmul_rowint8};

    #[test]
    fn both_formats_use_their_kernels_bit_for_bit() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let w = rng.bf16_matrix(19, 40);
        let x: Vec<f32> = (0..3 * 40)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let lin = Linear::from(w.clone());
        let mut want = vec![0f32; 3 * 19];
        matmul_bf16(&w, &x, 3, &mut want);
        assert_eq!(lin.apply(&x, 3), want);
        assert_eq!((lin.rows(), lin.cols(), lin.dtype()), (19, 40, "bf16"));
        let q = RowInt8Matrix::from_bf16("w", &w).unwrap();
        let lin8 = Linear::from(q.clone());
        matmul_rowint8(&q, &x, 3, &mut want);
        assert_eq!(lin8.apply(&x, 3), want);
        assert_eq!(lin8.dtype(), "row-int8");
        assert!(lin8.as_bf16().is_none());
        let mut row = vec![0f32; 40];
        lin8.row_f32(2, &mut row);
        let mut deq = vec![0f32; 40];
        q.dequantize_row(2, &mut deq);
        assert_eq!(row, deq);
    }
}
