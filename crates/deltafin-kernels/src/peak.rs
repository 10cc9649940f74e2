//! Peak-arithmetic probe: how many f32 multiply-adds and int8 (or int16-pair) multiply-adds
//! per second this CPU retires when nothing waits on memory, with the instructions the spine
//! kernels use on each backend, so that a product's or a prefill's rate can be stated as a
//! fraction of the arithmetic limit (docs/PERFORMANCE.md, "Prefill").
//!
//! Each loop keeps its accumulators in registers (more independent chains than the FMA
//! latency × ports needs) and runs on every worker of the rayon pool at once; the result is
//! counted in multiply-adds (one FMA lane, one `vpmaddwd` int16 pair product, one `vpdpbusd`
//! byte product), so `2 ×` the figure is the usual "ops/s".

use rayon::prelude::*;
use std::time::Instant;

/// One measured peak.
#[derive(Clone, Debug, PartialEq)]
pub struct PeakRate {
    /// What ran, e.g. `f32 FMA, AVX2 (256-bit)`.
    pub name: &'static str,
    /// Multiply-adds per second of CPU time the process got (`/proc/self/stat`; wall time
    /// where that is unavailable): the figure that does not move with other processes'
    /// load, the one to compare a product's rate per CPU second with.
    pub per_cpu_second: f64,
    /// Multiply-adds per wall-clock second on one worker (the median worker).
    pub per_thread: f64,
    /// Multiply-adds per second of all workers together.
    pub all_threads: f64,
    /// Workers that ran it at once (the rayon pool's).
    pub threads: usize,
}

/// Every peak this CPU supports: f32 FMA and the int8 dot-product form of each x86 backend
/// available (AVX2: sign-extend to int16 + `vpmaddwd`, the row-int8 kernels' mix; AVX-512:
/// FMA on 512-bit registers and, with VNNI, `vpdpbusd`). Each runs for about `seconds`.
pub fn peak_rates(seconds: f64) -> Vec<PeakRate> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            out.push(measure("f32 FMA, AVX2 (256-bit)", seconds, || {
                // SAFETY: AVX2 and FMA checked above.
                unsafe { x86::fma256(ITERS) }
            }));
            out.push(measure(
                "int8, AVX2 vpmovsxbw + vpmaddwd (256-bit)",
                seconds,
                || {
                    // SAFETY: AVX2 checked above.
                    unsafe { x86::maddwd256(ITERS) }
                },
            ));
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            out.push(measure("f32 FMA, AVX-512 (512-bit)", seconds, || {
                // SAFETY: AVX-512 F checked above.
                unsafe { x86::fma512(ITERS) }
            }));
            if std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("avx512bw")
            {
                out.push(measure(
                    "int8, AVX-512 VNNI vpdpbusd (512-bit)",
                    seconds,
                    || {
                        // SAFETY: AVX-512 F, BW and VNNI checked above.
                        unsafe { x86::dpbusd512(ITERS) }
                    },
                ));
            }
        }
    }
    if out.is_empty() {
        out.push(measure("f32 multiply-add, portable", seconds, || {
            portable_fma(ITERS)
        }));
    }
    out
}

/// Loop iterations per timed call.
const ITERS: u64 = 1 << 20;

/// Runs `f` (which returns the multiply-adds it did) on every worker at once, repeatedly for
/// about `seconds`, and returns the rates.
fn measure(name: &'static str, seconds: f64, f: impl Fn() -> u64 + Sync) -> PeakRate {
    let threads = rayon::current_num_threads().max(1);
    // Warm up (clock ramp, pages of the code).
    let _ = f();
    let cpu0 = process_cpu_seconds();
    let wall0 = Instant::now();
    let counts: Vec<(u64, f64)> = (0..threads)
        .into_par_iter()
        .map(|_| {
            let t0 = Instant::now();
            let mut ops = 0u64;
            while t0.elapsed().as_secs_f64() < seconds {
                ops += f();
            }
            (ops, t0.elapsed().as_secs_f64())
        })
        .collect();
    let total: u64 = counts.iter().map(|c| c.0).sum();
    let cpu = match (cpu0, process_cpu_seconds()) {
        (Some(a), Some(b)) if b > a => b - a,
        _ => wall0.elapsed().as_secs_f64() * threads as f64,
    };
    let rates: Vec<f64> = counts.iter().map(|&(o, t)| o as f64 / t).collect();
    let mut sorted = rates.clone();
    sorted.sort_by(f64::total_cmp);
    PeakRate {
        name,
        per_cpu_second: total as f64 / cpu,
        per_thread: sorted[sorted.len() / 2],
        all_threads: rates.iter().sum(),
        threads,
    }
}

/// CPU seconds (user + system) this process has run, from `/proc/self/stat` (clock ticks of
/// 1/100 s); `None` off Linux or when the file cannot be read.
pub fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// Eight independent scalar multiply-add chains (the compiler may vectorise them).
fn portable_fma(iters: u64) -> u64 {
    let mut acc = [1.0f32; 8];
    let m = std::hint::black_box(0.999_999f32);
    let a = std::hint::black_box(1e-7f32);
    for _ in 0..iters {
        for v in &mut acc {
            *v = v.mul_add(m, a);
        }
    }
    std::hint::black_box(acc);
    iters * 8
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Independent accumulator chains: ≥ latency (4–5 cycles) × 2 ports.
    const CHAINS: usize = 12;

    /// `CHAINS` FMA chains of 8 lanes; returns the lane multiply-adds done.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma256(iters: u64) -> u64 {
        let m = _mm256_set1_ps(std::hint::black_box(0.999_999));
        let a = _mm256_set1_ps(std::hint::black_box(1e-7));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm256_fmadd_ps(*v, m, a);
            }
        }
        std::hint::black_box(acc);
        iters * (CHAINS * 8) as u64
    }

    /// The row-int8 AVX2 kernel's inner step without its loads: per 16 weight bytes one
    /// `vpmovsxbw`, then `vpmaddwd` against int16 activation codes and `vpaddd` into an int32
    /// accumulator, over independent chains; returns the int16-pair products done (16 per
    /// `vpmaddwd`).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn maddwd256(iters: u64) -> u64 {
        let w = _mm_set1_epi8(std::hint::black_box(3));
        let x = _mm256_set1_epi16(std::hint::black_box(5));
        let mut acc = [_mm256_setzero_si256(); CHAINS];
        let mut wv = _mm256_cvtepi8_epi16(w);
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm256_add_epi32(*v, _mm256_madd_epi16(wv, x));
            }
            // One sign extension per four products, as the kernel's 16-column steps against
            // several activation rows do (the kernel widens a weight vector once per step).
            wv = _mm256_cvtepi8_epi16(_mm_xor_si128(w, _mm256_castsi256_si128(acc[0])));
        }
        std::hint::black_box(acc);
        iters * (CHAINS * 16) as u64
    }

    /// `CHAINS` FMA chains of 16 lanes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma512(iters: u64) -> u64 {
        let m = _mm512_set1_ps(std::hint::black_box(0.999_999));
        let a = _mm512_set1_ps(std::hint::black_box(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm512_fmadd_ps(*v, m, a);
            }
        }
        std::hint::black_box(acc);
        iters * (CHAINS * 16) as u64
    }

    /// `CHAINS` `vpdpbusd` chains (64 byte products each).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn dpbusd512(iters: u64) -> u64 {
        let u = _mm512_set1_epi8(std::hint::black_box(7));
        let s = _mm512_set1_epi8(std::hint::black_box(-3));
        let mut acc = [_mm512_setzero_si512(); CHAINS];
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm512_dpbusd_epi32(*v, u, s);
            }
        }
        std::hint::black_box(acc);
        iters * (CHAINS * 64) as u64
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_rate_is_positive_and_named() {
        let rates = super::peak_rates(0.01);
        assert!(!rates.is_empty());
        for r in rates {
            assert!(r.per_thread > 0.0 && r.all_threads >= r.per_thread, "{r:?}");
            assert!(r.per_cpu_second > 0.0, "{r:?}");
            assert!(!r.name.is_empty());
        }
    }
}
