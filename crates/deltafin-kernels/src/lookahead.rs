//! Pulling the next product's weights into a waiting worker's cache.
//!
//! Decode is a fixed sequence of matrix products separated by short serial stretches (norms,
//! the KDA convolution and gates, AttnRes, routing, attention over the cache), during which the
//! generation thread computes and every other worker of the pool waits in
//! `pool::run_warm`'s keep-warm loop — and DRAM idles. The next product then starts
//! cold: both cores stream its weights from DRAM.
//!
//! This module learns the product sequence and lets the waiting worker use the gap:
//!
//! - Every decode-sized product (fewer than [`MAX_ROWS`] activation rows, weights other than
//!   MXFP4 — the routed experts change with every token) reports its weight byte ranges with
//!   [`note`], keyed by the address of its first weight byte. The first time through, the
//!   reports are recorded in order; when a key comes round again the cycle (one token) is
//!   complete and becomes the learned sequence. Afterwards a report only moves the cursor.
//! - A keep-warm loop with nothing to run (`pool`) calls [`Prefetcher::step`]: it
//!   looks up the products after the cursor and issues `prefetcht0` for the second half of
//!   each one's weights, at most [`BUDGET`] bytes over [`LOOKAHEAD_STEPS`] products (a
//!   fraction of the 2 MiB L2 of current x86 server cores), [`CHUNK`] bytes per round so it
//!   still picks up work within a fraction of a microsecond.
//!
//! A decode product hands out its rows front to back (`matvec`'s guided
//! scheduling), so the waiting worker's lines are read back by whichever core reaches the
//! second half: from its own L2, or from the other core's through the shared L3, instead of
//! DRAM. Measured on `mini` (int8 spine, two cores, A B B A × 4 against
//! `DELTAFIN_POOL_PREFETCH=off`): 1.012× decode; prefetching the first half instead, 0.978×
//! (docs/PERFORMANCE.md, "Kernel and scheduling details that each measured a gain"). Hints only: a prefetch never faults and never
//! changes a value, and a wrong or stale sequence (another model loaded, a streamed spine
//! whose buffers move) costs a few wasted reads. A sequence that keeps missing is dropped
//! and relearned; a recording that never closes is capped at [`MAX_STEPS`].
//!
//! The kernel setting `pool_prefetch` (default on; binaries read it from
//! `DELTAFIN_POOL_PREFETCH`) switches it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::weights::Weights;

/// Products with at least this many activation rows are compute-bound (prefill): not noted.
pub const MAX_ROWS: usize = 4;
/// Bytes of one upcoming product a waiting worker prefetches at most.
pub const BUDGET: usize = 3 << 19;
/// Upcoming products a plan may span.
const LOOKAHEAD_STEPS: usize = 4;
/// Bytes prefetched per keep-warm round (64 cache lines).
const CHUNK: usize = 4096;
/// Steps a recording may reach before it is dropped as not a cycle.
pub const MAX_STEPS: usize = 1 << 14;
/// Consecutive unknown keys after which a learned sequence is dropped and relearned.
const MAX_MISSES: u32 = 64;
/// Bits of [`NOW`] that hold the step index (+1); the rest count reports.
const STEP_BITS: u32 = 24;

/// One product (or product group) of the sequence: its weight byte ranges in task order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Step {
    ranges: Vec<(usize, usize)>,
    total: usize,
}

impl Step {
    fn new(ranges: &[(*const u8, usize)]) -> Step {
        Step {
            ranges: ranges.iter().map(|&(p, l)| (p as usize, l)).collect(),
            total: ranges.iter().map(|r| r.1).sum(),
        }
    }
}

/// Products in call order and the index of each key.
#[derive(Debug, Default)]
struct Sequence {
    steps: Vec<Step>,
    index: HashMap<usize, usize>,
}

impl Sequence {
    fn push(&mut self, key: usize, step: Step) {
        self.index.insert(key, self.steps.len());
        self.steps.push(step);
    }
}

/// The learned sequence, shared by the reporters and the waiting workers.
static LEARNED: RwLock<Option<Arc<Sequence>>> = RwLock::new(None);
/// The recording in progress (while nothing is learned).
static RECORDING: Mutex<Option<Sequence>> = Mutex::new(None);
/// Report count (high bits) and index + 1 of the last reported step (low [`STEP_BITS`]).
static NOW: AtomicU64 = AtomicU64::new(0);
/// Consecutive reports of keys the learned sequence does not know.
static MISSES: AtomicU32 = AtomicU32::new(0);

fn publish(index: usize) {
    let step = (index as u64 + 1) & ((1 << STEP_BITS) - 1);
    let count = (NOW.load(Ordering::Relaxed) >> STEP_BITS).wrapping_add(1);
    NOW.store((count << STEP_BITS) | step, Ordering::Release);
}

/// Report that a product over `ranges` (weight bytes in task order; the first range's address
/// is the key) starts now. Cheap when the sequence is learned: one read lock and a hash lookup.
pub(crate) fn note(ranges: &[(*const u8, usize)]) {
    let Some(&(first, _)) = ranges.first() else {
        return;
    };
    if !crate::settings::current().pool_prefetch {
        return;
    }
    let key = first as usize;
    {
        let learned = LEARNED.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(seq) = learned.as_ref() {
            match seq.index.get(&key) {
                Some(&i) => {
                    MISSES.store(0, Ordering::Relaxed);
                    publish(i);
                    return;
                }
                None => {
                    if MISSES.fetch_add(1, Ordering::Relaxed) + 1 < MAX_MISSES {
                        return;
                    }
                }
            }
        }
    }
    // Nothing learned, or the learned sequence keeps missing: (re)record.
    let mut learned = LEARNED.write().unwrap_or_else(PoisonError::into_inner);
    let mut rec = RECORDING.lock().unwrap_or_else(PoisonError::into_inner);
    if learned.is_some() {
        *learned = None;
        *rec = None;
        MISSES.store(0, Ordering::Relaxed);
    }
    let seq = rec.get_or_insert_with(Sequence::default);
    if let Some(&i) = seq.index.get(&key) {
        // The cycle closed: the recording is the sequence from here on.
        *learned = rec.take().map(Arc::new);
        publish(i);
        return;
    }
    if seq.steps.len() >= MAX_STEPS {
        *seq = Sequence::default();
    }
    seq.push(key, Step::new(ranges));
    publish(seq.steps.len() - 1);
}

/// [`note`] for a product group about to run, given each member's weights and activation
/// rows: the weight bytes of its members other than MXFP4 (the routed experts differ from
/// token to token); nothing when a member has [`MAX_ROWS`] rows or more.
pub(crate) fn note_products<'a>(members: impl Iterator<Item = (Weights<'a>, usize)>) {
    if !crate::settings::current().pool_prefetch {
        return;
    }
    // On the stack: this runs before every decode product. A group with more ranges than
    // fit is noted by its first ones (hints only).
    let mut ranges = [(std::ptr::null::<u8>(), 0usize); 16];
    let mut k = 0;
    for (w, n) in members {
        if n >= MAX_ROWS {
            return;
        }
        let parts: [(*const u8, usize); 2] = match w {
            Weights::F32 { data, .. } => [
                (data.as_ptr().cast(), 4 * data.len()),
                (std::ptr::null(), 0),
            ],
            Weights::Bf16(m) => [
                (m.data().as_ptr().cast(), 2 * m.data().len()),
                (std::ptr::null(), 0),
            ],
            Weights::RowInt8(m) => [
                (m.data().as_ptr().cast(), m.data().len()),
                (m.scales().as_ptr().cast(), 2 * m.scales().len()),
            ],
            Weights::Mxfp4(_) => continue,
        };
        for part in parts.into_iter().filter(|p| p.1 > 0) {
            if k < ranges.len() {
                ranges[k] = part;
                k += 1;
            }
        }
    }
    note(&ranges[..k]);
}

/// A waiting worker's prefetch progress: the upcoming product's byte segments still to hint.
#[derive(Debug, Default)]
pub(crate) struct Prefetcher {
    seen: u64,
    segments: Vec<(usize, usize)>,
}

impl Prefetcher {
    /// Hint the next few lines of the upcoming product into this core's L2; `false` when
    /// there is nothing (left) to hint.
    pub(crate) fn step(&mut self) -> bool {
        let now = NOW.load(Ordering::Acquire);
        if now != self.seen {
            self.seen = now;
            self.plan(now);
        }
        let Some(&mut (ref mut at, ref mut len)) = self.segments.last_mut() else {
            return false;
        };
        let n = (*len).min(CHUNK);
        hint_lines(*at, n);
        *at += n;
        *len -= n;
        if *len == 0 {
            self.segments.pop();
        }
        true
    }

    /// The second half of the step after the reported one, up to [`BUDGET`] bytes, as
    /// segments in reverse order (the next one last).
    fn plan(&mut self, now: u64) {
        self.segments.clear();
        let current = (now & ((1 << STEP_BITS) - 1)) as usize;
        if current == 0 {
            return;
        }
        let learned = LEARNED.read().unwrap_or_else(PoisonError::into_inner);
        let Some(seq) = learned.as_ref() else {
            return;
        };
        let mut budget = BUDGET;
        for ahead in 0..LOOKAHEAD_STEPS {
            let Some(step) = seq.steps.get((current + ahead) % seq.steps.len()) else {
                return;
            };
            let mut skip = step.total / 2;
            for &(p, l) in &step.ranges {
                if budget == 0 {
                    break;
                }
                if skip >= l {
                    skip -= l;
                    continue;
                }
                let take = (l - skip).min(budget);
                self.segments.push((p + skip, take));
                budget -= take;
                skip = 0;
            }
        }
        self.segments.reverse();
    }
}

/// `prefetcht0` every cache line of `[at, at + len)`. A prefetch never faults, so a stale
/// address is harmless.
#[inline]
fn hint_lines(at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let mut p = at & !63;
        while p < at + len {
            // SAFETY: PREFETCHT0 is SSE (baseline x86-64) and does not access memory
            // architecturally.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
            p += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (at, len);
    }
}
