//! Quick MXFP4 decode-product speed check, without criterion: one ~512 MiB MXFP4 matrix
//! (7168 columns, K3's hidden size), the median of 15 matrix-vector products (n = 1) and of 5
//! four-row products, as GB/s of weight bytes and as a ratio to a parallel streaming read of a
//! buffer of the same size measured in the same process (before and after; the larger is used).
//!
//! ```text
//! for A in f32 q16x2 q16x2 f32; do DELTAFIN_MXFP4_ACT=$A nice cargo run --release \
//!     -p deltafin-kernels --example mxfp4_speed; done
//! ```

use std::hint::black_box;
use std::time::Instant;

use deltafin_kernels::{Weights, kernel_summary, matmul};
use deltafin_tensor::{Bytes, Mxfp4Matrix};
use rayon::prelude::*;

const COLS: usize = 7168;

fn median_secs(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[reps / 2]
}

fn main() {
    let bytes_per_row = COLS / 2 + COLS / 32;
    let rows = (512 << 20) / bytes_per_row;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let packed: Vec<u8> = (0..rows * COLS / 2).map(|_| next() as u8).collect();
    let scales: Vec<u8> = (0..rows * COLS / 32)
        .map(|_| 118 + (next() % 16) as u8)
        .collect();
    let m = Mxfp4Matrix::new(
        "bench",
        Bytes::from_vec(packed),
        Bytes::from_vec(scales),
        rows,
        COLS,
    )
    .expect("valid synthetic matrix");
    let w = Weights::Mxfp4(&m);
    let wbytes = w.weight_bytes() as f64;
    let xs: Vec<f32> = (0..4 * COLS)
        .map(|i| ((i * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let mut ys = vec![0f32; 4 * rows];
    let probe_buf = vec![1u64; w.weight_bytes() / 8];
    let probe = || {
        wbytes
            / median_secs(15, || {
                black_box(
                    probe_buf
                        .par_chunks(1 << 16)
                        .map(|c| c.iter().sum::<u64>())
                        .sum::<u64>(),
                );
            })
            / 1e9
    };
    let before = probe();
    let n1 =
        wbytes / median_secs(15, || matmul(w, black_box(&xs[..COLS]), 1, &mut ys[..rows])) / 1e9;
    let n4 = wbytes / median_secs(5, || matmul(w, black_box(&xs), 4, &mut ys)) / 1e9;
    let p = before.max(probe());
    println!("{}", kernel_summary());
    println!(
        "mxfp4 [{rows}x{COLS}] probe {p:.2} GB/s | n=1 {n1:.2} GB/s = {:.3} x probe | n=4 {n4:.2} GB/s = {:.3} x probe",
        n1 / p,
        n4 / p
    );
}
