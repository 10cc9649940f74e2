//! An expert read cut into aligned pieces, each its own job for any I/O thread.

use crate::buffer::ExpertBuffer;
use crate::error::ExpertError;
use crate::layout::{ALIGN, ReadPlan, Region};
use std::sync::Arc;

/// One piece of one expert's read.
pub(super) struct Job {
    pub(super) layer: usize,
    pub(super) expert: usize,
    pub(super) piece: usize,
}

/// An aligned buffer that several piece reads fill at once, each its own disjoint range.
pub(super) struct Filling {
    pub(super) buf: ExpertBuffer,
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: the buffer is only written through `piece`, whose callers write disjoint ranges,
// and it is read only after every writer is done (`into_inner` needs the last `Arc`).
unsafe impl Send for Filling {}
unsafe impl Sync for Filling {}

impl Filling {
    pub(super) fn new(mut buf: ExpertBuffer) -> Filling {
        let bytes = buf.as_mut_bytes();
        let (ptr, len) = (bytes.as_mut_ptr(), bytes.len());
        Filling { buf, ptr, len }
    }

    /// The writable range `[at, at + len)`.
    ///
    /// # Safety
    /// No other live slice returned by this method may overlap the range.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn piece(&self, at: usize, len: usize) -> &mut [u8] {
        assert!(at + len <= self.len, "piece outside its buffer");
        // SAFETY: in bounds (checked), disjoint from other writers (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len) }
    }

    pub(super) fn into_inner(self) -> ExpertBuffer {
        self.buf
    }
}

/// Where a read goes: the model root's files, or an expert home's copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReadFrom {
    Root,
    Home(usize),
}

impl ReadFrom {
    /// The reader queue (drive) of this source: 0 for the model root, 1 + h for home h.
    pub(super) fn drive(self) -> usize {
        match self {
            ReadFrom::Root => 0,
            ReadFrom::Home(h) => 1 + h,
        }
    }
}

/// An expert whose pieces are being read.
pub(super) struct Pending {
    pub(super) fill: Arc<Filling>,
    pub(super) plan: ReadPlan,
    /// The table's file index (root reads) or the layer (home reads).
    pub(super) file: usize,
    /// Where the pieces are read from.
    pub(super) from: ReadFrom,
    /// Homes already tried for this read (a failed copy moves the read to the next holder,
    /// then to the model root).
    pub(super) tried: u32,
    pub(super) pieces: Vec<Region>,
    pub(super) started: usize,
    pub(super) done: usize,
    /// Pieces that will land: all of them, or the ones already started when a wrong PILOT
    /// guess was cancelled.
    pub(super) expected: usize,
    /// A wrong PILOT guess: its buffer goes back to the free list when `expected` have landed.
    pub(super) cancelled: bool,
    pub(super) reads: u64,
    pub(super) direct: u64,
    pub(super) device: u64,
    pub(super) err: Option<ExpertError>,
    pub(super) pilot: bool,
    /// A PILOT guess judged wrong at its layer's start: its transferred bytes are wasted.
    pub(super) wrong: bool,
}

/// `plan`'s regions cut into aligned pieces of at most `piece` bytes (whole regions for
/// `piece == 0`), equal-sized within a region.
pub(super) fn split_regions(plan: &ReadPlan, piece: u64) -> Vec<Region> {
    let mut out = Vec::new();
    for r in &plan.regions {
        let n = if piece == 0 {
            1
        } else {
            r.len.div_ceil(piece).max(1)
        };
        let size = (r.len / ALIGN).div_ceil(n) * ALIGN;
        let mut off = 0;
        while off < r.len {
            let len = size.min(r.len - off);
            out.push(Region {
                file_offset: r.file_offset + off,
                len,
                buf_offset: r.buf_offset + off,
                need_to: r.need_to.saturating_sub(off).min(len),
            });
            off += len;
        }
    }
    out
}
