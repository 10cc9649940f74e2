//! Advisory exclusive locks on a lock file (`flock(2)`), for converters that must not run
//! twice on the same output: the kernel releases the lock when the holder drops it, exits or
//! is killed, so a crashed run never leaves a stale lock behind.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// A held lock; dropping it releases the lock.
#[derive(Debug)]
pub struct FileLock {
    _file: File,
}

/// Take the exclusive lock on `path` (created if absent) without waiting: `Ok(None)` when
/// another process holds it.
pub fn try_lock(path: &Path) -> std::io::Result<Option<FileLock>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    // SAFETY: flock(2) on a descriptor owned by `file`, which lives as long as the lock.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(Some(FileLock { _file: file }));
    }
    let e = std::io::Error::last_os_error();
    if e.kind() == std::io::ErrorKind::WouldBlock {
        Ok(None)
    } else {
        Err(e)
    }
}

/// Why [`lock_in`] took no lock.
#[derive(Debug)]
pub enum Refused {
    /// Another process holds the lock file at this path.
    Held(PathBuf),
    /// The lock file at this path could not be opened or locked.
    Io(PathBuf, std::io::Error),
}

/// Take the exclusive lock on the lock file `name` in `dir` (created if absent) without
/// waiting.
pub fn lock_in(dir: &Path, name: &str) -> Result<FileLock, Refused> {
    let path = dir.join(name);
    match try_lock(&path) {
        Ok(Some(l)) => Ok(l),
        Ok(None) => Err(Refused::Held(path)),
        Err(e) => Err(Refused::Io(path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_until_the_first_drops() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(".lock");
        let first = try_lock(&p).unwrap();
        assert!(first.is_some());
        // flock locks belong to the open file description: a second open is refused.
        assert!(try_lock(&p).unwrap().is_none());
        drop(first);
        assert!(try_lock(&p).unwrap().is_some());
    }
}
