use super::*;
use crate::matvec::Weights;
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

impl GpuDevice for Cpu {
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
    fn kda_step(&self, state: &mut [f32], x: &KdaStep<'_>) -> Result<Vec<f32>, String> {
        Ok(self.off(x.reference(state)))
    }
    fn mla_decode(&self, x: &MlaDecode<'_>) -> Result<Vec<f32>, String> {
        Ok(self.off(x.reference()))
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
