//! Free disk space (statvfs) for the full-versus-stream choice.

use crate::error::FetchError;
use std::path::Path;

/// Bytes available to an unprivileged user on the file system holding `path` (or its
/// nearest existing ancestor, for a model root not created yet).
pub fn free_bytes(path: &Path) -> Result<u64, FetchError> {
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
