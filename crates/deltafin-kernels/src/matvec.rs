//! Matrix-vector (`y = W·x`) and batched matrix products (`Y = X·Wᵀ`, one output row per input
//! row) over bf16 and MXFP4 weights, f32 activations, f32 accumulation.
//!
//! Every product of one weight row with one activation row is computed by the same code with
//! the same summation order in the single-vector and the batched kernels, so a batched result
//! row is bit-identical to the matrix-vector result for that row (row invariance).
//!
//! Work is split over output rows with rayon; small products run on the calling thread.

use deltafin_tensor::mxfp4::{E2M1, GROUP};
use deltafin_tensor::{Bf16Matrix, Mxfp4Matrix, bf16};
use rayon::prelude::*;

/// Number of independent accumulators in a dot product (one SIMD register's worth of lanes).
/// (Plain `a * b + c`, not `mul_add`: without the FMA target feature `mul_add` is a libm call.)
const LANES: usize = 8;
/// Below this many multiply-adds a product runs serially (thread hand-off costs more).
const PAR_THRESHOLD: usize = 1 << 15;
/// Batch rows processed together against one weight row (the weight row is read once per tile).
const BATCH_TILE: usize = 4;

#[inline(always)]
fn widen(v: bf16) -> f32 {
    f32::from_bits((v.to_bits() as u32) << 16)
}

/// Reduce the lane accumulators in a fixed order.
#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `Σ w_i x_i` for one bf16 row, `NB` activation rows at once, in the canonical order.
#[inline(always)]
fn dot_bf16_tile<const NB: usize>(w: &[bf16], xs: [&[f32]; NB]) -> [f32; NB] {
    let n = w.len();
    let main = n - n % LANES;
    let mut acc = [[0f32; LANES]; NB];
    let mut c = 0;
    while c < main {
        let mut wv = [0f32; LANES];
        for k in 0..LANES {
            wv[k] = widen(w[c + k]);
        }
        for b in 0..NB {
            let x = &xs[b][c..c + LANES];
            for k in 0..LANES {
                acc[b][k] += wv[k] * x[k];
            }
        }
        c += LANES;
    }
    let mut out = [0f32; NB];
    for b in 0..NB {
        let mut tail = 0f32;
        for i in main..n {
            tail += widen(w[i]) * xs[b][i];
        }
        out[b] = reduce(&acc[b]) + tail;
    }
    out
}

fn par_rows(rows: usize, work_per_row: usize) -> Option<usize> {
    if rows * work_per_row < PAR_THRESHOLD || rows < 2 {
        None
    } else {
        let threads = rayon::current_num_threads().max(1);
        // A few chunks per thread for load balance, at least 8 rows per chunk.
        Some(rows.div_ceil(threads * 4).max(8))
    }
}

/// `y = W·x` with `W` bf16 `[rows, cols]`, `x` of length `cols`, `y` of length `rows`.
///
/// # Panics
/// If the lengths disagree with the matrix shape.
pub fn matvec_bf16(w: &Bf16Matrix, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), cols, "matvec_bf16: input length");
    assert_eq!(y.len(), rows, "matvec_bf16: output length");
    let data = w.data();
    let row_fn = |r: usize, out: &mut f32| {
        *out = dot_bf16_tile::<1>(&data[r * cols..(r + 1) * cols], [x])[0];
    };
    match par_rows(rows, cols) {
        None => y.iter_mut().enumerate().for_each(|(r, o)| row_fn(r, o)),
        Some(chunk) => y.par_chunks_mut(chunk).enumerate().for_each(|(ci, ys)| {
            for (k, o) in ys.iter_mut().enumerate() {
                row_fn(ci * chunk + k, o);
            }
        }),
    }
}

/// Output written by row chunks into a batch-major buffer: `ys[b * rows + r]`.
struct BatchOut {
    ptr: *mut f32,
    rows: usize,
}
// SAFETY: every task writes a disjoint set of weight rows `r` (for all batch rows `b`), so
// the index sets `b * rows + r` written by different tasks never overlap.
unsafe impl Send for BatchOut {}
unsafe impl Sync for BatchOut {}

impl BatchOut {
    /// # Safety
    /// `b * rows + r` must be in bounds and written by one task only.
    #[inline(always)]
    unsafe fn write(&self, b: usize, r: usize, v: f32) {
        unsafe { *self.ptr.add(b * self.rows + r) = v };
    }
}

/// Run `f(r0, r1)` over output-row ranges, in parallel when the work is large enough.
fn for_row_ranges(rows: usize, work_per_row: usize, f: impl Fn(usize, usize) + Sync) {
    match par_rows(rows, work_per_row) {
        None => f(0, rows),
        Some(chunk) => (0..rows.div_ceil(chunk))
            .into_par_iter()
            .for_each(|ci| f(ci * chunk, ((ci + 1) * chunk).min(rows))),
    }
}

/// Batched product: `xs` holds `n` input rows of length `cols` (row-major), `ys` receives `n`
/// output rows of length `rows`: `ys[b] = W·xs[b]`. Each weight row is read once per tile of
/// four input rows. Row `b` of the result is bit-identical to `matvec_bf16(w, xs[b])`.
///
/// # Panics
/// If the lengths disagree with the matrix shape and `n`.
pub fn matmul_bf16(w: &Bf16Matrix, xs: &[f32], n: usize, ys: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(xs.len(), n * cols, "matmul_bf16: input length");
    assert_eq!(ys.len(), n * rows, "matmul_bf16: output length");
    if n == 1 {
        return matvec_bf16(w, xs, ys);
    }
    let data = w.data();
    let out = BatchOut {
        ptr: ys.as_mut_ptr(),
        rows,
    };
    let out = &out;
    for_row_ranges(rows, cols * n, |r0, r1| {
        for r in r0..r1 {
            let wr = &data[r * cols..(r + 1) * cols];
            let mut b = 0;
            while b + BATCH_TILE <= n {
                let x = |i: usize| &xs[(b + i) * cols..(b + i + 1) * cols];
                let v = dot_bf16_tile::<BATCH_TILE>(wr, [x(0), x(1), x(2), x(3)]);
                for (i, &vi) in v.iter().enumerate() {
                    // SAFETY: this task owns row r; b + i < n.
                    unsafe { out.write(b + i, r, vi) };
                }
                b += BATCH_TILE;
            }
            while b < n {
                let v = dot_bf16_tile::<1>(wr, [&xs[b * cols..(b + 1) * cols]])[0];
                // SAFETY: as above.
                unsafe { out.write(b, r, v) };
                b += 1;
            }
        }
    });
}

/// Byte → (value of low nibble, value of high nibble).
const fn pair_table() -> [[f32; 2]; 256] {
    let mut t = [[0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [E2M1[b & 0x0f], E2M1[b >> 4]];
        b += 1;
    }
    t
}
static PAIRS: [[f32; 2]; 256] = pair_table();

/// Decode one 32-column block of E2M1 codes (16 bytes) to its unscaled values.
#[inline(always)]
fn decode_block(packed: &[u8], out: &mut [f32; GROUP]) {
    for j in 0..GROUP / 2 {
        let p = PAIRS[packed[j] as usize];
        out[2 * j] = p[0];
        out[2 * j + 1] = p[1];
    }
}

/// `Σ_b scale_b · Σ_k E2M1(code) · x` for one MXFP4 row, `NB` activation rows at once.
#[inline(always)]
fn dot_mxfp4_tile<const NB: usize>(packed: &[u8], scales: &[u8], xs: [&[f32]; NB]) -> [f32; NB] {
    let mut total = [0f32; NB];
    let mut vals = [0f32; GROUP];
    for (blk, &e) in scales.iter().enumerate() {
        decode_block(&packed[blk * GROUP / 2..(blk + 1) * GROUP / 2], &mut vals);
        // Scale bytes were validated (no 255) when the matrix was built.
        let scale = deltafin_tensor::mxfp4::e8m0_scale(e).unwrap_or(f32::NAN);
        for b in 0..NB {
            let x = &xs[b][blk * GROUP..(blk + 1) * GROUP];
            let mut acc = [0f32; LANES];
            for c in (0..GROUP).step_by(LANES) {
                for k in 0..LANES {
                    acc[k] += vals[c + k] * x[c + k];
                }
            }
            total[b] += scale * reduce(&acc);
        }
    }
    total
}

/// `y = W·x` with `W` MXFP4 `[rows, cols]` (k3-model.md §3.3 kernel form: per 32-column block,
/// scale × Σ E2M1·x, accumulated in f32).
///
/// # Panics
/// If the lengths disagree with the matrix shape.
pub fn matvec_mxfp4(w: &Mxfp4Matrix, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), cols, "matvec_mxfp4: input length");
    assert_eq!(y.len(), rows, "matvec_mxfp4: output length");
    let row_fn = |r: usize, out: &mut f32| {
        *out = dot_mxfp4_tile::<1>(w.packed_row(r), w.scales_row(r), [x])[0];
    };
    match par_rows(rows, cols) {
        None => y.iter_mut().enumerate().for_each(|(r, o)| row_fn(r, o)),
        Some(chunk) => y.par_chunks_mut(chunk).enumerate().for_each(|(ci, ys)| {
            for (k, o) in ys.iter_mut().enumerate() {
                row_fn(ci * chunk + k, o);
            }
        }),
    }
}

/// Batched MXFP4 product, layout as [`matmul_bf16`]. Row `b` of the result is bit-identical
/// to `matvec_mxfp4(w, xs[b])`.
///
/// # Panics
/// If the lengths disagree with the matrix shape and `n`.
pub fn matmul_mxfp4(w: &Mxfp4Matrix, xs: &[f32], n: usize, ys: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(xs.len(), n * cols, "matmul_mxfp4: input length");
    assert_eq!(ys.len(), n * rows, "matmul_mxfp4: output length");
    if n == 1 {
        return matvec_mxfp4(w, xs, ys);
    }
    let out = BatchOut {
        ptr: ys.as_mut_ptr(),
        rows,
    };
    let out = &out;
    for_row_ranges(rows, cols * n, |r0, r1| {
        for r in r0..r1 {
            let (p, s) = (w.packed_row(r), w.scales_row(r));
            let mut b = 0;
            while b + BATCH_TILE <= n {
                let x = |i: usize| &xs[(b + i) * cols..(b + i + 1) * cols];
                let v = dot_mxfp4_tile::<BATCH_TILE>(p, s, [x(0), x(1), x(2), x(3)]);
                for (i, &vi) in v.iter().enumerate() {
                    // SAFETY: this task owns row r; b + i < n.
                    unsafe { out.write(b + i, r, vi) };
                }
                b += BATCH_TILE;
            }
            while b < n {
                let v = dot_mxfp4_tile::<1>(p, s, [&xs[b * cols..(b + 1) * cols]])[0];
                // SAFETY: as above.
                unsafe { out.write(b, r, v) };
                b += 1;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_tensor::Bytes;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn f(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    fn rand_bf16(rng: &mut Rng, rows: usize, cols: usize) -> Bf16Matrix {
        let v: Vec<bf16> = (0..rows * cols).map(|_| bf16::from_f32(rng.f())).collect();
        Bf16Matrix::from_values(rows, cols, &v).unwrap()
    }

    fn rand_mxfp4(rng: &mut Rng, rows: usize, cols: usize) -> Mxfp4Matrix {
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| 120 + (rng.next() % 12) as u8)
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

    fn check(got: &[f32], want: &[f64], abs_scale: &[f64]) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            // f32 accumulation error bound ~ n·eps·Σ|w x|; use a generous multiple of eps.
            let tol = 1e-5 * abs_scale[i] + 1e-30;
            assert!(
                (g as f64 - w).abs() <= tol,
                "row {i}: got {g}, want {w}, tol {tol}"
            );
        }
    }

    #[test]
    fn bf16_matches_f64_on_odd_sizes() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        for &(rows, cols, n) in &[
            (1, 1, 1),
            (7, 13, 3),
            (33, 65, 5),
            (300, 517, 9),
            (1024, 96, 4),
        ] {
            let w = rand_bf16(&mut rng, rows, cols);
            let xs: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
            let mut ys = vec![0f32; n * rows];
            matmul_bf16(&w, &xs, n, &mut ys);
            for b in 0..n {
                let x = &xs[b * cols..(b + 1) * cols];
                let mut want = vec![0f64; rows];
                let mut mag = vec![0f64; rows];
                for r in 0..rows {
                    for (wv, &xv) in w.row(r).iter().zip(x) {
                        let p = wv.to_f64() * xv as f64;
                        want[r] += p;
                        mag[r] += p.abs();
                    }
                }
                let mut y = vec![0f32; rows];
                matvec_bf16(&w, x, &mut y);
                check(&y, &want, &mag);
                assert_eq!(
                    &ys[b * rows..(b + 1) * rows],
                    &y[..],
                    "batched row {b} differs"
                );
            }
        }
    }

    #[test]
    fn mxfp4_matches_dequantized_f64() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for &(rows, cols, n) in &[(1, 32, 1), (5, 64, 2), (37, 96, 6), (513, 256, 5)] {
            let w = rand_mxfp4(&mut rng, rows, cols);
            let xs: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
            let mut ys = vec![0f32; n * rows];
            matmul_mxfp4(&w, &xs, n, &mut ys);
            let mut deq = vec![0f32; cols];
            for b in 0..n {
                let x = &xs[b * cols..(b + 1) * cols];
                let mut want = vec![0f64; rows];
                let mut mag = vec![0f64; rows];
                for r in 0..rows {
                    w.dequantize_row(r, &mut deq);
                    for c in 0..cols {
                        let p = deq[c] as f64 * x[c] as f64;
                        want[r] += p;
                        mag[r] += p.abs();
                    }
                }
                let mut y = vec![0f32; rows];
                matvec_mxfp4(&w, x, &mut y);
                check(&y, &want, &mag);
                assert_eq!(
                    &ys[b * rows..(b + 1) * rows],
                    &y[..],
                    "batched row {b} differs"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "input length")]
    fn shape_mismatch_panics() {
        let w = Bf16Matrix::from_values(2, 3, &[bf16::ZERO; 6]).unwrap();
        let mut y = [0f32; 2];
        matvec_bf16(&w, &[0.0; 4], &mut y);
    }
}
