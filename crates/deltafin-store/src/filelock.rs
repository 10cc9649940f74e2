//! Advisory exclusive locks on a lock file (`flock(2)`), for converters that must not run
//! twice on the same output: the kernel releases the lock when the holder drops it, exits or
//! is killed, so a crashed run never leaves a stale lock behind.
//!
//! [`RangeLock`] locks one byte range of a lock file, or the whole file, with the same
//! release-on-exit rule (Linux open-file-description locks, `F_OFD_SETLK`): the installers
//! hold the whole file while many expert fetches, in one process or several, each hold the
//! byte of their own expert (docs/SETUP.md, "The install lock"). A whole-file lock and any
//! range lock exclude each other. Elsewhere than Linux every range is the whole file
//! (`flock`): correct, only coarser.

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

/// Which part of a lock file a [`RangeLock`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Span {
    /// The whole file (every present and future byte).
    Whole,
    /// One byte, at this offset.
    Byte(u64),
}

/// A held exclusive lock on a [`Span`] of a lock file; dropping it releases the lock.
#[derive(Debug)]
pub struct RangeLock {
    file: File,
}

impl RangeLock {
    /// The open lock file (a whole-file holder may write who it is into it).
    pub fn file(&self) -> &File {
        &self.file
    }
}

/// What holds the lock that refused a [`try_lock_span`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// A whole-file holder.
    Whole,
    /// A holder of one byte (or of some range that is not the whole file).
    Range,
}

/// Take the exclusive lock on `span` of the lock file at `path` (created if absent) without
/// waiting: `Ok(Err(holder))` when another open of the file holds a conflicting lock.
pub fn try_lock_span(path: &Path, span: Span) -> std::io::Result<Result<RangeLock, Holder>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)?;
    match sys::set(&file, span)? {
        None => Ok(Ok(RangeLock { file })),
        Some(h) => Ok(Err(h)),
    }
}

#[cfg(target_os = "linux")]
mod sys {
    use super::{Holder, Span};
    use std::fs::File;
    use std::os::fd::AsRawFd;

    fn request(span: Span) -> std::io::Result<libc::flock> {
        // SAFETY: `flock` is plain old data; all-zero is a valid value of it.
        let mut l: libc::flock = unsafe { std::mem::zeroed() };
        l.l_type = libc::F_WRLCK as libc::c_short;
        l.l_whence = libc::SEEK_SET as libc::c_short;
        let (start, len) = match span {
            Span::Whole => (0, 0),
            Span::Byte(at) => (at, 1),
        };
        l.l_start = libc::off_t::try_from(start).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("lock offset {start} is out of range"),
            )
        })?;
        l.l_len = len;
        Ok(l)
    }

    /// `None` when the lock was taken, else who holds a conflicting one.
    pub(super) fn set(file: &File, span: Span) -> std::io::Result<Option<Holder>> {
        let l = request(span)?;
        // SAFETY: fcntl(2) with an open descriptor owned by `file` and a valid `flock`.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &l) };
        if rc == 0 {
            return Ok(None);
        }
        let e = std::io::Error::last_os_error();
        if !matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
            return Err(e);
        }
        let mut probe = request(span)?;
        // SAFETY: as above; F_OFD_GETLK writes the first conflicting lock into `probe`.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut probe) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Some(
            if probe.l_type == libc::F_UNLCK as libc::c_short || probe.l_len != 0 {
                // Unlocked since (a race): report a range holder, the caller retries.
                Holder::Range
            } else {
                Holder::Whole
            },
        ))
    }
}

#[cfg(not(target_os = "linux"))]
mod sys {
    use super::{Holder, Span};
    use std::fs::File;
    use std::os::fd::AsRawFd;

    /// Without open-file-description range locks every span is the whole file, and a
    /// holder cannot be told apart: it is reported as a range holder (worth waiting for).
    pub(super) fn set(file: &File, _span: Span) -> std::io::Result<Option<Holder>> {
        // SAFETY: flock(2) on a descriptor owned by `file`, which lives as long as the lock.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(None);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock {
            Ok(Some(Holder::Range))
        } else {
            Err(e)
        }
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

    #[test]
    #[cfg(target_os = "linux")]
    fn byte_locks_exclude_each_other_only_on_the_same_byte_and_the_whole_file_excludes_all() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("install.lock");
        let a = try_lock_span(&p, Span::Byte(7)).unwrap().unwrap();
        // The same byte through another open (another thread or process): refused.
        assert_eq!(
            try_lock_span(&p, Span::Byte(7)).unwrap().unwrap_err(),
            Holder::Range
        );
        // Another byte: free.
        let b = try_lock_span(&p, Span::Byte(8)).unwrap().unwrap();
        drop(b);
        // The whole file while a byte is held: refused, naming a range holder.
        assert!(try_lock_span(&p, Span::Whole).unwrap().is_err());
        drop(a);
        let whole = try_lock_span(&p, Span::Whole).unwrap().unwrap();
        // Any byte while the whole file is held: refused, naming the whole-file holder.
        assert_eq!(
            try_lock_span(&p, Span::Byte(1_000_000))
                .unwrap()
                .unwrap_err(),
            Holder::Whole
        );
        drop(whole);
        assert!(try_lock_span(&p, Span::Byte(1_000_000)).unwrap().is_ok());
    }
}
