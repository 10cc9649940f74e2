//! The system calls under [`super::copy_to_anonymous`]'s file reads: opening a file for
//! O_DIRECT, recognising a filesystem's refusal of it, reading a range exactly, and asking
//! which pages of a mapping are in the page cache.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Alignment of O_DIRECT reads: file offset, length and memory address (the common page
/// size; every logical block size in use divides it).
pub(super) const DIRECT_ALIGN: usize = 4096;

/// Open `path` read-only with O_DIRECT (Linux). Elsewhere, or where the filesystem refuses
/// it, the error is `EINVAL` (see [`is_refusal`]).
#[cfg(target_os = "linux")]
pub fn open_direct(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// Open `path` read-only with O_DIRECT (Linux). Elsewhere, or where the filesystem refuses
/// it, the error is `EINVAL` (see [`is_refusal`]).
#[cfg(not(target_os = "linux"))]
pub fn open_direct(_path: &Path) -> io::Result<File> {
    Err(io::Error::from_raw_os_error(libc::EINVAL))
}

/// Whether `e` is a filesystem refusing O_DIRECT (at open or at a read) rather than a
/// failure of the device or the file.
pub fn is_refusal(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Fill `buf` from `file` at `offset`, retrying short reads and interrupts. Returns the bytes
/// read, fewer than `buf.len()` only where the file ends.
pub(super) fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut pos = 0usize;
    while pos < buf.len() {
        match file.read_at(&mut buf[pos..], offset + pos as u64) {
            Ok(0) => break,
            Ok(n) => pos += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(pos)
}

/// The fraction of the pages of `range` of `map` that are resident in the page cache.
#[cfg(target_os = "linux")]
pub(super) fn cached_fraction(map: &memmap2::Mmap, range: Range<usize>) -> Option<f64> {
    const PAGE: usize = 4096;
    let end = range.end.min(map.len());
    let start = range.start / PAGE * PAGE;
    if end <= start {
        return Some(0.0);
    }
    let len = end - start;
    let pages = len.div_ceil(PAGE);
    let mut vec = vec![0u8; pages];
    // SAFETY: `start` is page aligned and `start..end` lies inside the mapping; `vec` has one
    // byte per page of that range, as mincore(2) writes.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr().add(start) as *mut libc::c_void,
            len,
            vec.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return None;
    }
    let resident = vec.iter().filter(|&&b| b & 1 == 1).count();
    Some(resident as f64 / pages as f64)
}

/// The fraction of the pages of `range` of `map` that are resident in the page cache
/// (unknown on this system).
#[cfg(not(target_os = "linux"))]
pub(super) fn cached_fraction(_map: &memmap2::Mmap, _range: Range<usize>) -> Option<f64> {
    None
}
