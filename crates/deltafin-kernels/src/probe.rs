//! Memory read bandwidth probe: a streaming read-sum over a buffer, split over the same rayon
//! pool and in the same way (about four contiguous ranges per worker) as the kernels.
//!
//! Used by the kernel benches to express kernel throughput as a fraction of what the memory
//! system delivers to a plain streaming read.

use rayon::prelude::*;

/// Wrapping sum of `data`, read once front to back per range with eight independent
/// accumulators; the result only keeps the reads from being optimised away.
pub fn parallel_read_sum(data: &[u64]) -> u64 {
    let threads = rayon::current_num_threads().max(1);
    let chunk = data.len().div_ceil(threads * 4).max(1 << 12);
    data.par_chunks(chunk)
        .map(read_sum)
        .reduce(|| 0, u64::wrapping_add)
}

/// Single-threaded wrapping sum with eight accumulators (vectorises to full-width loads).
fn read_sum(data: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = data.chunks_exact(8);
    for c in &mut it {
        // The same software prefetch as the kernels (see `tile::PREFETCH_BYTES`), so the
        // probe measures what a prefetching stream gets, not one core's demand-miss limit.
        #[cfg(target_arch = "x86_64")]
        crate::tile::prefetch(c.as_ptr() as *const u8);
        for k in 0..8 {
            acc[k] = acc[k].wrapping_add(c[k]);
        }
    }
    let tail = it.remainder().iter().fold(0u64, |a, &v| a.wrapping_add(v));
    acc.iter().fold(tail, |a, &v| a.wrapping_add(v))
}

#[cfg(test)]
mod tests {
    #[test]
    fn sums_everything() {
        let v: Vec<u64> = (0..100_003u64).collect();
        assert_eq!(super::parallel_read_sum(&v), 100_003 * 100_002 / 2);
        assert_eq!(super::parallel_read_sum(&[]), 0);
    }
}
