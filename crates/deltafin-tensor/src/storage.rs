//! Reference-counted byte ranges over memory-mapped files or owned buffers, and the copy of
//! resident weights into anonymous memory ([`copy_to_anonymous`], in `storage/anon.rs`).

use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod anon;
mod direct;

pub use anon::{ANON_ALIGN, AnonCopies, CopyStats, copy_to_anonymous};
pub use direct::{is_refusal, open_direct};

/// Anything that owns a contiguous byte buffer and can be shared between threads.
pub trait ByteOwner: Send + Sync {
    fn bytes(&self) -> &[u8];

    /// A hint that `range` of [`ByteOwner::bytes`] will not be read through this owner for
    /// a while (its content has been copied elsewhere). A file mapping drops the range's
    /// whole pages from the process (they stay in the page cache and come back unchanged
    /// if read again); owners of heap memory ignore it.
    fn release(&self, _range: Range<usize>) {}

    /// The mapped file, when [`ByteOwner::bytes`] is a whole-file mapping made by
    /// [`map_file`]: byte `i` of the owner is byte `i` of that file, so a copy of a range can
    /// be read from the file with explicit reads instead of page faults.
    fn file_mapping(&self) -> Option<&FileMapping> {
        None
    }
}

impl ByteOwner for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl ByteOwner for memmap2::Mmap {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn release(&self, range: Range<usize>) {
        release_mapped(self, range);
    }
}

/// Drop the whole pages of `range` of a read-only file mapping from the process.
fn release_mapped(map: &memmap2::Mmap, range: Range<usize>) {
    #[cfg(unix)]
    {
        let Some((start, len)) = whole_pages(range, map.len()) else {
            return;
        };
        // SAFETY: `memmap2::Mmap::map` makes a shared, read-only file mapping. For such a
        // mapping MADV_DONTNEED only unmaps the pages from this process: a later read
        // faults them back in from the page cache or the file with the same content, so
        // every view into the mapping stays valid. The result is only a hint; failure
        // leaves the pages mapped.
        let _ =
            unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len) };
    }
    #[cfg(not(unix))]
    let _ = (map, range);
}

/// The whole pages inside `range` of a mapping of `total` bytes: `(offset, len)`, or `None`
/// when the range holds no whole page.
#[cfg(unix)]
fn whole_pages(range: Range<usize>, total: usize) -> Option<(usize, usize)> {
    const PAGE: usize = 4096;
    let start = range.start.div_ceil(PAGE) * PAGE;
    let end = (range.end.min(total) / PAGE) * PAGE;
    (end > start).then(|| (start, end - start))
}

/// A read-only mapping of a whole file that remembers which file it maps (its path and, on
/// Unix, its device and inode), so that [`copy_to_anonymous`] can read a copy with large
/// explicit reads, O_DIRECT where the filesystem allows it, instead of faulting the mapping
/// in page by page.
pub struct FileMapping {
    map: memmap2::Mmap,
    path: PathBuf,
    /// `(device, inode)` of the mapped file.
    #[cfg(unix)]
    id: (u64, u64),
}

impl FileMapping {
    /// The path the file was opened at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `file` is the file this maps (same device and inode): a file replaced at the
    /// same path since it was mapped is not.
    pub fn is_same_file(&self, file: &File) -> bool {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            file.metadata().is_ok_and(|m| (m.dev(), m.ino()) == self.id)
        }
        #[cfg(not(unix))]
        {
            let _ = file;
            false
        }
    }

    /// Advise the kernel that the mapping is read at random (`true`: a page fault reads only
    /// its page, no readahead around it) or back to normal (`false`). Only a hint.
    pub fn advise_random(&self, random: bool) {
        #[cfg(unix)]
        {
            let advice = if random {
                memmap2::Advice::Random
            } else {
                memmap2::Advice::Normal
            };
            let _ = self.map.advise(advice);
        }
        #[cfg(not(unix))]
        let _ = random;
    }

    /// The fraction of the pages of `range` that are in the page cache (Linux `mincore`);
    /// `None` where the system cannot tell.
    pub fn cached_fraction(&self, range: Range<usize>) -> Option<f64> {
        direct::cached_fraction(&self.map, range)
    }
}

impl ByteOwner for FileMapping {
    fn bytes(&self) -> &[u8] {
        &self.map
    }

    fn release(&self, range: Range<usize>) {
        release_mapped(&self.map, range);
    }

    fn file_mapping(&self) -> Option<&FileMapping> {
        Some(self)
    }
}

/// Map the whole of `file` (opened read-only from `path`) as a [`FileMapping`]; an empty file
/// is an empty buffer (a zero-length mapping does not exist).
///
/// The contract of every mapped weight file applies: the file must not be truncated or
/// rewritten while mapped.
pub fn map_file(file: &File, path: &Path) -> std::io::Result<Bytes> {
    let meta = file.metadata()?;
    if meta.len() == 0 {
        return Ok(Bytes::from_vec(Vec::new()));
    }
    // SAFETY: a read-only shared mapping; like every mmap-based loader we rely on the file
    // not being truncated or rewritten while mapped (the contract above).
    let map = unsafe { memmap2::Mmap::map(file) }?;
    #[cfg(unix)]
    let id = {
        use std::os::unix::fs::MetadataExt;
        (meta.dev(), meta.ino())
    };
    Ok(Bytes::from_owner(Arc::new(FileMapping {
        map,
        path: path.to_path_buf(),
        #[cfg(unix)]
        id,
    })))
}

/// A buffer backed by `u64` words so that it is 8-byte aligned.
struct AlignedBuf {
    words: Vec<u64>,
    len: usize,
}

impl ByteOwner for AlignedBuf {
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
}

/// A cheap-to-clone view of a byte range inside a shared owner (an mmap or a `Vec`).
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn ByteOwner>,
    start: usize,
    len: usize,
}

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bytes")
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}

impl Bytes {
    /// Wrap a whole owner.
    pub fn from_owner(owner: Arc<dyn ByteOwner>) -> Bytes {
        let len = owner.bytes().len();
        Bytes {
            owner,
            start: 0,
            len,
        }
    }

    /// Copy `data` into a fresh 8-byte-aligned buffer.
    pub fn copy_from_slice(data: &[u8]) -> Bytes {
        let mut words = vec![0u64; data.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..data.len()].copy_from_slice(data);
        Bytes::from_owner(Arc::new(AlignedBuf {
            words,
            len: data.len(),
        }))
    }

    /// Take ownership of a vector (copied once to guarantee alignment).
    pub fn from_vec(data: Vec<u8>) -> Bytes {
        Bytes::copy_from_slice(&data)
    }

    /// Little-endian bytes of a bf16 slice, aligned.
    pub fn from_bf16(data: &[half::bf16]) -> Bytes {
        Bytes::copy_from_slice(bytemuck::cast_slice(data))
    }

    /// Little-endian bytes of an f32 slice, aligned.
    pub fn from_f32(data: &[f32]) -> Bytes {
        Bytes::copy_from_slice(bytemuck::cast_slice(data))
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.owner.bytes()[self.start..self.start + self.len]
    }

    /// Tell the owner this view's bytes will not be read through it for a while
    /// ([`ByteOwner::release`]); the view stays valid.
    pub fn release(&self) {
        self.owner.release(self.start..self.start + self.len);
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The file mapping this view lies in and the view's byte offset in that file, when the
    /// owner is a [`FileMapping`].
    pub fn file_origin(&self) -> Option<(&FileMapping, u64)> {
        self.owner.file_mapping().map(|m| (m, self.start as u64))
    }

    /// A copy of the view's bytes: read from its file with explicit reads when it is a view of
    /// a [`FileMapping`] (no page fault, so no readahead of the megabytes around a small
    /// tensor), else copied from memory. A file replaced since it was mapped is copied from
    /// the mapping; a file that ends early is an error naming it.
    pub fn read_to_vec(&self) -> std::io::Result<Vec<u8>> {
        let Some((m, off)) = self.file_origin() else {
            return Ok(self.as_slice().to_vec());
        };
        let file = File::open(m.path())?;
        if !m.is_same_file(&file) {
            return Ok(self.as_slice().to_vec());
        }
        let mut out = vec![0u8; self.len];
        let got = direct::read_full_at(&file, &mut out, off)?;
        if got < self.len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: the file ends {got} bytes into a {}-byte read at offset {off}",
                    m.path().display(),
                    self.len
                ),
            ));
        }
        Ok(out)
    }

    /// Whether `self` and `other` are views of the same owner.
    pub fn same_owner(&self, other: &Bytes) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.owner), Arc::as_ptr(&other.owner))
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-range, relative to this view. `None` when out of bounds.
    pub fn slice(&self, range: Range<usize>) -> Option<Bytes> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        Some(Bytes {
            owner: self.owner.clone(),
            start: self.start + range.start,
            len: range.end - range.start,
        })
    }

    /// This view if its start address is a multiple of `align`, else an aligned copy.
    /// Memory maps are page aligned, so well-formed checkpoints are never copied.
    pub fn aligned(self, align: usize) -> Bytes {
        if (self.as_slice().as_ptr() as usize).is_multiple_of(align) {
            self
        } else {
            Bytes::copy_from_slice(self.as_slice())
        }
    }

    /// View as bf16 values. `None` if the range is misaligned or of odd length.
    pub fn as_bf16(&self) -> Option<&[half::bf16]> {
        bytemuck::try_cast_slice(self.as_slice()).ok()
    }

    /// View as f32 values. `None` if the range is misaligned or not a multiple of 4 bytes.
    pub fn as_f32(&self) -> Option<&[f32]> {
        bytemuck::try_cast_slice(self.as_slice()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::reversed_empty_ranges)] // the reversed range is the case under test
    fn slices_and_alignment() {
        let b = Bytes::from_vec((0u8..16).collect());
        let s = b.slice(1..5).unwrap();
        assert_eq!(s.as_slice(), &[1, 2, 3, 4]);
        assert!(s.as_bf16().is_none(), "odd start must not cast");
        let a = s.clone().aligned(2);
        assert_eq!(a.as_slice(), &[1, 2, 3, 4]);
        assert_eq!(a.as_bf16().unwrap().len(), 2);
        assert!(b.slice(10..17).is_none());
        assert!(b.slice(5..4).is_none());
    }

    #[test]
    fn typed_views() {
        let v = [1.0f32, -2.5, 3.25];
        let b = Bytes::from_f32(&v);
        assert_eq!(b.as_f32().unwrap(), &v);
        let h = [half::bf16::from_f32(1.5), half::bf16::from_f32(-0.75)];
        let b = Bytes::from_bf16(&h);
        assert_eq!(b.as_bf16().unwrap(), &h);
    }

    #[test]
    fn a_file_mapping_knows_its_file_and_reads_views_from_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.bin");
        let data: Vec<u8> = (0..3 * 4096 + 5).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let f = File::open(&path).unwrap();
        let all = map_file(&f, &path).unwrap();
        let v = all.slice(4000..9000).unwrap();
        let (m, off) = v.file_origin().unwrap();
        assert_eq!((m.path(), off), (path.as_path(), 4000));
        assert!(m.is_same_file(&f));
        assert!(v.same_owner(&all));
        assert_eq!(v.read_to_vec().unwrap(), &data[4000..9000]);
        let c = m.cached_fraction(0..data.len());
        assert!(c.is_none_or(|c| (0.0..=1.0).contains(&c)), "{c:?}");
        // Memory views have no file; an empty file maps to an empty buffer.
        let mem = Bytes::from_vec(vec![1, 2, 3]);
        assert!(mem.file_origin().is_none() && !mem.same_owner(&v));
        assert_eq!(mem.read_to_vec().unwrap(), vec![1, 2, 3]);
        let empty = dir.path().join("e.bin");
        std::fs::write(&empty, b"").unwrap();
        let e = map_file(&File::open(&empty).unwrap(), &empty).unwrap();
        assert!(e.is_empty() && e.file_origin().is_none());
        // A file that shrank since it was mapped is an error naming it.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(6000)
            .unwrap();
        let err = v.read_to_vec().unwrap_err().to_string();
        assert!(err.contains("m.bin") && err.contains("ends"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn a_released_file_range_reads_back_unchanged() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("deltafin-release-{}", std::process::id()));
        let data: Vec<u8> = (0..5 * 4096 + 17).map(|i| (i % 253) as u8).collect();
        let mut f = std::fs::File::create(&dir).unwrap();
        f.write_all(&data).unwrap();
        drop(f);
        let f = std::fs::File::open(&dir).unwrap();
        // SAFETY: a private test file nobody else writes.
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        let all = Bytes::from_owner(Arc::new(map));
        let copies =
            copy_to_anonymous(&[all.slice(100..3 * 4096 + 5).unwrap()], true, &|_, _| {}).unwrap();
        all.release();
        assert_eq!(all.as_slice(), &data[..]);
        assert_eq!(copies.views[0].as_slice(), &data[100..3 * 4096 + 5]);
        assert_eq!(
            whole_pages(100..3 * 4096 + 5, data.len()),
            Some((4096, 2 * 4096))
        );
        assert_eq!(whole_pages(1..4095, data.len()), None);
        assert_eq!(whole_pages(0..usize::MAX, 8192), Some((0, 8192)));
        let _ = std::fs::remove_file(&dir);
    }
}
