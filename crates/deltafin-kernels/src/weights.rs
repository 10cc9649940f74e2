//! The weight matrices a product multiplies: the public [`Weights`] of any format, and their
//! raw slices ([`Raw`]) that the row kernels read.

use deltafin_tensor::mxfp4::GROUP;
use deltafin_tensor::{Bf16Matrix, Mxfp4Matrix, RowInt8Matrix};

/// A weight matrix of any supported format, `[rows, cols]`, used as `y = W·x`.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    /// Row-major f32 values (`data.len() == rows * cols`).
    F32 {
        data: &'a [f32],
        rows: usize,
        cols: usize,
    },
    /// Row-major bf16.
    Bf16(&'a Bf16Matrix),
    /// Row-major int8 codes with one f16 scale per row.
    RowInt8(&'a RowInt8Matrix),
    /// MXFP4 (E2M1 codes, one E8M0 scale per 32 columns).
    Mxfp4(&'a Mxfp4Matrix),
}

impl Weights<'_> {
    /// Output rows.
    pub fn rows(&self) -> usize {
        match self {
            Weights::F32 { rows, .. } => *rows,
            Weights::Bf16(m) => m.rows(),
            Weights::RowInt8(m) => m.rows(),
            Weights::Mxfp4(m) => m.rows(),
        }
    }
    /// Input columns.
    pub fn cols(&self) -> usize {
        match self {
            Weights::F32 { cols, .. } => *cols,
            Weights::Bf16(m) => m.cols(),
            Weights::RowInt8(m) => m.cols(),
            Weights::Mxfp4(m) => m.cols(),
        }
    }
    /// Bytes of weight data one full product reads (codes and scales).
    pub fn weight_bytes(&self) -> usize {
        let (r, c) = (self.rows(), self.cols());
        match self {
            Weights::F32 { .. } => r * c * 4,
            Weights::Bf16(_) => r * c * 2,
            Weights::RowInt8(_) => r * c + r * 2,
            Weights::Mxfp4(_) => r * c / 2 + r * c / GROUP,
        }
    }
    /// Format name for logs and benches.
    pub fn dtype(&self) -> &'static str {
        match self {
            Weights::F32 { .. } => "f32",
            Weights::Bf16(_) => "bf16",
            Weights::RowInt8(_) => "row-int8",
            Weights::Mxfp4(_) => "mxfp4",
        }
    }
}

/// A weight matrix's raw slices, fetched once per row range: the per-row accessors of the
/// tensor types go through the byte owner (a dynamic call) and are not inlined across
/// crates, which cost ≈ 9% of whole-model decode on 1024-column matrices.
#[derive(Clone, Copy)]
pub(crate) enum Raw<'a> {
    F32(&'a [f32], usize),
    Bf16(&'a [deltafin_tensor::bf16], usize),
    /// Codes, f16 scales, columns.
    RowInt8(&'a [i8], &'a [half::f16], usize),
    /// Packed codes, E8M0 scales, columns.
    Mxfp4(&'a [u8], &'a [u8], usize),
}

impl<'a> Raw<'a> {
    pub(crate) fn of(w: Weights<'a>) -> Raw<'a> {
        match w {
            Weights::F32 { data, cols, .. } => Raw::F32(data, cols),
            Weights::Bf16(m) => Raw::Bf16(m.data(), m.cols()),
            Weights::RowInt8(m) => Raw::RowInt8(m.data(), m.scales(), m.cols()),
            Weights::Mxfp4(m) => Raw::Mxfp4(m.packed(), m.scales(), m.cols()),
        }
    }
}
