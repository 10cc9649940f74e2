//! Row-int8 matrices (docs/K3.md §12.6): int8 row-major data plus one f16 scale per row.
//!
//! Quantization of one row `x` (BF16 widened to f32):
//! `scale = absmax(x) / 127` (an all-zero row uses `scale = 1`),
//! `q = clamp(round_half_even(x / scale), −127, 127)`, and the scale is stored as f16.
//! The codes are computed with the f32 scale; the stored (f16-rounded) scale is the one
//! kernels multiply by, so `W[r, c] ≈ f16(scale_r) · q[r, c]`.

use crate::{Bf16Matrix, Bytes, TensorError};
use half::f16;

/// Quantize one row into `q` (same length as `x`) and return its scale as stored (f16).
///
/// Errors if a value is not finite or the scale does not fit f16 (`absmax > 127 · 65504`).
pub fn quantize_row(x: &[f32], q: &mut [i8]) -> Result<f16, String> {
    if x.len() != q.len() {
        return Err(format!(
            "row length {} does not match code buffer length {}",
            x.len(),
            q.len()
        ));
    }
    let mut absmax = 0f32;
    for (c, &v) in x.iter().enumerate() {
        if !v.is_finite() {
            return Err(format!("column {c} holds the non-finite value {v}"));
        }
        absmax = absmax.max(v.abs());
    }
    let scale = if absmax == 0.0 { 1.0 } else { absmax / 127.0 };
    let stored = f16::from_f32(scale);
    if !stored.is_finite() {
        return Err(format!(
            "row scale {scale} (absmax {absmax} / 127) overflows f16"
        ));
    }
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    Ok(stored)
}

/// A row-major int8 matrix `[rows, cols]` with one f16 scale per row: `W[r, c] = scale_r · q[r, c]`.
#[derive(Clone, Debug)]
pub struct RowInt8Matrix {
    data: Bytes,
    scales: Bytes,
    rows: usize,
    cols: usize,
}

impl RowInt8Matrix {
    /// `data` holds `rows * cols` int8 codes, `scales` holds `rows` little-endian f16 scales.
    /// Rejects wrong sizes, the code −128 (outside the symmetric range) and scales that are
    /// negative or not finite. `scales` is copied only if misaligned.
    pub fn new(
        name: &str,
        data: Bytes,
        scales: Bytes,
        rows: usize,
        cols: usize,
    ) -> Result<Self, TensorError> {
        Self::build(name, data, scales, rows, cols, true)
    }

    /// As [`RowInt8Matrix::new`] but without the scan of every code for −128 (a full read of
    /// the data): for memory-mapped spine files whose content is covered by a receipt hash
    /// checked elsewhere. Sizes and scales are still validated.
    pub fn new_unscanned(
        name: &str,
        data: Bytes,
        scales: Bytes,
        rows: usize,
        cols: usize,
    ) -> Result<Self, TensorError> {
        Self::build(name, data, scales, rows, cols, false)
    }

    fn build(
        name: &str,
        data: Bytes,
        scales: Bytes,
        rows: usize,
        cols: usize,
        scan_codes: bool,
    ) -> Result<Self, TensorError> {
        if data.len() != rows * cols {
            return Err(TensorError::tensor(
                name,
                format!(
                    "int8 codes: expected {} bytes for [{rows}, {cols}], found {}",
                    rows * cols,
                    data.len()
                ),
            ));
        }
        if scales.len() != rows * 2 {
            return Err(TensorError::tensor(
                name,
                format!(
                    "row scales: expected {} bytes ({rows} f16 values), found {}",
                    rows * 2,
                    scales.len()
                ),
            ));
        }
        if let Some(pos) = scan_codes
            .then(|| data.as_slice().iter().position(|&b| b == 0x80))
            .flatten()
        {
            return Err(TensorError::tensor(
                name,
                format!(
                    "int8 code -128 at row {}, column {} (codes must lie in -127..=127)",
                    pos / cols.max(1),
                    pos % cols.max(1)
                ),
            ));
        }
        let scales = scales.aligned(2);
        for (r, b) in scales.as_slice().chunks_exact(2).enumerate() {
            let s = f16::from_le_bytes([b[0], b[1]]);
            if !s.is_finite() || s.is_sign_negative() {
                return Err(TensorError::tensor(
                    name,
                    format!("row {r}: scale {s} is not a finite non-negative f16"),
                ));
            }
        }
        Ok(RowInt8Matrix {
            data,
            scales,
            rows,
            cols,
        })
    }

    /// Quantize row-major f32 values `[rows, cols]` by the §4.6 rule.
    pub fn quantize(
        name: &str,
        rows: usize,
        cols: usize,
        values: &[f32],
    ) -> Result<Self, TensorError> {
        if values.len() != rows * cols {
            return Err(TensorError::tensor(
                name,
                format!(
                    "expected {} values for [{rows}, {cols}], found {}",
                    rows * cols,
                    values.len()
                ),
            ));
        }
        let mut codes = vec![0i8; rows * cols];
        let mut scales = Vec::with_capacity(rows * 2);
        for r in 0..rows {
            let s = quantize_row(
                &values[r * cols..(r + 1) * cols],
                &mut codes[r * cols..(r + 1) * cols],
            )
            .map_err(|m| TensorError::tensor(name, format!("row {r}: {m}")))?;
            scales.extend_from_slice(&s.to_le_bytes());
        }
        let data = Bytes::copy_from_slice(bytemuck::cast_slice(&codes));
        Self::new(name, data, Bytes::from_vec(scales), rows, cols)
    }

    /// Quantize a bf16 matrix (the `convert-spine-int8` rule).
    pub fn from_bf16(name: &str, w: &Bf16Matrix) -> Result<Self, TensorError> {
        let values: Vec<f32> = w.data().iter().map(|v| v.to_f32()).collect();
        Self::quantize(name, w.rows(), w.cols(), &values)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The codes' shared bytes (zero-copy, e.g. to write them elsewhere).
    /// The same shape over other bytes: copies of the codes and scales moved to other
    /// memory (sizes and scales are validated as [`RowInt8Matrix::new_unscanned`] does).
    pub fn with_bytes(&self, name: &str, data: Bytes, scales: Bytes) -> Result<Self, TensorError> {
        Self::build(name, data, scales, self.rows, self.cols, false)
    }

    pub fn data_bytes(&self) -> &Bytes {
        &self.data
    }
    /// The f16 scales' shared bytes (little endian).
    pub fn scale_bytes(&self) -> &Bytes {
        &self.scales
    }
    /// All codes, row-major.
    pub fn data(&self) -> &[i8] {
        bytemuck::cast_slice(self.data.as_slice())
    }
    /// The codes of row `r`.
    pub fn row(&self, r: usize) -> &[i8] {
        &self.data()[r * self.cols..(r + 1) * self.cols]
    }
    /// The stored f16 scales, one per row.
    pub fn scales(&self) -> &[f16] {
        // Alignment and length are established in `new`.
        bytemuck::try_cast_slice(self.scales.as_slice()).unwrap_or(&[])
    }
    /// The scale of row `r` widened to f32.
    pub fn scale(&self, r: usize) -> f32 {
        self.scales()[r].to_f32()
    }
    /// Dequantize row `r` into `out` (length `cols`): `scale_r · q`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let s = self.scale(r);
        for (o, &q) in out.iter_mut().zip(self.row(r)) {
            *o = s * q as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantization_rule() {
        // absmax 2.54 → scale ≈ 0.02; codes follow the rule computed with the f32 scale.
        let x = [2.54f32, -2.54, 1.27, 0.03, -0.01, 0.0];
        let mut q = [0i8; 6];
        let s = quantize_row(&x, &mut q).unwrap();
        assert_eq!(s, f16::from_f32(2.54 / 127.0));
        let scale = 2.54f32 / 127.0;
        let want: Vec<i8> = x
            .iter()
            .map(|v| (v / scale).round_ties_even() as i8)
            .collect();
        assert_eq!(q.to_vec(), want);
        assert_eq!(q[0], 127);
        assert_eq!(q[1], -127);
    }

    #[test]
    fn half_even_ties_and_zero_row() {
        // absmax 127 → scale exactly 1, so x / scale = x and ties are visible.
        let x = [127.0f32, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5];
        let mut q = [0i8; 7];
        let s = quantize_row(&x, &mut q).unwrap();
        assert_eq!(s.to_f32(), 1.0);
        assert_eq!(q, [127, 0, 2, 2, 0, -2, -2]);
        let mut z = [5i8; 4];
        assert_eq!(quantize_row(&[0.0; 4], &mut z).unwrap().to_f32(), 1.0);
        assert_eq!(z, [0; 4]);
        assert!(quantize_row(&[f32::NAN], &mut [0]).is_err());
        assert!(
            quantize_row(&[1e9], &mut [0]).is_err(),
            "scale overflows f16"
        );
    }

    #[test]
    fn matrix_roundtrip_and_validation() {
        let vals: Vec<f32> = (0..24).map(|i| (i as f32 - 11.0) * 0.37).collect();
        let m = RowInt8Matrix::quantize("w", 3, 8, &vals).unwrap();
        let mut out = [0f32; 8];
        for r in 0..3 {
            m.dequantize_row(r, &mut out);
            let absmax = vals[r * 8..(r + 1) * 8]
                .iter()
                .fold(0f32, |a, v| a.max(v.abs()));
            for c in 0..8 {
                // Error ≤ half a step plus the f16 rounding of the scale (relative 2^-11).
                let tol = absmax / 127.0 * 0.5 + absmax * 2f32.powi(-10);
                assert!((out[c] - vals[r * 8 + c]).abs() <= tol, "r{r} c{c}");
            }
        }
        let bad = RowInt8Matrix::new(
            "w",
            Bytes::from_vec(vec![0x80, 0]),
            Bytes::from_vec(f16::ONE.to_le_bytes().to_vec()),
            1,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(bad.contains("-128") && bad.contains("`w`"), "{bad}");
        let short = RowInt8Matrix::new(
            "w",
            Bytes::from_vec(vec![0; 4]),
            Bytes::from_vec(vec![0; 2]),
            2,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(short.contains("row scales"), "{short}");
        let nan = RowInt8Matrix::new(
            "w",
            Bytes::from_vec(vec![0; 2]),
            Bytes::from_vec(f16::NAN.to_le_bytes().to_vec()),
            1,
            2,
        );
        assert!(nan.is_err());
    }
}
