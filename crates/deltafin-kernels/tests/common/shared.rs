//! What the integration tests (`tests/common`) and the library's unit tests (`src/lib.rs`
//! includes this file, and `skip.rs`) share: deterministic random inputs and thread pools.

use deltafin_tensor::{Bytes, Mxfp4Matrix};

/// xorshift64: the same inputs on every run.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [0, 1), in steps of 2⁻²⁴.
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [−1, 1).
    pub fn f(&mut self) -> f32 {
        self.unit() * 2.0 - 1.0
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `n` values of [`Rng::f`].
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// Thread pools of 1, 2 and 3 threads (a product's bits must not depend on which one runs it).
pub fn pools() -> Vec<rayon::ThreadPool> {
    (1..=3).map(pool).collect()
}

/// A pool of `threads` threads.
pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// Random MXFP4 codes (`rows × cols`) with scales around 2⁻⁹…2⁶, some zero (2⁻¹²⁷, the
/// subnormal code) and some large (2¹³).
pub fn mxfp4(rng: &mut Rng, rows: usize, cols: usize) -> Mxfp4Matrix {
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| match rng.below(16) {
            0 => 0,
            1 => 140,
            _ => 118 + rng.below(16) as u8,
        })
        .collect();
    Mxfp4Matrix::new(
        "t",
        Bytes::from_vec(packed),
        Bytes::from_vec(scales),
        rows,
        cols,
    )
    .unwrap()
}
