//! Free disk space (statvfs) for the full-versus-stream choice and the disk check before
//! `setup` writes anything.

use crate::error::FetchError;
use std::path::Path;

/// For tests only: a number of bytes [`free_bytes`] reports instead of asking the file
/// system, so that the refusal of a setup that does not fit is tested without a full disk.
pub const TEST_FREE_ENV: &str = "DELTAFIN_TEST_FREE_DISK_BYTES";

/// Bytes available to an unprivileged user on the file system holding `path` (or its
/// nearest existing ancestor, for a model root not created yet); [`TEST_FREE_ENV`], when
/// set, replaces the measurement (an integer of bytes, else an error naming it).
pub fn free_bytes(path: &Path) -> Result<u64, FetchError> {
    if let Some(v) = std::env::var_os(TEST_FREE_ENV) {
        return v.to_str().and_then(|t| t.parse::<u64>().ok()).ok_or_else(|| {
            FetchError::Invalid(format!(
                "environment variable {TEST_FREE_ENV} (tests only): {v:?} is not a number of bytes"
            ))
        });
    }
    let mut p = path.to_path_buf();
    if p.as_os_str().is_empty() {
        p = ".".into();
    }
    while !p.exists() {
        match p.parent() {
            Some(q) if !q.as_os_str().is_empty() => p = q.to_path_buf(),
            _ => {
                p = ".".into();
                break;
            }
        }
    }
    let st = nix::sys::statvfs::statvfs(&p).map_err(|e| FetchError::Io {
        path: p.clone(),
        source: std::io::Error::from(e),
    })?;
    Ok((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}
