//! Positional reads of expert regions: O_DIRECT on Linux where the filesystem accepts it,
//! buffered `pread` otherwise (with `F_NOCACHE` on macOS). Never an mmap.
//!
//! Some filesystems (tmpfs before Linux 6.6, some FUSE and network filesystems) refuse
//! O_DIRECT with `EINVAL`, either at `open` or at the first read; both are detected and the
//! file falls back to buffered reads for good, with the reason recorded.

use crate::layout::Region;
use deltafin_tensor::storage::{is_refusal, open_direct};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether to try O_DIRECT.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// O_DIRECT where the platform and filesystem allow it, else buffered.
    #[default]
    Auto,
    /// Buffered reads only (the page cache keeps what was read).
    Off,
}

/// How a read was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoPath {
    /// O_DIRECT: straight from the device into the buffer, bypassing the page cache.
    Direct,
    /// Buffered `pread` through the page cache.
    Buffered,
}

/// One file that experts are read from, opened once.
pub struct SourceFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    direct_ok: AtomicBool,
    refusal: Mutex<Option<String>>,
    /// Test hook: the next direct read fails with `EINVAL`.
    #[cfg(test)]
    pub(crate) fail_next_direct_read: AtomicBool,
}

#[cfg(target_os = "macos")]
fn set_nocache(f: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a valid, owned descriptor; F_NOCACHE only changes caching advice.
    unsafe {
        libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1);
    }
}

#[cfg(not(target_os = "macos"))]
fn set_nocache(_f: &File) {}

impl SourceFile {
    /// Open `path` for reading; with [`DirectIo::Auto`] also an O_DIRECT handle when the
    /// filesystem accepts one.
    pub fn open(path: &Path, mode: DirectIo) -> io::Result<SourceFile> {
        let buffered = File::open(path)?;
        set_nocache(&buffered);
        let (direct, refusal) = match mode {
            DirectIo::Off => (None, Some("buffered reads requested".to_string())),
            DirectIo::Auto => match open_direct(path) {
                Ok(f) => (Some(f), None),
                Err(e) if is_refusal(&e) => (
                    None,
                    Some(format!(
                        "O_DIRECT refused at open ({e}); buffered reads{}",
                        if cfg!(target_os = "macos") {
                            " with F_NOCACHE"
                        } else {
                            ""
                        }
                    )),
                ),
                Err(e) => return Err(e),
            },
        };
        Ok(SourceFile {
            path: path.to_path_buf(),
            direct_ok: AtomicBool::new(direct.is_some()),
            buffered,
            direct,
            refusal: Mutex::new(refusal),
            #[cfg(test)]
            fail_next_direct_read: AtomicBool::new(false),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path reads take now and, when buffered, why.
    pub fn io_path(&self) -> (IoPath, Option<String>) {
        let why = self.refusal.lock().map(|g| g.clone()).unwrap_or_default();
        if self.direct_ok.load(Ordering::Relaxed) {
            (IoPath::Direct, None)
        } else {
            (IoPath::Buffered, why)
        }
    }

    /// Read `region` into `buf` (the region's slice of an aligned buffer). Returns the path
    /// used and the bytes transferred.
    pub fn read_region(&self, region: &Region, buf: &mut [u8]) -> io::Result<(IoPath, u64)> {
        if self.direct_ok.load(Ordering::Relaxed)
            && let Some(d) = &self.direct
        {
            match self.read_direct(d, region, buf) {
                Ok(n) => return Ok((IoPath::Direct, n)),
                Err(e) if is_refusal(&e) => {
                    self.direct_ok.store(false, Ordering::Relaxed);
                    if let Ok(mut g) = self.refusal.lock() {
                        *g = Some(format!("O_DIRECT refused at read ({e}); buffered reads"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        let need = region.need_to as usize;
        self.buffered
            .read_exact_at(&mut buf[..need], region.file_offset)?;
        Ok((IoPath::Buffered, region.need_to))
    }

    fn read_direct(&self, f: &File, region: &Region, buf: &mut [u8]) -> io::Result<u64> {
        #[cfg(test)]
        if self.fail_next_direct_read.swap(false, Ordering::Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let len = region.len as usize;
        let mut pos = 0usize;
        while pos < len {
            match f.read_at(&mut buf[pos..len], region.file_offset + pos as u64) {
                Ok(0) => break,
                Ok(n) => pos += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if (pos as u64) < region.need_to {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the file ends {} bytes into a {}-byte range",
                    pos, region.need_to
                ),
            ));
        }
        Ok(pos as u64)
    }
}
