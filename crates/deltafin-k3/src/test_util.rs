//! Test helpers: a deterministic RNG, random weights with O(1) activations, and the f64
//! primitives the block references are written with.

use deltafin_tensor::{Bf16Matrix, Bytes, Mxfp4Matrix, bf16};

/// xorshift64 generator.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    /// `1 + spread·U(-1,1)` per entry (norm weights).
    pub fn around_one(&mut self, n: usize, spread: f32) -> Vec<f32> {
        (0..n).map(|_| 1.0 + spread * self.f()).collect()
    }
    /// bf16-representable values (norm weights ship as bf16).
    pub fn bf16_vec(&mut self, v: Vec<f32>) -> Vec<f32> {
        v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect()
    }
    /// Random bf16 `[rows, cols]` with unit-variance outputs for unit-variance inputs.
    pub fn bf16_matrix(&mut self, rows: usize, cols: usize) -> Bf16Matrix {
        self.bf16_matrix_scaled(rows, cols, 1.0)
    }
    pub fn bf16_matrix_scaled(&mut self, rows: usize, cols: usize, gain: f32) -> Bf16Matrix {
        let s = gain * (3.0 / cols as f32).sqrt();
        let v: Vec<bf16> = (0..rows * cols)
            .map(|_| bf16::from_f32(self.f() * s))
            .collect();
        Bf16Matrix::from_values(rows, cols, &v).unwrap()
    }
    /// Random MXFP4 `[rows, cols]` (cols a multiple of 32) with roughly unit-gain rows.
    pub fn mxfp4_matrix(&mut self, rows: usize, cols: usize) -> Mxfp4Matrix {
        let packed: Vec<u8> = (0..rows * cols / 2)
            .map(|_| self.next_u64() as u8)
            .collect();
        // E2M1 codes have rms ≈ 2.9; aim at rms ≈ 1/√cols.
        let target = (1.0 / (cols as f32).sqrt() / 2.9).log2().round() as i32;
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| (127 + target + (self.next_u64() % 2) as i32) as u8)
            .collect();
        Mxfp4Matrix::new(
            "random",
            Bytes::from_vec(packed),
            Bytes::from_vec(scales),
            rows,
            cols,
        )
        .unwrap()
    }
}

/// A dense matrix whose effective rows the f64 references read.
pub trait DenseRows {
    fn shape(&self) -> (usize, usize);
    fn row_into(&self, r: usize, out: &mut [f32]);
}

impl DenseRows for Bf16Matrix {
    fn shape(&self) -> (usize, usize) {
        (self.rows(), self.cols())
    }
    fn row_into(&self, r: usize, out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(self.row(r)) {
            *o = v.to_f32();
        }
    }
}

impl DenseRows for crate::model::linear::Linear {
    fn shape(&self) -> (usize, usize) {
        (self.rows(), self.cols())
    }
    fn row_into(&self, r: usize, out: &mut [f32]) {
        self.row_f32(r, out);
    }
}

/// `W·x` in f64 for a bf16 matrix or a [`crate::model::linear::Linear`] (its effective weights).
pub fn mv64(w: &impl DenseRows, x: &[f64]) -> Vec<f64> {
    let (rows, cols) = w.shape();
    assert_eq!(cols, x.len());
    let mut row = vec![0f32; cols];
    (0..rows)
        .map(|r| {
            w.row_into(r, &mut row);
            row.iter().zip(x).map(|(&a, b)| a as f64 * b).sum()
        })
        .collect()
}

/// `W·x` in f64 for an MXFP4 matrix (dequantized exactly).
pub fn mv64_mx(w: &Mxfp4Matrix, x: &[f64]) -> Vec<f64> {
    assert_eq!(w.cols(), x.len());
    let mut row = vec![0f32; w.cols()];
    (0..w.rows())
        .map(|r| {
            w.dequantize_row(r, &mut row);
            row.iter().zip(x).map(|(&a, b)| a as f64 * b).sum()
        })
        .collect()
}

pub fn sig64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `w ⊙ x / √(mean(x²) + eps)` in f64.
pub fn rms64(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, &wi)| wi as f64 * v * inv)
        .collect()
}

pub fn situ64(g: &[f64], u: &[f64], b1: f64, b2: f64) -> Vec<f64> {
    g.iter()
        .zip(u)
        .map(|(&g, &u)| b1 * (g / b1).tanh() * sig64(g) * (b2 * (u / b2).tanh()))
        .collect()
}

pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(&x, y)| (x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// ‖a − b‖ / ‖b‖ for two f32 vectors.
pub fn rel_l2_32(a: &[f32], b: &[f32]) -> f64 {
    rel_l2(a, &to64(b))
}

/// A synthesized tiny checkpoint (14 layers: KDA, MLA, dense, MoE) with a 1,024-token
/// vocabulary from `seed`, opened; with `int8`, its row-int8 spine converted too.
pub fn small_checkpoint(
    seed: u64,
    int8: bool,
) -> (tempfile::TempDir, deltafin_store::checkpoint::Checkpoint) {
    let dir = tempfile::tempdir().unwrap();
    let dims = crate::synth::SynthDims {
        vocab: 1024,
        ..crate::synth::SynthDims::tiny()
    };
    crate::synth::synthesize(dir.path(), &crate::synth::SynthSpec::new(dims, seed)).unwrap();
    let ckpt = deltafin_store::checkpoint::Checkpoint::open(dir.path()).unwrap();
    if int8 {
        deltafin_store::spine_int8::convert_spine(&ckpt, &Default::default(), &mut |_| {}).unwrap();
    }
    (dir, ckpt)
}
