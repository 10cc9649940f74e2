//! The disk read probe.

use super::report::{Report, Status};
use serde_json::json;
use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

/// Bytes read (and, without a model root, written first) by the disk probe.
pub const DISK_PROBE_BYTES: u64 = 256 << 20;
/// Drop `file`'s pages from the page cache where the OS allows it; true when it did.
pub(super) fn drop_from_cache(file: &File) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; POSIX_FADV_DONTNEED only affects caching.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = file;
        false
    }
}

/// Read up to `limit` bytes of `path` after dropping it from the cache: (bytes, seconds,
/// dropped).
pub(super) fn timed_read(path: &Path, limit: u64) -> std::io::Result<(u64, f64, bool)> {
    let mut f = File::open(path)?;
    let dropped = drop_from_cache(&f);
    let mut buf = vec![0u8; 8 << 20];
    let mut total = 0u64;
    let t = Instant::now();
    while total < limit {
        let want = buf.len().min((limit - total) as usize);
        let n = f.read(&mut buf[..want])?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    Ok((total, t.elapsed().as_secs_f64(), dropped))
}

pub(super) fn disk_probe(r: &mut Report, model_file: Option<&Path>) {
    let result: std::io::Result<(String, u64, f64, bool)> = (|| match model_file {
        Some(p) => {
            let (n, s, d) = timed_read(p, DISK_PROBE_BYTES)?;
            Ok((p.display().to_string(), n, s, d))
        }
        None => {
            let mut tmp = tempfile::Builder::new()
                .prefix(".deltafin-doctor-probe-")
                .tempfile()?;
            let block: Vec<u8> = (0..(8usize << 20))
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect();
            let mut written = 0u64;
            while written < DISK_PROBE_BYTES {
                tmp.as_file_mut().write_all(&block)?;
                written += block.len() as u64;
            }
            tmp.as_file().sync_data()?;
            let path = tmp.path().to_path_buf();
            let (n, s, d) = timed_read(&path, DISK_PROBE_BYTES)?;
            Ok((
                format!("a temporary file in {}", std::env::temp_dir().display()),
                n,
                s,
                d,
            ))
        }
    })();
    match result {
        Ok((what, n, secs, dropped)) if n > 0 => {
            let gbps = n as f64 / secs.max(1e-9) / 1e9;
            r.facts.insert("disk_read_gb_per_s".into(), json!(gbps));
            r.facts.insert("disk_probe_bytes".into(), json!(n));
            r.facts
                .insert("disk_probe_cache_dropped".into(), json!(dropped));
            r.add(
                "disk read",
                Status::Info,
                format!(
                    "{gbps:.2} GB/s over {} MiB of {what} ({})",
                    n >> 20,
                    if dropped {
                        "page cache dropped first"
                    } else {
                        "page cache could not be dropped: the figure may be a cached read"
                    }
                ),
            );
        }
        Ok((what, _, _, _)) => r.add(
            "disk read",
            Status::Warn,
            format!("nothing to read in {what}"),
        ),
        Err(e) => r.add(
            "disk read",
            Status::Warn,
            format!("the read probe failed: {e}"),
        ),
    }
}
