//! Shared bench helpers: reproducible random weight matrices of every format.
//!
//! Criterion benchmarks live in `benches/benches/` (`cargo bench -p deltafin-benches`); the
//! `kernel-point` binary measures one product at one size (in cache or from DRAM).

use std::sync::Arc;

use deltafin_kernels::Weights;
use deltafin_tensor::{Bf16Matrix, Bytes, Mxfp4Matrix, RowInt8Matrix};

/// Install the kernel settings the environment names (`DELTAFIN_KERNEL`, `DELTAFIN_MXFP4_ACT`,
/// `DELTAFIN_POOL_SPIN`, `DELTAFIN_POOL_PREFETCH`, as `deltafin` reads them), each parsed
/// strictly; call it before the first product.
pub fn install_kernel_settings_from_env() -> Result<(), String> {
    let settings = deltafin_kernels::KernelSettings::from_lookup(|name| {
        std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
    })
    .map_err(|e| e.to_string())?;
    deltafin_kernels::configure(settings).map_err(|e| e.to_string())
}

/// xorshift64 generator for reproducible bench data.
pub struct Rng(pub u64);
impl Rng {
    /// Next pseudo-random value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// `len` pseudo-random bytes, each passed through `map` (keeps values finite and normal).
pub fn random_bytes(rng: &mut Rng, len: usize, map: impl Fn(usize, u8) -> u8) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (i, chunk) in v.chunks_mut(8).enumerate() {
        let r = rng.next_u64().to_le_bytes();
        for (k, b) in chunk.iter_mut().enumerate() {
            *b = map(i * 8 + k, r[k]);
        }
    }
    v
}

/// Bytes owned by the matrix.
pub fn owned(v: Vec<u8>) -> Bytes {
    Bytes::from_owner(Arc::new(v))
}

/// Owned weights of one format.
pub enum Owned {
    /// f32 values, rows, columns.
    F32(Vec<f32>, usize, usize),
    /// bf16.
    Bf16(Bf16Matrix),
    /// Row-int8.
    RowInt8(RowInt8Matrix),
    /// MXFP4.
    Mxfp4(Mxfp4Matrix),
}

impl Owned {
    /// The kernel view of the matrix.
    pub fn weights(&self) -> Weights<'_> {
        match self {
            Owned::F32(d, rows, cols) => Weights::F32 {
                data: d,
                rows: *rows,
                cols: *cols,
            },
            Owned::Bf16(m) => Weights::Bf16(m),
            Owned::RowInt8(m) => Weights::RowInt8(m),
            Owned::Mxfp4(m) => Weights::Mxfp4(m),
        }
    }
}

/// A random matrix of `dtype` (`f32`, `bf16`, `row-int8`, anything else = MXFP4) with `cols`
/// columns and about `target` weight bytes (at least one row), values finite and normal.
pub fn build(dtype: &str, cols: usize, target: usize, rng: &mut Rng) -> Owned {
    match dtype {
        "f32" => {
            let rows = (target / (cols * 4)).max(1);
            // Sign, exponent 2^-3..2^-2, random mantissa: finite and normal.
            let v = random_bytes(rng, rows * cols * 4, |i, b| match i % 4 {
                3 => 0x3e | (b & 0x80),
                _ => b,
            });
            let f: Vec<f32> = bytemuck_f32(&v);
            Owned::F32(f, rows, cols)
        }
        "bf16" => {
            let rows = (target / (cols * 2)).max(1);
            let v = random_bytes(rng, rows * cols * 2, |i, b| {
                if i % 2 == 1 { 0x3e | (b & 0x80) } else { b }
            });
            Owned::Bf16(Bf16Matrix::new("bench", owned(v), rows, cols).expect("bf16 matrix"))
        }
        "row-int8" => {
            let rows = (target / (cols + 2)).max(1);
            let codes = random_bytes(rng, rows * cols, |_, b| if b == 0x80 { 0x81 } else { b });
            let scales = random_bytes(rng, rows * 2, |i, b| {
                if i % 2 == 1 { 0x1c | (b & 0x01) } else { b }
            });
            Owned::RowInt8(
                RowInt8Matrix::new("bench", owned(codes), owned(scales), rows, cols)
                    .expect("row-int8 matrix"),
            )
        }
        _ => {
            let rows = (target / (cols / 2 + cols / 32)).max(1);
            let packed = random_bytes(rng, rows * cols / 2, |_, b| b);
            let scales = random_bytes(rng, rows * cols / 32, |_, b| 118 + b % 16);
            Owned::Mxfp4(
                Mxfp4Matrix::new("bench", owned(packed), owned(scales), rows, cols)
                    .expect("mxfp4 matrix"),
            )
        }
    }
}

fn bytemuck_f32(v: &[u8]) -> Vec<f32> {
    v.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
