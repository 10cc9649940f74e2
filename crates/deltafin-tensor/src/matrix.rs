//! Typed matrix views consumed by the kernels. A matrix `[rows, cols]` is an `nn.Linear`
//! weight: `y = W·x`, row-major, one row per output.

use crate::mxfp4;
use crate::{Bytes, TensorError};
use half::bf16;

/// A row-major bf16 matrix over (usually memory-mapped) bytes.
#[derive(Clone, Debug)]
pub struct Bf16Matrix {
    bytes: Bytes,
    rows: usize,
    cols: usize,
}

impl Bf16Matrix {
    /// `bytes` must hold exactly `rows * cols` little-endian bf16 values; it is copied only
    /// if misaligned.
    pub fn new(name: &str, bytes: Bytes, rows: usize, cols: usize) -> Result<Self, TensorError> {
        if bytes.len() != rows * cols * 2 {
            return Err(TensorError::tensor(
                name,
                format!(
                    "expected {} bytes for bf16 [{rows}, {cols}], found {}",
                    rows * cols * 2,
                    bytes.len()
                ),
            ));
        }
        Ok(Bf16Matrix {
            bytes: bytes.aligned(2),
            rows,
            cols,
        })
    }

    /// Build from values (tests, synthesis).
    pub fn from_values(rows: usize, cols: usize, values: &[bf16]) -> Result<Self, TensorError> {
        Self::new("<values>", Bytes::from_bf16(values), rows, cols)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn data(&self) -> &[bf16] {
        // Alignment and length are established in `new`.
        self.bytes.as_bf16().unwrap_or(&[])
    }
    pub fn row(&self, r: usize) -> &[bf16] {
        &self.data()[r * self.cols..(r + 1) * self.cols]
    }
    /// Row `r` widened to f32.
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        self.row(r).iter().map(|v| v.to_f32()).collect()
    }
    /// Rows `start..end` as a matrix sharing the same bytes.
    pub fn row_range(&self, start: usize, end: usize) -> Option<Bf16Matrix> {
        if start > end || end > self.rows {
            return None;
        }
        Some(Bf16Matrix {
            bytes: self
                .bytes
                .slice(start * self.cols * 2..end * self.cols * 2)?,
            rows: end - start,
            cols: self.cols,
        })
    }
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }
    /// The same shape over other bytes: a copy of [`Bf16Matrix::bytes`] moved to other
    /// memory (sizes are checked as [`Bf16Matrix::new`] does; the content is the caller's).
    pub fn with_bytes(&self, name: &str, bytes: Bytes) -> Result<Self, TensorError> {
        Self::new(name, bytes, self.rows, self.cols)
    }
}

/// A row-major MXFP4 matrix: packed E2M1 codes `[rows, cols/2]` and E8M0 scales
/// `[rows, cols/32]`.
#[derive(Clone, Debug)]
pub struct Mxfp4Matrix {
    packed: Bytes,
    scales: Bytes,
    rows: usize,
    cols: usize,
}

impl Mxfp4Matrix {
    /// Validates sizes and that no scale byte is the NaN code 255.
    pub fn new(
        name: &str,
        packed: Bytes,
        scales: Bytes,
        rows: usize,
        cols: usize,
    ) -> Result<Self, TensorError> {
        if !cols.is_multiple_of(mxfp4::GROUP) {
            return Err(TensorError::tensor(
                name,
                format!("MXFP4 input width {cols} is not a multiple of 32"),
            ));
        }
        if packed.len() != rows * cols / 2 {
            return Err(TensorError::tensor(
                name,
                format!(
                    "packed codes: expected {} bytes for [{rows}, {}], found {}",
                    rows * cols / 2,
                    cols / 2,
                    packed.len()
                ),
            ));
        }
        if scales.len() != rows * cols / mxfp4::GROUP {
            return Err(TensorError::tensor(
                name,
                format!(
                    "scales: expected {} bytes for [{rows}, {}], found {}",
                    rows * cols / mxfp4::GROUP,
                    cols / mxfp4::GROUP,
                    scales.len()
                ),
            ));
        }
        if let Some(pos) = scales.as_slice().iter().position(|&e| e == 255) {
            return Err(TensorError::tensor(
                name,
                format!(
                    "E8M0 scale byte 255 (NaN) at row {}, group {}",
                    pos / (cols / mxfp4::GROUP),
                    pos % (cols / mxfp4::GROUP)
                ),
            ));
        }
        Ok(Mxfp4Matrix {
            packed,
            scales,
            rows,
            cols,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The same E2M1 codes (shared, not copied) with other E8M0 scales, validated as
    /// [`Mxfp4Matrix::new`] does.
    pub fn with_scales(&self, name: &str, scales: Bytes) -> Result<Mxfp4Matrix, TensorError> {
        Mxfp4Matrix::new(name, self.packed.clone(), scales, self.rows, self.cols)
    }
    /// The same shape over other bytes: copies of the codes and scales moved to other
    /// memory, validated as [`Mxfp4Matrix::new`] does.
    pub fn with_bytes(
        &self,
        name: &str,
        packed: Bytes,
        scales: Bytes,
    ) -> Result<Mxfp4Matrix, TensorError> {
        Mxfp4Matrix::new(name, packed, scales, self.rows, self.cols)
    }
    /// The codes' and the scales' views.
    pub fn parts(&self) -> [&Bytes; 2] {
        [&self.packed, &self.scales]
    }
    pub fn packed(&self) -> &[u8] {
        self.packed.as_slice()
    }
    pub fn scales(&self) -> &[u8] {
        self.scales.as_slice()
    }
    pub fn packed_row(&self, r: usize) -> &[u8] {
        &self.packed()[r * self.cols / 2..(r + 1) * self.cols / 2]
    }
    pub fn scales_row(&self, r: usize) -> &[u8] {
        let g = self.cols / mxfp4::GROUP;
        &self.scales()[r * g..(r + 1) * g]
    }
    /// Dequantize row `r` into `out` (length `cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        // Sizes and scale bytes were validated in `new`.
        let _ = mxfp4::dequantize_row(self.packed_row(r), self.scales_row(r), out);
    }
}
