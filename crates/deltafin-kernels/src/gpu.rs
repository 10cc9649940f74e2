//! What the GPU backends (CUDA, Metal) share and the CPU can check without a device: the
//! MLA decode shape and the doctor's canaries, written once against [`CanaryDevice`].

use crate::matvec::Weights;
use deltafin_tensor::bf16;

/// Shapes of one MLA absorbed decode (docs/K3.md §4.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaShape {
    /// Heads `H`.
    pub heads: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim`.
    pub rope: usize,
    /// `v_head_dim`.
    pub v: usize,
    /// `kv_lora_rank`.
    pub kvl: usize,
}

/// The device operations the canaries exercise (implemented by `cuda::CudaDevice` and
/// `metal::MetalDevice`).
pub trait CanaryDevice {
    /// A weight matrix resident on the device.
    type Matrix;
    /// The backend's error.
    type Error: std::fmt::Display;
    /// Copy `w` to the device.
    fn upload_weights(&self, w: Weights<'_>) -> Result<Self::Matrix, Self::Error>;
    /// `W·xs` for `n` activation rows.
    fn matmul(&self, w: &Self::Matrix, xs: &[f32], n: usize) -> Result<Vec<f32>, Self::Error>;
    /// One KDA recurrent step over `h` heads of `d` (state updated in place); the outputs.
    #[allow(clippy::too_many_arguments)]
    fn kda_step(
        &self,
        h: usize,
        d: usize,
        state: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
    ) -> Result<Vec<f32>, Self::Error>;
    /// One absorbed MLA decode over `tokens` cached tokens.
    #[allow(clippy::too_many_arguments)]
    fn mla_decode(
        &self,
        shape: MlaShape,
        tokens: usize,
        q: &[f32],
        kv_b: &[bf16],
        latent: &[bf16],
        tail: &[bf16],
        gate: &[f32],
    ) -> Result<Vec<f32>, Self::Error>;
}

/// `impl CanaryDevice for $dev` by delegating to the backend's own inherent methods of the
/// same names (`DeviceMatrix` and `MlaShape` in scope, errors `$err`). Used only by the
/// device modules, which build with feature `cuda` or on macOS with feature `metal`.
#[cfg_attr(
    not(any(feature = "cuda", all(target_os = "macos", feature = "metal"))),
    allow(unused_macros)
)]
macro_rules! impl_canary_device {
    ($dev:ty, $err:ty) => {
        impl $crate::gpu::CanaryDevice for $dev {
            type Matrix = DeviceMatrix;
            type Error = $err;
            fn upload_weights(&self, w: $crate::matvec::Weights<'_>) -> Result<DeviceMatrix, $err> {
                <$dev>::upload_weights(self, w)
            }
            fn matmul(&self, w: &DeviceMatrix, xs: &[f32], n: usize) -> Result<Vec<f32>, $err> {
                <$dev>::matmul(self, w, xs, n)
            }
            fn kda_step(
                &self,
                h: usize,
                d: usize,
                state: &mut [f32],
                q: &[f32],
                k: &[f32],
                v: &[f32],
                g: &[f32],
                beta: &[f32],
            ) -> Result<Vec<f32>, $err> {
                <$dev>::kda_step(self, h, d, state, q, k, v, g, beta)
            }
            fn mla_decode(
                &self,
                shape: MlaShape,
                tokens: usize,
                q: &[f32],
                kv_b: &[deltafin_tensor::bf16],
                latent: &[deltafin_tensor::bf16],
                tail: &[deltafin_tensor::bf16],
                gate: &[f32],
            ) -> Result<Vec<f32>, $err> {
                <$dev>::mla_decode(self, shape, tokens, q, kv_b, latent, tail, gate)
            }
        }
    };
}
#[cfg_attr(
    not(any(feature = "cuda", all(target_os = "macos", feature = "metal"))),
    allow(unused_imports)
)]
pub(crate) use impl_canary_device;

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
pub fn canaries<D: CanaryDevice>(dev: &D) -> Vec<(String, Result<f64, String>)> {
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
        let gpu = dev.kda_step(h, d, &mut s_gpu, &q, &k, &vv, &g, &beta);
        r = gpu.map(|o| {
            let mut cpu = Vec::new();
            for hh in 0..h {
                let sl = hh * d..(hh + 1) * d;
                cpu.extend(crate::cuda::reference::kda_step(
                    &mut s_cpu[hh * d * d..(hh + 1) * d * d],
                    &q[sl.clone()],
                    &k[sl.clone()],
                    &vv[sl.clone()],
                    &g[sl],
                    beta[hh],
                ));
            }
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
    let r = dev
        .mla_decode(sh, tokens, &q, &kvb, &latent, &tail, &gate)
        .map(|gpu| {
            let cpu = crate::cuda::reference::mla_decode(
                (sh.heads, sh.nope, sh.rope, sh.v, sh.kvl),
                tokens,
                &q,
                &kvb,
                &latent,
                &tail,
                &gate,
            );
            worst_rel(&gpu, &cpu)
        });
    out.push(("mla_decode".into(), judge(r)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_tensor::{Bf16Matrix, Mxfp4Matrix, RowInt8Matrix};

    /// A "device" that runs the CPU kernels and the CUDA reference, optionally off by a
    /// relative `error` in every result: the canaries' logic checked without a GPU.
    struct Cpu {
        error: f32,
    }

    enum Owned {
        Bf16(Bf16Matrix),
        RowInt8(RowInt8Matrix),
        Mxfp4(Mxfp4Matrix),
    }

    impl Cpu {
        fn off(&self, mut v: Vec<f32>) -> Vec<f32> {
            for x in &mut v {
                *x += self.error * (x.abs() + 1.0);
            }
            v
        }
    }

    impl CanaryDevice for Cpu {
        type Matrix = Owned;
        type Error = String;
        fn upload_weights(&self, w: Weights<'_>) -> Result<Owned, String> {
            match w {
                Weights::Bf16(m) => Ok(Owned::Bf16(m.clone())),
                Weights::RowInt8(m) => Ok(Owned::RowInt8(m.clone())),
                Weights::Mxfp4(m) => Ok(Owned::Mxfp4(m.clone())),
                Weights::F32 { .. } => Err("f32 weights are not uploaded".into()),
            }
        }
        fn matmul(&self, w: &Owned, xs: &[f32], n: usize) -> Result<Vec<f32>, String> {
            let w = match w {
                Owned::Bf16(m) => Weights::Bf16(m),
                Owned::RowInt8(m) => Weights::RowInt8(m),
                Owned::Mxfp4(m) => Weights::Mxfp4(m),
            };
            let mut ys = vec![0f32; n * w.rows()];
            crate::matmul(w, xs, n, &mut ys);
            Ok(self.off(ys))
        }
        fn kda_step(
            &self,
            h: usize,
            d: usize,
            state: &mut [f32],
            q: &[f32],
            k: &[f32],
            v: &[f32],
            g: &[f32],
            beta: &[f32],
        ) -> Result<Vec<f32>, String> {
            let mut o = Vec::new();
            for hh in 0..h {
                let sl = hh * d..(hh + 1) * d;
                o.extend(crate::cuda::reference::kda_step(
                    &mut state[hh * d * d..(hh + 1) * d * d],
                    &q[sl.clone()],
                    &k[sl.clone()],
                    &v[sl.clone()],
                    &g[sl],
                    beta[hh],
                ));
            }
            Ok(self.off(o))
        }
        fn mla_decode(
            &self,
            sh: MlaShape,
            tokens: usize,
            q: &[f32],
            kv_b: &[bf16],
            latent: &[bf16],
            tail: &[bf16],
            gate: &[f32],
        ) -> Result<Vec<f32>, String> {
            Ok(self.off(crate::cuda::reference::mla_decode(
                (sh.heads, sh.nope, sh.rope, sh.v, sh.kvl),
                tokens,
                q,
                kv_b,
                latent,
                tail,
                gate,
            )))
        }
    }

    #[test]
    fn canaries_pass_an_exact_device_and_name_a_wrong_one() {
        let good = canaries(&Cpu { error: 0.0 });
        let names: Vec<&str> = good.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "matmul_bf16",
                "matmul_row-int8",
                "matmul_mxfp4",
                "kda_decode",
                "mla_decode"
            ]
        );
        for (name, r) in &good {
            assert!(matches!(r, Ok(e) if *e <= 1e-6), "{name}: {r:?}");
        }
        for (name, r) in canaries(&Cpu { error: 1e-3 }) {
            let e = r.expect_err(&name);
            assert!(e.contains("> 1e-4"), "{name}: {e}");
        }
    }
}
