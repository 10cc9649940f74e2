//! A quantizable spine projection `y = W·x`: the original BF16 matrix or its row-int8 form
//! (docs/K3.md §12.6, `W[r, c] ≈ f16(scale_r) · q[r, c]`), optionally offloaded to a
//! [`ProductDevice`] (issue 11).
//!
//! Every spine matrix that `--spine int8` may quantize is a [`Linear`]; the matrices that are
//! never quantized (the embedding, the router) stay [`Bf16Matrix`] in the model's types, so a
//! quantized router cannot be built by mistake.
//!
//! An offloaded projection ([`Linear::Device`]) keeps its host form (for the element-wise
//! readers: the MLA attention's `kv_b_proj` rows, `row_f32`) and multiplies on the device;
//! every other projection multiplies with the CPU kernels. The only cost on the CPU path is
//! the branch on the variant.

use std::sync::Arc;

use deltafin_kernels::{DeviceWeights, GroupProduct, ProductDevice, Weights, matmul, matmul_group};
use deltafin_tensor::{Bf16Matrix, RowInt8Matrix};

use crate::error::ModelError;

/// One spine projection in either resident format, on the CPU or on a device.
#[derive(Clone, Debug)]
pub enum Linear {
    /// The checkpoint's BF16 bytes (weight-exact).
    Bf16(Bf16Matrix),
    /// Row-int8 codes with one f16 scale per output row (quantized, not weight-exact).
    RowInt8(RowInt8Matrix),
    /// Uploaded to a device: products run there (see [`Offloaded`]).
    Device(Arc<Offloaded>),
}

/// A projection resident on a [`ProductDevice`], with the host form it was uploaded from.
pub struct Offloaded {
    /// The tensor name (`model.layers.3.self_attn.q_proj.weight`), used in errors.
    pub name: String,
    /// The host form (never itself [`Linear::Device`]).
    pub host: Linear,
    /// The device's copy.
    pub weights: DeviceWeights,
    /// The device holding it.
    pub device: Arc<dyn ProductDevice>,
}

impl std::fmt::Debug for Offloaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offloaded")
            .field("name", &self.name)
            .field("weights", &self.weights)
            .field("device", &self.device.describe())
            .finish()
    }
}

impl Offloaded {
    /// Upload `host` (its CPU form) to `device` under `name`.
    pub fn upload(
        name: &str,
        host: &Linear,
        device: Arc<dyn ProductDevice>,
    ) -> Result<Offloaded, ModelError> {
        let host = host.host().clone();
        let weights = device
            .upload(name, host.weights())
            .map_err(|e| ModelError::Device {
                matrix: name.to_string(),
                message: e.to_string(),
            })?;
        Ok(Offloaded {
            name: name.to_string(),
            host,
            weights,
            device,
        })
    }

    /// `ys[b] = W·xs[b]` on the device; a device error names the matrix.
    pub fn matmul(&self, xs: &[f32], n: usize, ys: &mut [f32]) -> Result<(), ModelError> {
        self.device
            .matmul(&self.weights, xs, n, ys)
            .map_err(|e| ModelError::Device {
                matrix: self.name.clone(),
                message: e.to_string(),
            })
    }
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

    /// The host form: `self`, or the matrix an offloaded projection was uploaded from.
    pub fn host(&self) -> &Linear {
        match self {
            Linear::Device(d) => d.host.host(),
            other => other,
        }
    }

    /// The device copy, if this projection is offloaded.
    pub fn offloaded(&self) -> Option<&Offloaded> {
        match self {
            Linear::Device(d) => Some(d),
            _ => None,
        }
    }

    /// The kernels' view of the host matrix.
    pub fn weights(&self) -> Weights<'_> {
        match self {
            Linear::Bf16(m) => Weights::Bf16(m),
            Linear::RowInt8(m) => Weights::RowInt8(m),
            Linear::Device(d) => d.host.weights(),
        }
    }

    /// This projection as one product of an [`apply_group`].
    pub fn product(&self) -> Product<'_> {
        Product {
            w: self.weights(),
            device: self.offloaded(),
        }
    }

    /// `ys[b] = W·xs[b]` for `n` row-major input rows (row-invariant, see `deltafin-kernels`),
    /// on the device when offloaded.
    pub fn matmul(&self, xs: &[f32], n: usize, ys: &mut [f32]) -> Result<(), ModelError> {
        match self {
            Linear::Device(d) => d.matmul(xs, n, ys),
            _ => {
                matmul(self.weights(), xs, n, ys);
                Ok(())
            }
        }
    }

    /// `W·xs[b]` for `n` input rows into a new buffer of `n · rows` values.
    pub fn apply(&self, xs: &[f32], n: usize) -> Result<Vec<f32>, ModelError> {
        let mut out = vec![0f32; n * self.rows()];
        self.matmul(xs, n, &mut out)?;
        Ok(out)
    }

    /// [`Linear::apply`] on the CPU with the host form, even when offloaded (for callers
    /// outside the K3 forward pass, such as the DSpark drafter's use of `lm_head`).
    pub fn apply_host(&self, xs: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * self.rows()];
        matmul(self.weights(), xs, n, &mut out);
        out
    }

    /// `"bf16"` or `"row-int8"` (of the host form).
    pub fn dtype(&self) -> &'static str {
        self.weights().dtype()
    }

    /// The BF16 matrix, if this projection is not quantized.
    pub fn as_bf16(&self) -> Option<&Bf16Matrix> {
        match self.host() {
            Linear::Bf16(m) => Some(m),
            _ => None,
        }
    }

    /// Row `r` of the effective weights in f32 (`out.len() == cols`): the bf16 values, or
    /// `scale_r · q[r, ·]`.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self.host() {
            Linear::RowInt8(m) => m.dequantize_row(r, out),
            Linear::Bf16(m) => {
                for (o, v) in out.iter_mut().zip(m.row(r)) {
                    *o = v.to_f32();
                }
            }
            Linear::Device(_) => unreachable!("host() never returns Linear::Device"),
        }
    }
}

/// One product of an [`apply_group`]: host weights, and the device copy when offloaded.
#[derive(Clone, Copy)]
pub struct Product<'a> {
    /// The host weights (multiplied on the CPU when `device` is `None`).
    pub w: Weights<'a>,
    /// The device copy.
    pub device: Option<&'a Offloaded>,
}

impl<'a> From<Weights<'a>> for Product<'a> {
    fn from(w: Weights<'a>) -> Product<'a> {
        Product { w, device: None }
    }
}

/// Several products in one parallel region (one fork/join instead of one per matrix):
/// `ws[i]·xs[i]` over `n` rows each, returned in order. Every result is bit-identical to its
/// own [`Linear::apply`] (`deltafin_kernels::matmul_group`). Offloaded products run on their
/// device while the CPU ones run as one group beside them.
pub fn apply_group(jobs: &[(Product<'_>, &[f32])], n: usize) -> Result<Vec<Vec<f32>>, ModelError> {
    let mut outs: Vec<Vec<f32>> = jobs
        .iter()
        .map(|(p, _)| vec![0f32; n * p.w.rows()])
        .collect();
    if jobs.iter().all(|(p, _)| p.device.is_none()) {
        let mut group: Vec<GroupProduct<'_>> = jobs
            .iter()
            .zip(outs.iter_mut())
            .map(|(&(p, xs), ys)| GroupProduct { w: p.w, xs, n, ys })
            .collect();
        matmul_group(&mut group);
        drop(group);
        return Ok(outs);
    }
    let mut group: Vec<GroupProduct<'_>> = Vec::new();
    let mut on_device: Vec<(&Offloaded, &[f32], &mut Vec<f32>)> = Vec::new();
    for (&(p, xs), ys) in jobs.iter().zip(outs.iter_mut()) {
        match p.device {
            Some(d) => on_device.push((d, xs, ys)),
            None => group.push(GroupProduct { w: p.w, xs, n, ys }),
        }
    }
    let (dev, ()) = rayon::join(
        || {
            on_device
                .into_iter()
                .try_for_each(|(d, xs, ys)| d.matmul(xs, n, ys))
        },
        || {
            if !group.is_empty() {
                matmul_group(&mut group);
            }
        },
    );
    dev?;
    drop(group);
    Ok(outs)
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
        assert_eq!(lin.apply(&x, 3).unwrap(), want);
        assert_eq!((lin.rows(), lin.cols(), lin.dtype()), (19, 40, "bf16"));
        let q = RowInt8Matrix::from_bf16("w", &w).unwrap();
        let lin8 = Linear::from(q.clone());
        matmul_rowint8(&q, &x, 3, &mut want);
        assert_eq!(lin8.apply(&x, 3).unwrap(), want);
        assert_eq!(lin8.dtype(), "row-int8");
        assert!(lin8.as_bf16().is_none());
        let mut row = vec![0f32; 40];
        lin8.row_f32(2, &mut row);
        let mut deq = vec![0f32; 40];
        q.dequantize_row(2, &mut deq);
        assert_eq!(row, deq);
    }
}
