//! `cargo xtask peak-probe`: the CPU's arithmetic limits (f32 FMA and the int8 dot-product
//! form of each backend, `deltafin_kernels::peak`) next to what the spine products reach on
//! in-cache weights with a prefill-sized batch, so prefill can be stated as a fraction of the
//! limit (docs/PERFORMANCE.md, "Prefill").

use anyhow::{Result, anyhow};
use deltafin_kernels::{Weights, matmul};
use deltafin_tensor::{Bf16Matrix, RowInt8Matrix, bf16};
use std::time::Instant;

/// `peak-probe` arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Activation rows per product (a prefill batch).
    #[arg(long, default_value_t = 64)]
    rows: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Multiply-adds per CPU second of the process (`peak::process_cpu_seconds`; the pool's spin
/// and idle waits count as CPU time, so this is a lower bound) of `matmul` on a `[r, c]`
/// matrix and `n` activation rows, the weights small enough to stay in the cores' L2 caches.
fn product_rate(w: Weights<'_>, c: usize, r: usize, n: usize, seconds: f64, threads: usize) -> f64 {
    let xs: Vec<f32> = (0..n * c)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect();
    let mut ys = vec![0f32; n * r];
    matmul(w, &xs, n, &mut ys);
    let cpu0 = deltafin_kernels::peak::process_cpu_seconds();
    let t0 = Instant::now();
    let mut calls = 0u64;
    while t0.elapsed().as_secs_f64() < seconds {
        matmul(w, &xs, n, &mut ys);
        calls += 1;
    }
    std::hint::black_box(&ys);
    let wall = t0.elapsed().as_secs_f64();
    let cpu = match (cpu0, deltafin_kernels::peak::process_cpu_seconds()) {
        (Some(a), Some(b)) if b > a => b - a,
        _ => wall * threads as f64,
    };
    (calls * (r * c * n) as u64) as f64 / cpu
}

pub fn run(args: &Args) -> Result<()> {
    crate::kernel_env::install()?;
    let peaks = deltafin_kernels::peak::peak_rates(args.seconds);
    let threads = peaks.first().map_or(1, |p| p.threads);
    // 256 × 1024: 512 KiB of bf16, 256 KiB of int8 (in L2 split over the workers).
    let (r, c) = (256usize, 1024usize);
    let vals: Vec<f32> = (0..r * c)
        .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 4096.0)
        .collect();
    let b16: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
    let wb = Bf16Matrix::from_values(r, c, &b16).map_err(|e| anyhow!("{e}"))?;
    let wi = RowInt8Matrix::quantize("probe", r, c, &vals).map_err(|e| anyhow!("{e}"))?;
    let bf16_rate = product_rate(Weights::Bf16(&wb), c, r, args.rows, args.seconds, threads);
    let int8_rate = product_rate(
        Weights::RowInt8(&wi),
        c,
        r,
        args.rows,
        args.seconds,
        threads,
    );
    let f32_peak = peaks
        .iter()
        .filter(|p| p.name.starts_with("f32"))
        .map(|p| p.per_cpu_second)
        .fold(0.0, f64::max);
    let int_peak = peaks
        .iter()
        .filter(|p| p.name.starts_with("int8"))
        .map(|p| p.per_cpu_second)
        .fold(0.0, f64::max);
    let frac = |v: f64, p: f64| if p > 0.0 { v / p } else { f64::NAN };
    if args.json {
        let peaks_json: Vec<serde_json::Value> = peaks
            .iter()
            .map(|p| serde_json::json!({"name": p.name, "gmac_per_cpu_s": p.per_cpu_second / 1e9, "gmac_per_s_thread": p.per_thread / 1e9, "gmac_per_s_all": p.all_threads / 1e9}))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "threads": threads,
                "backend": format!("{:?}", deltafin_kernels::backend()),
                "peaks": peaks_json,
                "products": {
                    "shape": [r, c], "rows": args.rows,
                    "bf16_gmac_per_cpu_s": bf16_rate / 1e9, "bf16_of_f32_peak": frac(bf16_rate, f32_peak),
                    "int8_gmac_per_cpu_s": int8_rate / 1e9, "int8_of_int_peak": frac(int8_rate, int_peak),
                }
            })
        );
        return Ok(());
    }
    println!(
        "peak arithmetic, {threads} workers, backend {:?} (multiply-adds; ×2 for ops; per CPU second the process got, and per wall second):",
        deltafin_kernels::backend()
    );
    for p in &peaks {
        println!(
            "  {:<44} {:>7.1} GMAC/CPU-s  {:>7.1} GMAC/s per worker  {:>7.1} GMAC/s all",
            p.name,
            p.per_cpu_second / 1e9,
            p.per_thread / 1e9,
            p.all_threads / 1e9
        );
    }
    println!(
        "spine products in cache, [{r} × {c}] weights × {} activation rows, per CPU second:",
        args.rows
    );
    println!(
        "  bf16     {:>8.1} GMAC/CPU-s = {:.3} × the f32 FMA peak",
        bf16_rate / 1e9,
        frac(bf16_rate, f32_peak)
    );
    println!(
        "  row-int8 {:>8.1} GMAC/CPU-s = {:.3} × the int8 peak, {:.3} × the f32 FMA peak",
        int8_rate / 1e9,
        frac(int8_rate, int_peak),
        frac(int8_rate, f32_peak)
    );
    Ok(())
}
