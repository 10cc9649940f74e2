//! Canaries: each kernel on a small known input against an f64 reference.

use super::report::{Check, Status};
use anyhow::Result;
use deltafin_tensor::{Bf16Matrix, Bytes, Mxfp4Matrix, bf16, mxfp4};
/// Relative tolerance of the canaries: `|y − ref| ≤ CANARY_RTOL · Σ|terms| + CANARY_ATOL`.
pub const CANARY_RTOL: f64 = 1e-5;
/// Absolute floor of the canary tolerance.
pub const CANARY_ATOL: f64 = 1e-6;

/// Deterministic test values in [−1, 1] with a few bits of mantissa (exact in bf16).
pub(super) fn pattern(i: usize, salt: usize) -> f32 {
    (((i * 7919 + salt * 104_729) % 257) as f32 - 128.0) / 128.0
}

pub(super) fn canary_result(
    name: String,
    run: impl FnOnce() -> Result<(f64, usize), String>,
) -> Check {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
    match outcome {
        Ok(Ok((worst, n))) if worst <= 1.0 => Check {
            name,
            status: Status::Ok,
            detail: format!(
                "{n} outputs within tolerance (worst |error| {:.3}× the tolerance {CANARY_RTOL:e}·Σ|terms| + {CANARY_ATOL:e})",
                worst
            ),
            fix: None,
        },
        Ok(Ok((worst, n))) => Check {
            name,
            status: Status::Fail,
            detail: format!(
                "{n} outputs; worst error is {worst:.3e} times the tolerance {CANARY_RTOL:e}·Σ|terms| + {CANARY_ATOL:e}"
            ),
            fix: Some(
                "the compute kernels give wrong results on this CPU: report it with `deltafin doctor --json` output; try K3_MXFP4_DISABLE_AVX2=1".into(),
            ),
        },
        Ok(Err(msg)) => Check {
            name,
            status: Status::Fail,
            detail: msg,
            fix: Some("report it with `deltafin doctor --json` output".into()),
        },
        Err(_) => Check {
            name,
            status: Status::Fail,
            detail: "the kernel panicked on a valid input".into(),
            fix: Some("report it with `deltafin doctor --json` output".into()),
        },
    }
}

/// Worst `|y − ref| / (rtol·scale + atol)` over all outputs.
pub(super) fn worst_ratio(y: &[f32], reference: &[f64], scale: &[f64]) -> f64 {
    y.iter()
        .zip(reference)
        .zip(scale)
        .map(|((&v, &r), &s)| {
            if !v.is_finite() {
                f64::INFINITY
            } else {
                (v as f64 - r).abs() / (CANARY_RTOL * s + CANARY_ATOL)
            }
        })
        .fold(0.0, f64::max)
}

pub(super) fn canary_bf16(rows: usize, cols: usize) -> Result<(f64, usize), String> {
    let w: Vec<bf16> = (0..rows * cols)
        .map(|i| bf16::from_f32(pattern(i, 1)))
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| pattern(i, 2)).collect();
    let m = Bf16Matrix::from_values(rows, cols, &w).map_err(|e| e.to_string())?;
    let mut y = vec![0f32; rows];
    deltafin_kernels::matvec_bf16(&m, &x, &mut y);
    let mut reference = vec![0f64; rows];
    let mut scale = vec![0f64; rows];
    for r in 0..rows {
        for c in 0..cols {
            let t = w[r * cols + c].to_f32() as f64 * x[c] as f64;
            reference[r] += t;
            scale[r] += t.abs();
        }
    }
    Ok((worst_ratio(&y, &reference, &scale), rows))
}

pub(super) fn canary_mxfp4(rows: usize, cols: usize) -> Result<(f64, usize), String> {
    let packed: Vec<u8> = (0..rows * cols / 2)
        .map(|i| ((i * 37 + 11) % 256) as u8)
        .collect();
    let scales: Vec<u8> = (0..rows * cols / mxfp4::GROUP)
        .map(|i| 120 + (i % 11) as u8)
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| pattern(i, 3)).collect();
    let m = Mxfp4Matrix::new(
        "doctor canary",
        Bytes::from_vec(packed.clone()),
        Bytes::from_vec(scales.clone()),
        rows,
        cols,
    )
    .map_err(|e| e.to_string())?;
    let mut y = vec![0f32; rows];
    deltafin_kernels::matvec_mxfp4(&m, &x, &mut y);
    let mut reference = vec![0f64; rows];
    let mut scale = vec![0f64; rows];
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        let p = &packed[r * cols / 2..(r + 1) * cols / 2];
        let s = &scales[r * cols / mxfp4::GROUP..(r + 1) * cols / mxfp4::GROUP];
        mxfp4::dequantize_row(p, s, &mut row)
            .ok_or_else(|| "the reference dequantizer rejected the canary row".to_string())?;
        for c in 0..cols {
            let t = row[c] as f64 * x[c] as f64;
            reference[r] += t;
            scale[r] += t.abs();
        }
    }
    Ok((worst_ratio(&y, &reference, &scale), rows))
}

pub(super) fn canary_rms_norm(n: usize) -> Result<(f64, usize), String> {
    let x: Vec<f32> = (0..n).map(|i| pattern(i, 4) * 3.0).collect();
    let w: Vec<f32> = (0..n).map(|i| 1.0 + pattern(i, 5) / 8.0).collect();
    let eps = 1e-5f32;
    let mut y = vec![0f32; n];
    deltafin_kernels::rms_norm(&x, &w, eps, &mut y);
    let ms: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / n as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    let reference: Vec<f64> = x
        .iter()
        .zip(&w)
        .map(|(&v, &wi)| wi as f64 * v as f64 * inv)
        .collect();
    let scale: Vec<f64> = reference.iter().map(|v| v.abs()).collect();
    Ok((worst_ratio(&y, &reference, &scale), n))
}

pub(super) fn canary_softmax(n: usize) -> Result<(f64, usize), String> {
    let x: Vec<f32> = (0..n).map(|i| pattern(i, 6) * 20.0).collect();
    let mut y = x.clone();
    deltafin_kernels::softmax_inplace(&mut y);
    let max = x
        .iter()
        .map(|&v| v as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
    let reference: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp() / sum).collect();
    let scale: Vec<f64> = reference.iter().map(|v| v.abs()).collect();
    Ok((worst_ratio(&y, &reference, &scale), n))
}

pub(super) fn canaries() -> Vec<Check> {
    vec![
        canary_result("canary matvec_bf16 32x32".into(), || canary_bf16(32, 32)),
        canary_result("canary matvec_bf16 512x2048 (parallel rows)".into(), || {
            canary_bf16(512, 2048)
        }),
        canary_result("canary matvec_mxfp4 32x32".into(), || canary_mxfp4(32, 32)),
        canary_result(
            "canary matvec_mxfp4 512x2048 (parallel rows)".into(),
            || canary_mxfp4(512, 2048),
        ),
        canary_result("canary rms_norm 7168".into(), || canary_rms_norm(7168)),
        canary_result("canary softmax 1024".into(), || canary_softmax(1024)),
    ]
}
