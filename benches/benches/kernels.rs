//! Kernel throughput in GB/s of weight bytes, against a streaming memory read probe.
//!
//! For each weight format (f32, bf16, row-int8, MXFP4) one matrix of about 1 GiB (≫ the
//! last-level cache, 7168 input columns like K3's hidden size) is built; criterion measures
//! the product for 1, 4 and 16 activation rows with `Throughput::Bytes(weight bytes)`, and
//! the "probe" group measures a parallel streaming read-sum over a 1 GiB buffer on the same
//! rayon pool. A summary table (median of repeated runs) prints every decode matvec as a
//! ratio to the probe.
//!
//! Run with `nice cargo bench -p deltafin-benches --bench kernels` (`DELTAFIN_BENCH_DTYPES=bf16,mxfp4`
//! limits the formats). Without `--bench`
//! (`cargo test --benches`) the matrices are small and only a smoke run happens.

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput};
use deltafin_benches::{Rng, build, install_kernel_settings_from_env};
use deltafin_kernels::probe::parallel_read_sum;
use deltafin_kernels::{Backend, backend};
use deltafin_kernels::{kernel_summary, matmul_with};

/// Input width of every bench matrix (K3 hidden size).
const COLS: usize = 7168;

/// Median seconds of `reps` runs of `f` (after one warm-up run).
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
    if let Err(e) = install_kernel_settings_from_env() {
        eprintln!("{e}");
        std::process::exit(2);
    }
    let full = std::env::args().any(|a| a == "--bench");
    let target = if full { 1 << 30 } else { 1 << 20 };
    let reps = if full { 15 } else { 1 };
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(4))
        .configure_from_args();
    let be = backend();
    println!("{}", kernel_summary());

    let probe_buf = vec![1u64; target / 8];
    let probe_bytes = (probe_buf.len() * 8) as u64;
    {
        let mut g = c.benchmark_group("probe");
        g.throughput(Throughput::Bytes(probe_bytes));
        g.bench_function("read_sum", |b| {
            b.iter(|| black_box(parallel_read_sum(black_box(&probe_buf))))
        });
        g.finish();
    }
    let probe_gbs = |buf: &[u64]| {
        probe_bytes as f64
            / median_secs(reps, || {
                black_box(parallel_read_sum(black_box(buf)));
            })
            / 1e9
    };
    let probe_before = probe_gbs(&probe_buf);

    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut rows_out: Vec<(String, f64)> = Vec::new();
    // DELTAFIN_BENCH_DTYPES=bf16,mxfp4 limits the formats (default: all four).
    let only = std::env::var("DELTAFIN_BENCH_DTYPES").ok();
    for dtype in ["f32", "bf16", "row-int8", "mxfp4"] {
        if let Some(only) = &only
            && !only.split(',').any(|d| d.trim() == dtype)
        {
            continue;
        }
        let m = build(dtype, COLS, target, &mut rng);
        let w = m.weights();
        let wbytes = w.weight_bytes() as u64;
        let xs: Vec<f32> = (0..16 * COLS)
            .map(|i| ((i * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let mut ys = vec![0f32; 16 * w.rows()];
        let mut g = c.benchmark_group(format!("matvec/{dtype}"));
        g.throughput(Throughput::Bytes(wbytes));
        for n in [1usize, 4, 16] {
            g.bench_function(format!("{}/n{n}", be.name()), |b| {
                b.iter(|| {
                    matmul_with(
                        be,
                        w,
                        black_box(&xs[..n * COLS]),
                        n,
                        &mut ys[..n * w.rows()],
                    )
                })
            });
        }
        g.finish();
        for n in [1usize, 4, 16] {
            let secs = median_secs(if n == 1 { reps } else { reps.min(5) }, || {
                matmul_with(
                    be,
                    w,
                    black_box(&xs[..n * COLS]),
                    n,
                    &mut ys[..n * w.rows()],
                );
            });
            rows_out.push((format!("{dtype} n={n}"), wbytes as f64 / secs / 1e9));
        }
        if dtype == "bf16" && be != Backend::Scalar {
            let secs = median_secs(reps.min(3), || {
                matmul_with(
                    Backend::Scalar,
                    w,
                    black_box(&xs[..COLS]),
                    1,
                    &mut ys[..w.rows()],
                );
            });
            rows_out.push(("bf16 n=1 scalar".into(), wbytes as f64 / secs / 1e9));
        }
    }
    let probe_after = probe_gbs(&probe_buf);
    c.final_summary();

    let probe = probe_before.max(probe_after);
    println!(
        "\nkernel summary ({}; weights ~{} MiB each, {COLS} columns)",
        kernel_summary(),
        target >> 20
    );
    println!(
        "read probe: {probe_before:.2} GB/s before, {probe_after:.2} GB/s after; ratios use {probe:.2}"
    );
    println!("{:<20} {:>10} {:>12}", "product", "GB/s", "x probe");
    for (name, gbs) in &rows_out {
        println!("{name:<20} {gbs:>10.2} {:>12.3}", gbs / probe);
    }
}
