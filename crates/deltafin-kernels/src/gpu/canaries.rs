//! The doctor's device canaries: each kernel at a small shape against the CPU reference, on
//! any GPU backend.

use deltafin_tensor::bf16;

use super::device::GpuDevice;
use super::shapes::{KdaStep, MlaDecode, MlaShape};
use crate::matvec::Weights;

/// Deterministic test values in (−1, 1).
fn pattern(i: usize, salt: usize) -> f32 {
    let x = (i
        .wrapping_mul(2_654_435_761)
        .wrapping_add(salt.wrapping_mul(40_503)))
        % 2001;
    x as f32 / 1000.0 - 1.0
}

/// Worst `|a − b|` relative to the largest `|b|`.
fn worst_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12) as f64;
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs() / scale)
        .fold(0.0, f64::max)
}

/// The doctor's device canaries (docs/OPERATIONS.md (doctor)) on any GPU backend: each kernel at a
/// small shape against the CPU reference. Returns `(name, worst relative error or the failure)`; an error above
/// 1e-4 is reported as a failure.
pub fn canaries<D: GpuDevice>(dev: &D) -> Vec<(String, Result<f64, String>)> {
    use deltafin_tensor::{Bf16Matrix, Bytes, Mxfp4Matrix, RowInt8Matrix};
    let mut out = Vec::new();
    let judge = |r: Result<f64, D::Error>| match r {
        Ok(e) if e <= 1e-4 => Ok(e),
        Ok(e) => Err(format!("worst relative error {e:.2e} > 1e-4")),
        Err(e) => Err(e.to_string()),
    };
    let (rows, cols, n) = (32usize, 64usize, 3usize);
    let vals: Vec<f32> = (0..rows * cols).map(|i| pattern(i, 1)).collect();
    let xs: Vec<f32> = (0..n * cols).map(|i| pattern(i, 2)).collect();
    let bv: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
    let mats = (
        Bf16Matrix::from_values(rows, cols, &bv),
        RowInt8Matrix::quantize("canary", rows, cols, &vals),
        Mxfp4Matrix::new(
            "canary",
            Bytes::from_vec((0..rows * cols / 2).map(|i| (i * 37 % 256) as u8).collect()),
            Bytes::from_vec((0..rows * cols / 32).map(|i| 120 + (i % 9) as u8).collect()),
            rows,
            cols,
        ),
    );
    let (Ok(bf), Ok(i8m), Ok(mx)) = mats else {
        out.push((
            "matmul".into(),
            Err("building the canary matrices failed".into()),
        ));
        return out;
    };
    for w in [
        Weights::Bf16(&bf),
        Weights::RowInt8(&i8m),
        Weights::Mxfp4(&mx),
    ] {
        let r = dev
            .upload_weights(w)
            .and_then(|m| dev.matmul(&m, &xs, n))
            .map(|gpu| {
                let mut cpu = vec![0f32; n * rows];
                crate::matmul(w, &xs, n, &mut cpu);
                worst_rel(&gpu, &cpu)
            });
        out.push((format!("matmul_{}", w.dtype()), judge(r)));
    }
    // KDA decode: 2 heads of 32, two steps from a zero state.
    let (h, d) = (2usize, 32usize);
    let mut s_gpu = vec![0f32; h * d * d];
    let mut s_cpu = s_gpu.clone();
    let mut r = Ok(0.0);
    for step in 0..2 {
        let v = |salt: usize| {
            (0..h * d)
                .map(|i| pattern(i, salt + 10 * step))
                .collect::<Vec<_>>()
        };
        let (q, k, vv) = (v(3), v(4), v(5));
        let g: Vec<f32> = v(6).iter().map(|x| -0.5 * (x + 1.0)).collect();
        let beta = [0.7f32, 0.3];
        let x = KdaStep {
            heads: h,
            d,
            q: &q,
            k: &k,
            v: &vv,
            g: &g,
            beta: &beta,
        };
        let gpu = dev.kda_step(&mut s_gpu, &x);
        r = gpu.map(|o| {
            let cpu = x.reference(&mut s_cpu);
            worst_rel(&o, &cpu).max(worst_rel(&s_gpu, &s_cpu))
        });
        if r.is_err() {
            break;
        }
    }
    out.push(("kda_decode".into(), judge(r)));
    // MLA decode: 2 heads, nope 16, rope 8, v 16, kv_lora 64, 5 cached tokens.
    let sh = MlaShape {
        heads: 2,
        nope: 16,
        rope: 8,
        v: 16,
        kvl: 64,
    };
    let tokens = 5;
    let bfv = |len: usize, salt: usize| -> Vec<bf16> {
        (0..len).map(|i| bf16::from_f32(pattern(i, salt))).collect()
    };
    let q: Vec<f32> = (0..sh.heads * (sh.nope + sh.rope))
        .map(|i| pattern(i, 7))
        .collect();
    let kvb = bfv(sh.heads * (sh.nope + sh.v) * sh.kvl, 8);
    let latent = bfv(tokens * sh.kvl, 9);
    let tail = bfv(tokens * sh.rope, 10);
    let gate: Vec<f32> = (0..sh.heads * sh.v).map(|i| pattern(i, 11)).collect();
    let x = MlaDecode {
        shape: sh,
        tokens,
        q: &q,
        kv_b: &kvb,
        latent: &latent,
        tail: &tail,
        gate: &gate,
    };
    let r = dev
        .mla_decode(&x)
        .map(|gpu| worst_rel(&gpu, &x.reference()));
    out.push(("mla_decode".into(), judge(r)));
    out
}
