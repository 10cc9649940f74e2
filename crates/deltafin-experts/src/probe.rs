//! Read-bandwidth probe: the same read path as expert streaming ([`SourceFile`], aligned
//! buffers, a pool of threads), on big sequential chunks and on expert-sized reads at random
//! aligned offsets. Expert read throughput is reported against the random figure.

use crate::buffer::ExpertBuffer;
use crate::io::{DirectIo, IoPath, SourceFile};
use crate::layout::{ALIGN, Region};
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// What to measure.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeOptions {
    /// Bytes to read sequentially from the start of the file (capped at its size).
    pub sequential_bytes: u64,
    /// Chunk size of the sequential pass.
    pub sequential_chunk: u64,
    /// Size of each random read (an expert's size).
    pub random_size: u64,
    /// Number of random reads.
    pub random_count: u64,
    /// Reader threads (as the expert pool).
    pub threads: usize,
    /// O_DIRECT policy.
    pub direct_io: DirectIo,
    /// Seed of the random offsets.
    pub seed: u64,
}

/// Measured throughputs (GB/s = 10^9 bytes per second).
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeResult {
    pub sequential_bytes: u64,
    pub sequential_gbps: f64,
    pub random_bytes: u64,
    pub random_gbps: f64,
    /// `direct` or `buffered (why)`.
    pub io_path: String,
}

fn run_reads(
    file: &Arc<SourceFile>,
    offsets: Arc<Vec<u64>>,
    size: u64,
    threads: usize,
) -> io::Result<(u64, f64)> {
    let next = Arc::new(AtomicU64::new(0));
    let total = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let (file, offsets, next, total) =
                (file.clone(), offsets.clone(), next.clone(), total.clone());
            std::thread::spawn(move || -> io::Result<()> {
                let mut buf = ExpertBuffer::new(size);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some(&off) = offsets.get(i) else {
                        return Ok(());
                    };
                    let region = Region {
                        file_offset: off,
                        len: buf.len() as u64,
                        buf_offset: 0,
                        need_to: size,
                    };
                    let (_, n) = file.read_region(&region, buf.as_mut_bytes())?;
                    total.fetch_add(n, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for h in handles {
        h.join()
            .map_err(|_| io::Error::other("a probe thread panicked"))??;
    }
    Ok((
        total.load(Ordering::Relaxed),
        t0.elapsed().as_secs_f64().max(1e-9),
    ))
}

/// Probe `path` (a large file: a shard or an expert file).
pub fn probe(path: &Path, opts: &ProbeOptions) -> io::Result<ProbeResult> {
    let len = std::fs::metadata(path)?.len();
    let file = Arc::new(SourceFile::open(path, opts.direct_io)?);
    let chunk = opts.sequential_chunk.max(ALIGN) / ALIGN * ALIGN;
    let seq_total = opts.sequential_bytes.min(len) / chunk * chunk;
    let seq: Vec<u64> = (0..seq_total / chunk).map(|i| i * chunk).collect();
    let (seq_bytes, seq_s) = run_reads(&file, Arc::new(seq), chunk, opts.threads)?;
    let size = opts.random_size.max(1);
    let span = len.saturating_sub(size) / ALIGN;
    let mut x = opts.seed | 1;
    let rand: Vec<u64> = (0..opts.random_count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if span == 0 { 0 } else { (x % span) * ALIGN }
        })
        .collect();
    let (rand_bytes, rand_s) = run_reads(&file, Arc::new(rand), size, opts.threads)?;
    let io_path = match file.io_path() {
        (IoPath::Direct, _) => "direct".to_string(),
        (IoPath::Buffered, why) => format!("buffered ({})", why.unwrap_or_default()),
    };
    Ok(ProbeResult {
        sequential_bytes: seq_bytes,
        sequential_gbps: seq_bytes as f64 / seq_s / 1e9,
        random_bytes: rand_bytes,
        random_gbps: rand_bytes as f64 / rand_s / 1e9,
        io_path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_reads_what_it_says() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.bin");
        std::fs::write(&p, vec![3u8; 3 << 20]).unwrap();
        let r = probe(
            &p,
            &ProbeOptions {
                sequential_bytes: 2 << 20,
                sequential_chunk: 1 << 20,
                random_size: 100_000,
                random_count: 8,
                threads: 2,
                direct_io: DirectIo::Auto,
                seed: 1,
            },
        )
        .unwrap();
        assert_eq!(r.sequential_bytes, 2 << 20);
        assert!(r.random_bytes >= 8 * 100_000);
        assert!(r.sequential_gbps > 0.0 && r.random_gbps > 0.0);
    }
}
