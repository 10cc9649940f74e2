//! One kernel product at one size, for questions the criterion sweep does not answer: is a
//! kernel compute-bound (matrix in cache) or memory-bound (matrix ≫ last-level cache), and
//! how does it scale with threads?
//!
//! ```sh
//! cargo build --release -p deltafin-benches --bin kernel-point
//! RAYON_NUM_THREADS=1 target/release/kernel-point row-int8 --cols 7168 --bytes 1M --n 1   # in L2
//! target/release/kernel-point mxfp4 --cols 1024 --bytes 512M                            # DRAM
//! target/release/kernel-point probe --bytes 1G                                           # read probe
//! target/release/kernel-point bf16 --cols 1024 --bytes 4M --count 256   # model-sized, from DRAM
//! target/release/kernel-point mxfp4 --n 4 --probe          # and its ratio to the read probe
//! ```
//!
//! `--gap-us U` busy-waits U µs on the calling thread after each product (serial work between
//! a model's products: the other workers wait, DRAM idles); GB/s then count the products' own
//! time only, so a drop shows what a cold start after a gap costs.
//!
//! `--count K` builds K matrices of `--bytes` each and multiplies them in turn, like a model's
//! layers: small products whose weights still come from DRAM (K × bytes ≫ the last-level
//! cache), paying each product's start-up (fork/join, activation layout, prefetch ramp).
//!
//! Prints the best of five timed rounds (each `--iters` products; default chosen so a round
//! reads about 2 GB) as GB/s of weight bytes. With `--probe`, also as a ratio to the parallel
//! read probe over a buffer of the same bytes in the same process, measured before and after
//! the product (the larger is used).

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use deltafin_benches::{Rng, build, install_kernel_settings_from_env};
use deltafin_kernels::backend;
use deltafin_kernels::probe::parallel_read_sum;
use deltafin_kernels::{kernel_summary, matmul_with};

struct Args {
    what: String,
    cols: usize,
    bytes: usize,
    n: usize,
    count: usize,
    iters: Option<usize>,
    probe: bool,
    gap_us: usize,
}

const USAGE: &str = "usage: kernel-point <f32|bf16|row-int8|mxfp4|probe> [--cols N] [--bytes SIZE] [--n ROWS] [--count K] [--iters K] [--gap-us U] [--probe]\n  SIZE accepts K, M, G suffixes (binary); defaults: --cols 7168 --bytes 512M --n 1";

fn size(s: &str) -> Result<usize, String> {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|v| v.checked_mul(mul))
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("not a positive size: {s:?}"))
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let what = it.next().ok_or_else(|| USAGE.to_string())?;
    if !["f32", "bf16", "row-int8", "mxfp4", "probe"].contains(&what.as_str()) {
        return Err(format!("unknown format {what:?}\n{USAGE}"));
    }
    let mut a = Args {
        what,
        cols: 7168,
        bytes: 512 << 20,
        n: 1,
        count: 1,
        iters: None,
        probe: false,
        gap_us: 0,
    };
    while let Some(flag) = it.next() {
        if flag == "--probe" {
            a.probe = true;
            continue;
        }
        let v = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let num = || {
            v.parse::<usize>()
                .ok()
                .filter(|&x| x > 0)
                .ok_or_else(|| format!("{flag}: not a positive integer: {v:?}"))
        };
        match flag.as_str() {
            "--cols" => a.cols = num()?,
            "--bytes" => a.bytes = size(&v)?,
            "--n" => a.n = num()?,
            "--count" => a.count = num()?,
            "--iters" => a.iters = Some(num()?),
            "--gap-us" => {
                a.gap_us = v
                    .parse::<usize>()
                    .map_err(|_| format!("{flag}: not an integer: {v:?}"))?
            }
            _ => return Err(format!("unknown option {flag:?}\n{USAGE}")),
        }
    }
    if a.what == "mxfp4" && !a.cols.is_multiple_of(32) {
        return Err(format!(
            "mxfp4 needs --cols a multiple of 32, got {}",
            a.cols
        ));
    }
    Ok(a)
}

/// Best seconds per call over five rounds of `iters` calls (after one warm-up call).
fn best_secs(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..5)
        .map(|_| {
            let s = Instant::now();
            for _ in 0..iters {
                f();
            }
            s.elapsed().as_secs_f64() / iters as f64
        })
        .fold(f64::MAX, f64::min)
}

fn main() -> ExitCode {
    if let Err(e) = install_kernel_settings_from_env() {
        eprintln!("{e}");
        return ExitCode::from(2);
    }
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let threads = rayon::current_num_threads();
    let iters = a
        .iters
        .unwrap_or(((2usize << 30) / a.bytes).clamp(1, 100_000));
    // GB/s of the parallel read probe over `bytes`, best of five rounds of `iters` reads.
    let read_probe = |bytes: usize, iters: usize| {
        let buf = vec![1u64; bytes / 8];
        let secs = best_secs(iters, || {
            black_box(parallel_read_sum(black_box(&buf)));
        });
        bytes as f64 / secs / 1e9
    };
    if a.what == "probe" {
        // The same read over anonymous memory advised for transparent huge pages, the memory
        // the resident spine and experts are copied into (`deltafin_k3::weights::resident`).
        let huge = deltafin_tensor::storage::copy_to_anonymous(
            &[deltafin_tensor::Bytes::from_vec(vec![1u8; a.bytes / 8 * 8])],
            true,
            &|_, _| {},
        );
        let huge_gbps = match &huge {
            Ok(c) => {
                let words: &[u64] = bytemuck::cast_slice(c.views[0].as_slice());
                let secs = best_secs(iters, || {
                    black_box(parallel_read_sum(black_box(words)));
                });
                format!(
                    "{:.2} GB/s ({})",
                    words.len() as f64 * 8.0 / secs / 1e9,
                    if c.huge_advised {
                        "huge pages advised"
                    } else {
                        "huge-page advice refused"
                    }
                )
            }
            Err(e) => format!("not measured ({e})"),
        };
        println!(
            "probe bytes={} threads={threads}: {:.2} GB/s (heap, 4 KiB pages); anonymous mapping: {huge_gbps}",
            a.bytes,
            read_probe(a.bytes, iters)
        );
        return ExitCode::SUCCESS;
    }
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mats: Vec<_> = (0..a.count)
        .map(|_| build(&a.what, a.cols, a.bytes, &mut rng))
        .collect();
    let w0 = mats[0].weights();
    let xs: Vec<f32> = (0..a.n * a.cols)
        .map(|i| ((i * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let mut ys = vec![0f32; a.n * w0.rows()];
    let be = backend();
    let iters = a
        .iters
        .unwrap_or(((2usize << 30) / (a.bytes * a.count)).clamp(1, 100_000));
    let bytes = w0.weight_bytes() * a.count;
    let probe_iters = ((2usize << 30) / bytes).clamp(1, 100_000);
    let probe_before = a.probe.then(|| read_probe(bytes, probe_iters));
    // Issue the products from a pool worker with the other workers kept warm, as `deltafin
    // run` does (`DELTAFIN_POOL_SPIN`; a call from outside the pool would also pay a
    // cross-thread hand-off per product).
    let secs = deltafin_kernels::pool::run_warm(|| {
        best_secs(iters, || {
            for m in &mats {
                matmul_with(be, m.weights(), black_box(&xs), a.n, &mut ys);
                if a.gap_us > 0 {
                    // Serial work between products, as a model's norms and gates are: this
                    // thread computes, the other workers wait, DRAM idles.
                    let until = Instant::now() + std::time::Duration::from_micros(a.gap_us as u64);
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                }
            }
        })
    });
    // GB/s over the products' own time: the gaps are not product time.
    let secs = secs - (a.gap_us * a.count) as f64 * 1e-6;
    let gbps = bytes as f64 / secs / 1e9;
    let vs_probe = match probe_before {
        Some(before) => {
            let p = before.max(read_probe(bytes, probe_iters));
            format!(" = {:.3} x probe {p:.2} GB/s", gbps / p)
        }
        None => String::new(),
    };
    println!(
        "{} rows={} cols={} bytes={} count={} n={} threads={threads} ({}): {gbps:.2} GB/s{vs_probe}, {:.1} us/product",
        a.what,
        w0.rows(),
        a.cols,
        w0.weight_bytes(),
        a.count,
        a.n,
        kernel_summary(),
        secs * 1e6 / a.count as f64
    );
    ExitCode::SUCCESS
}
