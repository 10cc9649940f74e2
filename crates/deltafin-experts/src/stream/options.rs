//! How a [`super::StreamingExperts`] reads and caches.

use super::gate::PilotGate;
use crate::io::DirectIo;

/// Tables with more files than this (one file per expert) keep only the most recently read
/// [`OPEN_FILE_CACHE`] files open instead of holding two descriptors per file.
pub const MAX_OPEN_FILES: usize = 256;

/// How many per-expert files stay open at once (two descriptors each) when a table has more
/// than [`MAX_OPEN_FILES`]: every piece of one expert and the experts read again soon reuse
/// one `open`, and the descriptors stay within the 256 that `serve` keeps out of its
/// connection cap (docs/SERVER.md "Limits").
pub const OPEN_FILE_CACHE: usize = 64;

/// Default upper bound of one sub-read of an expert (a multiple of [`ALIGN`]).
pub const READ_PIECE_BYTES: u64 = 512 << 10;

/// Reads in flight per drive by default (`K3_EXPERT_READ_THREADS=auto`): one blocking
/// `pread` per I/O thread, this many threads per reader queue (the model root and each expert
/// home). Chosen by measurement (docs/PERFORMANCE.md "Deep queues", `tools/bench/queue_depth.sh`):
/// on the reference host's drive, O_DIRECT reads of 128 KiB…1 MiB reach the drive's rate only
/// with about 8 in flight, and that many threads read as fast as io_uring at the same depth or
/// faster, so the reader stays with threads. The I/O threads sleep in the kernel while their
/// read is in flight, so the depth does not depend on the number of CPUs.
pub const DEFAULT_READ_DEPTH: usize = 8;

/// The most I/O threads (reads in flight) per drive.
pub const MAX_READ_DEPTH: usize = 16;

const _: () = assert!(DEFAULT_READ_DEPTH >= 1 && DEFAULT_READ_DEPTH <= MAX_READ_DEPTH);

/// How a [`StreamingExperts`] reads and caches.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamOptions {
    /// Bytes of expert buffers the cache may own.
    pub cache_bytes: u64,
    /// I/O worker threads per drive, each with one read in flight: the queue depth per drive
    /// (1…[`MAX_READ_DEPTH`]; default [`DEFAULT_READ_DEPTH`]).
    pub read_threads: usize,
    /// O_DIRECT policy.
    pub direct_io: DirectIo,
    /// Next-layer prefetch.
    pub pilot: PilotGate,
}

impl StreamOptions {
    /// `cache_bytes` with [`DEFAULT_READ_DEPTH`] reads in flight per drive, O_DIRECT when
    /// possible, ungoverned PILOT.
    pub fn with_cache_bytes(cache_bytes: u64) -> StreamOptions {
        StreamOptions {
            cache_bytes,
            read_threads: DEFAULT_READ_DEPTH,
            direct_io: DirectIo::Auto,
            pilot: PilotGate::Off,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_depth_is_the_measured_one_whatever_the_cpus() {
        let o = StreamOptions::with_cache_bytes(1 << 30);
        assert_eq!(o.read_threads, DEFAULT_READ_DEPTH);
    }
}
