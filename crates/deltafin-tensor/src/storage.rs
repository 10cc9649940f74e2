//! Reference-counted byte ranges over memory-mapped files or owned buffers.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Anything that owns a contiguous byte buffer and can be shared between threads.
pub trait ByteOwner: Send + Sync {
    fn bytes(&self) -> &[u8];

    /// A hint that `range` of [`ByteOwner::bytes`] will not be read through this owner for
    /// a while (its content has been copied elsewhere). A file mapping drops the range's
    /// whole pages from the process (they stay in the page cache and come back unchanged
    /// if read again); owners of heap memory ignore it.
    fn release(&self, _range: Range<usize>) {}
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
        #[cfg(unix)]
        {
            let Some((start, len)) = whole_pages(range, self.len()) else {
                return;
            };
            // SAFETY: `memmap2::Mmap::map` makes a shared, read-only file mapping. For such a
            // mapping MADV_DONTNEED only unmaps the pages from this process: a later read
            // faults them back in from the page cache or the file with the same content, so
            // every view into the mapping stays valid. The result is only a hint; failure
            // leaves the pages mapped.
            let _ = unsafe {
                self.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
            };
        }
        #[cfg(not(unix))]
        let _ = range;
    }
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

/// Alignment of every view [`copy_to_anonymous`] returns: a cache line, which keeps 512-bit
/// loads of a row start aligned wherever the source had them so.
pub const ANON_ALIGN: usize = 64;

/// One anonymous mapping holding copies of resident weights ([`copy_to_anonymous`]).
struct AnonArena(memmap2::MmapMut);

impl ByteOwner for AnonArena {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Bytes copied between releases of the source ([`copy_parts`]).
const RELEASE_CHUNK: usize = 8 << 20;

/// Copy each part to its offset in `dst` and release its source, on up to four threads,
/// each taking a contiguous run of parts of about equal bytes: the first write to each new
/// page of an anonymous mapping is a page fault that zeroes the page, which is most of the
/// cost of a copy, and faults on different threads proceed in parallel.
fn copy_parts(
    dst: &mut [u8],
    parts: &[Bytes],
    offsets: &[usize],
    progress: &(dyn Fn(u64, u64) + Sync),
) {
    let to_copy: u64 = parts.iter().map(|p| p.len() as u64).sum();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4);
    let total = dst.len();
    // Split points: the first part whose offset reaches each k/threads of the bytes.
    let mut bounds = vec![0];
    for k in 1..threads {
        let goal = total / threads * k;
        let i = offsets.partition_point(|&o| o < goal);
        if i > *bounds.last().unwrap_or(&0) && i < parts.len() {
            bounds.push(i);
        }
    }
    bounds.push(parts.len());
    std::thread::scope(|scope| {
        let mut rest = dst;
        let mut consumed = 0;
        for w in bounds.windows(2) {
            let (first, end) = (w[0], w[1]);
            let stop = offsets.get(end).copied().unwrap_or(total);
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(stop - consumed);
            rest = tail;
            let base = consumed;
            consumed = stop;
            let run = move |mine: &mut [u8]| {
                for (p, &at) in parts[first..end].iter().zip(&offsets[first..end]) {
                    let dst = &mut mine[at - base..at - base + p.len()];
                    // Chunk by chunk, so a large part's source pages leave as they are copied.
                    for (k, d) in dst.chunks_mut(RELEASE_CHUNK).enumerate() {
                        let from = k * RELEASE_CHUNK;
                        d.copy_from_slice(&p.as_slice()[from..from + d.len()]);
                        if let Some(done) = p.slice(from..from + d.len()) {
                            done.release();
                        }
                        progress(d.len() as u64, to_copy);
                    }
                    p.release();
                }
            };
            if end == parts.len() {
                run(mine);
            } else {
                scope.spawn(move || run(mine));
            }
        }
    });
}

/// Copies made by [`copy_to_anonymous`].
#[derive(Debug)]
pub struct AnonCopies {
    /// One view per part, in order, each with the part's bytes.
    pub views: Vec<Bytes>,
    /// Size of the mapping (the parts, each padded to [`ANON_ALIGN`]).
    pub mapped: usize,
    /// Whether the kernel accepted the transparent-huge-page advice for the mapping.
    pub huge_advised: bool,
}

/// Copy `parts` back to back (each at a multiple of [`ANON_ALIGN`]) into one new anonymous
/// memory mapping and return views of the copies, in order; each source view is
/// [released](Bytes::release) after its copy, so a file mapping's pages leave the process as
/// the copy grows and peak memory stays near one copy of the weights.
///
/// With `huge_pages` the mapping is advised for transparent huge pages before it is first
/// written, where the system supports them (Linux; otherwise the advice is skipped and
/// `huge_advised` is false). Weights read once per token from 2 MiB pages need 512 times fewer
/// page-table walks than from the 4 KiB pages of a file mapping; in a virtual machine each
/// walk is a nested one.
///
/// `progress(bytes, total)` is called (from the copying threads) after each piece of at most
/// 8 MiB, with the bytes just copied and the total to copy.
pub fn copy_to_anonymous(
    parts: &[Bytes],
    huge_pages: bool,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> std::io::Result<AnonCopies> {
    let mut offsets = Vec::with_capacity(parts.len());
    let mut total = 0usize;
    for p in parts {
        offsets.push(total);
        total = total
            .checked_add(p.len().div_ceil(ANON_ALIGN) * ANON_ALIGN)
            .ok_or_else(|| std::io::Error::other("weights too large to copy"))?;
    }
    if total == 0 {
        return Ok(AnonCopies {
            views: parts.iter().map(|_| Bytes::from_vec(Vec::new())).collect(),
            mapped: 0,
            huge_advised: false,
        });
    }
    let mut map = memmap2::MmapMut::map_anon(total)?;
    #[cfg(target_os = "linux")]
    let huge_advised = huge_pages && map.advise(memmap2::Advice::HugePage).is_ok();
    #[cfg(not(target_os = "linux"))]
    let huge_advised = {
        let _ = huge_pages;
        false
    };
    copy_parts(&mut map, parts, &offsets, progress);
    let arena = Bytes::from_owner(Arc::new(AnonArena(map)));
    let views = parts
        .iter()
        .zip(&offsets)
        .map(|(p, &at)| {
            arena
                .slice(at..at + p.len())
                .ok_or_else(|| std::io::Error::other("copy outside its mapping"))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok(AnonCopies {
        views,
        mapped: total,
        huge_advised,
    })
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
    fn anonymous_copies_keep_bytes_order_and_alignment() {
        let parts = [
            Bytes::from_vec((0..100u8).collect()),
            Bytes::from_vec(Vec::new()),
            Bytes::from_vec((0..4097u32).map(|i| (i * 7 % 251) as u8).collect()),
            Bytes::from_vec(vec![9u8; 3]).slice(1..3).unwrap(),
        ];
        for huge in [false, true] {
            let c = copy_to_anonymous(&parts, huge, &|_, _| {}).unwrap();
            assert_eq!(c.views.len(), parts.len());
            for (v, p) in c.views.iter().zip(&parts) {
                assert_eq!(v.as_slice(), p.as_slice());
                assert!((v.as_slice().as_ptr() as usize).is_multiple_of(ANON_ALIGN));
            }
            // 100 → 128, 0, 4097 → 4160, 2 → 64.
            assert_eq!(c.mapped, 128 + 4160 + 64);
            if !huge {
                assert!(!c.huge_advised);
            }
        }
        let none = copy_to_anonymous(&[], true, &|_, _| {}).unwrap();
        assert!(none.views.is_empty());
        assert_eq!(none.mapped, 0);
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
