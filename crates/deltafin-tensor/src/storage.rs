//! Reference-counted byte ranges over memory-mapped files or owned buffers.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Anything that owns a contiguous byte buffer and can be shared between threads.
pub trait ByteOwner: Send + Sync {
    fn bytes(&self) -> &[u8];
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
}
