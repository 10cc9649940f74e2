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

/// How a [`StreamingExperts`] reads and caches.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamOptions {
    /// Bytes of expert buffers the cache may own.
    pub cache_bytes: u64,
    /// I/O worker threads (1–16).
    pub read_threads: usize,
    /// O_DIRECT policy.
    pub direct_io: DirectIo,
    /// Next-layer prefetch.
    pub pilot: PilotGate,
}

impl StreamOptions {
    /// `cache_bytes` with 4 threads (or fewer CPUs), O_DIRECT when possible, ungoverned PILOT.
    pub fn with_cache_bytes(cache_bytes: u64) -> StreamOptions {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        StreamOptions {
            cache_bytes,
            read_threads: cpus.clamp(1, 4),
            direct_io: DirectIo::Auto,
            pilot: PilotGate::Off,
        }
    }
}
