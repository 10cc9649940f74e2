//! [`StreamingExperts`]: routed experts read from disk on demand under a byte budget.
//!
//! ```text
//! begin_layer(L, U)   U = the pass's route union at L, ascending
//!     hits   += |U ∩ cache|          (resident or in flight, pinned until consumed)
//!     misses += |U \ cache|          read in U's order, ≤ W ahead of the consumer
//! expert(L, e)        wait for e's bytes; unpin; issue the next window read
//! predict(L+1, n, P)  PILOT guess of an n-row pass, most confident first: reads P \ cache
//!                     at low priority in that order (gate permitting; `ranked`: only ranks
//!                     whose measured precision reaches the threshold)
//! ```
//!
//! Each (layer, expert) of a pass is read at most once while the cache holds the window
//! (`W = min(capacity − 1, 2 × threads)` entries), so a prefill with a cold cache reads exactly
//! `|unique (layer, expert)| × expert bytes`. Reads are served by a bounded pool of threads:
//! demand and window reads first (FIFO), PILOT reads after them; PILOT pieces not yet started
//! when their layer begins are promoted (right guesses) or dropped (wrong ones; a wrong guess
//! with pieces in flight gives its buffer back when they land).
//!
//! Reads are split into aligned pieces of at most [`READ_PIECE_BYTES`]
//! ([`StreamingExperts::set_read_piece_bytes`]): every piece is its own job in the queues, so
//! all I/O threads stay busy however few experts miss (a layer missing 6 experts with 4
//! threads would otherwise read its last 2 with 2 threads idle). An expert is ready when its
//! last piece lands; [`ExpertSource::next_ready`] lets the model multiply experts in the order
//! they become ready.
//!
//! Memory: every buffer the cache owns (resident, in flight, free for reuse) counts against
//! `cache_bytes`; an expert evicted while the model still multiplies it stays alive until that
//! product ends, so the peak is `cache_bytes` + one expert buffer.
//!
//! Pinned tier ([`StreamingExperts::set_pin_tier`], `K3_EXPERT_PIN_GB`): up to
//! `pin_bytes / buffer` candidate experts (the persisted heat histogram's hottest) become
//! *sticky* when an authoritative `expert()` call has read them (never on a PILOT guess);
//! sticky experts are never evicted and their buffers count inside `cache_bytes`.

use crate::buffer::ExpertBuffer;
use crate::io::{IoPath, SourceFile};
use crate::layout::{ALIGN, ExpertShape, ExpertTable, ReadPlan, Region};
use crate::policy::{Heat, default_half_life};
use crate::stats::{ExpertStats, LayerStats, RankStats};
use crate::{ExpertError, ExpertSource, ExpertWeights, PilotGuess};
use deltafin_tensor::storage::ByteOwner;
use deltafin_tensor::{Bytes, Mxfp4Matrix};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use crate::io::DirectIo;

/// Tables with more files than this (one file per expert) open each file per read instead of
/// holding two descriptors per file.
pub const MAX_OPEN_FILES: usize = 256;

/// Default upper bound of one sub-read of an expert (a multiple of [`ALIGN`]).
pub const READ_PIECE_BYTES: u64 = 512 << 10;

/// The PILOT next-layer prefetch switch (`K3_PILOT_GATE`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PilotGate {
    /// Ungoverned: prefetch every layer's prediction (the product default).
    Off,
    /// Predict and report recall, but read nothing speculatively (the A/B baseline).
    Measure,
    /// Prefetch a layer's prediction only while its measured recall is at least `threshold`
    /// (after `warmup` predictions of that layer).
    On { threshold: f64, warmup: u64 },
    /// Prefetch a guess only while the measured precision of its rank (decayed, per pass
    /// kind: one row or several) is at least `precision`, once `warmup` guesses of that rank
    /// have been judged; at most `max_guesses` reads per prediction (0: no cap). Guesses are
    /// read most confident first in every mode.
    Ranked {
        precision: f64,
        warmup: u64,
        max_guesses: usize,
    },
}

impl PilotGate {
    /// `off`, `measure` or `on`.
    pub fn name(&self) -> &'static str {
        match self {
            PilotGate::Off => "off",
            PilotGate::Measure => "measure",
            PilotGate::On { .. } => "on",
            PilotGate::Ranked { .. } => "ranked",
        }
    }
}

/// Break-even precision of one PILOT guess (the `ranked` gate's default threshold).
///
/// When a layer's reads are on the critical path, a right guess read in advance takes one
/// expert read `τ` off the next layer's wait, and a wrong one adds `τ` of disk time that
/// the next demand reads queue behind. Guessing with precision `p` pays `p·τ − (1 − p)·τ`,
/// positive for `p > 1/2`. Cancellation only lowers a wrong guess's cost (its unstarted
/// pieces are dropped), so 1/2 is the conservative break-even.
pub const PILOT_BREAK_EVEN_PRECISION: f64 = 0.5;

/// Half-life, in judged guesses of one rank, of the precision the `ranked` gate uses.
pub const PILOT_RANK_HALF_LIFE: f64 = 128.0;

/// Ranks at or beyond this share one counter.
const MAX_PILOT_RANKS: usize = 256;

/// One rank's counters: raw for the report, decayed for the gate.
#[derive(Clone, Default)]
struct RankCounter {
    stats: RankStats,
    hits: f64,
    total: f64,
}

impl RankCounter {
    fn precision(&self) -> Option<f64> {
        (self.total > 0.0).then(|| self.hits / self.total)
    }

    /// Whether `gate` suppresses guesses of this rank now.
    fn gated(&self, gate: PilotGate) -> bool {
        match gate {
            PilotGate::Ranked {
                precision, warmup, ..
            } => self.stats.guesses >= warmup && self.precision().unwrap_or(1.0) < precision,
            _ => false,
        }
    }

    fn judge(&mut self, right: bool, prefetched: bool, gate: PilotGate) {
        let d = 0.5f64.powf(1.0 / PILOT_RANK_HALF_LIFE);
        self.hits = self.hits * d + f64::from(u8::from(right));
        self.total = self.total * d + 1.0;
        let st = &mut self.stats;
        st.guesses += 1;
        st.right += u64::from(right);
        st.prefetched += u64::from(prefetched);
        st.prefetched_right += u64::from(prefetched && right);
        self.stats.precision_now = self.precision();
        self.stats.gated = self.gated(gate);
    }
}

/// A layer's pending guess: the pass kind (0: one row, 1: several), the guesses in order,
/// and which of them were read.
struct Prediction {
    class: usize,
    guesses: Vec<PilotGuess>,
    issued: Vec<bool>,
    /// Reads an earlier guess for the same layer issued that this one does not name (see
    /// `State::discard_superseded`): judged with it, outside the per-rank counts.
    carried: Vec<usize>,
}

/// How a [`StreamingExperts`] reads and caches.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamOptions {
    /// Bytes of expert buffers the cache may own.
    pub cache_bytes: u64,
    /// I/O worker threads (1–16).
    pub read_threads: usize,
    /// O_DIRECT policy.
    pub direct_io: DirectIo,
    /// Next-layer prefetch.
    pub pilot: PilotGate,
}

impl StreamOptions {
    /// `cache_bytes` with 4 threads (or fewer CPUs), O_DIRECT when possible, ungoverned PILOT.
    pub fn with_cache_bytes(cache_bytes: u64) -> StreamOptions {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        StreamOptions {
            cache_bytes,
            read_threads: cpus.clamp(1, 4),
            direct_io: DirectIo::Auto,
            pilot: PilotGate::Off,
        }
    }
}

enum Slot {
    Loading,
    Ready(ExpertWeights, Arc<ExpertBuffer>),
    Failed(ExpertError),
}

struct Entry {
    slot: Slot,
    pinned: bool,
    /// Read for a use that has not happened yet (the admission test runs at that use).
    fresh: bool,
    /// Failed the admission test: passes through, evicted before anything else.
    transient: bool,
    /// Brought in by PILOT and not yet part of a route union.
    pilot_unused: bool,
    /// In the pinned tier: never evicted.
    sticky: bool,
    /// Bytes a PILOT read transferred for this entry (counted as wasted if the guess was
    /// wrong or the entry is evicted unused).
    pilot_bytes: u64,
}

enum Look {
    Ready(Box<ExpertWeights>, bool, bool),
    Loading,
    Failed,
    Absent,
}

/// One piece of one expert's read.
struct Job {
    layer: usize,
    expert: usize,
    piece: usize,
}

/// An aligned buffer that several piece reads fill at once, each its own disjoint range.
struct Filling {
    buf: ExpertBuffer,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is only written through `piece`, whose callers write disjoint ranges,
// and it is read only after every writer is done (`into_inner` needs the last `Arc`).
unsafe impl Send for Filling {}
unsafe impl Sync for Filling {}

impl Filling {
    fn new(mut buf: ExpertBuffer) -> Filling {
        let bytes = buf.as_mut_bytes();
        let (ptr, len) = (bytes.as_mut_ptr(), bytes.len());
        Filling { buf, ptr, len }
    }

    /// The writable range `[at, at + len)`.
    ///
    /// # Safety
    /// No other live slice returned by this method may overlap the range.
    #[allow(clippy::mut_from_ref)]
    unsafe fn piece(&self, at: usize, len: usize) -> &mut [u8] {
        assert!(at + len <= self.len, "piece outside its buffer");
        // SAFETY: in bounds (checked), disjoint from other writers (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len) }
    }

    fn into_inner(self) -> ExpertBuffer {
        self.buf
    }
}

/// An expert whose pieces are being read.
struct Pending {
    fill: Arc<Filling>,
    plan: ReadPlan,
    file: usize,
    pieces: Vec<Region>,
    started: usize,
    done: usize,
    /// Pieces that will land: all of them, or the ones already started when a wrong PILOT
    /// guess was cancelled.
    expected: usize,
    /// A wrong PILOT guess: its buffer goes back to the free list when `expected` have landed.
    cancelled: bool,
    reads: u64,
    direct: u64,
    device: u64,
    err: Option<ExpertError>,
    pilot: bool,
    /// A PILOT guess judged wrong at its layer's start: its transferred bytes are wasted.
    wrong: bool,
}

/// `plan`'s regions cut into aligned pieces of at most `piece` bytes (whole regions for
/// `piece == 0`), equal-sized within a region.
fn split_regions(plan: &ReadPlan, piece: u64) -> Vec<Region> {
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

struct Window {
    layer: usize,
    order: Vec<usize>,
    next: usize,
}

#[derive(Default)]
struct State {
    entries: HashMap<(usize, usize), Entry>,
    /// Experts being read, by key.
    pending: HashMap<(usize, usize), Pending>,
    /// Upper bound of one piece read (0: whole regions).
    piece: u64,
    /// Decayed route heat of every expert ever requested (cached or not).
    heat: HashMap<(usize, usize), Heat>,
    demand: VecDeque<Job>,
    pilot: VecDeque<Job>,
    free: Vec<ExpertBuffer>,
    allocated: u64,
    peak: u64,
    pinned: usize,
    tick: u64,
    window: Option<Window>,
    predictions: Vec<Option<Prediction>>,
    /// PILOT precision per rank: one-row passes, then passes of several rows.
    ranks: [Vec<RankCounter>; 2],
    layers: Vec<LayerStats>,
    reads: u64,
    direct_reads: u64,
    device_bytes: u64,
    /// Reads whose last piece has landed and left `pending`, but whose `finish` has not yet
    /// taken the lock to publish them (their bytes are not yet in the counters).
    finishing: usize,
    in_flight: usize,
    busy_since: Option<Instant>,
    busy: Duration,
    wait: Duration,
    shutdown: bool,
    /// Pinned-tier candidates (from the persisted heat) and the tier's size in buffers.
    pin_candidates: std::collections::HashSet<(usize, usize)>,
    pin_slots: usize,
    /// Sticky entries now.
    sticky: usize,
}

impl State {
    /// A wrong PILOT guess whose read has unstarted pieces (already taken off the queues):
    /// with pieces in flight it gives its buffer back when they land; otherwise it leaves the
    /// cache now.
    fn cut_unstarted(&mut self, key: (usize, usize)) {
        let Some(p) = self.pending.get_mut(&key) else {
            return;
        };
        if p.started > p.done {
            p.expected = p.started;
            p.cancelled = true;
        } else if let Some(p) = self.pending.remove(&key) {
            self.entries.remove(&key);
            if let Some(l) = self.layers.get_mut(key.0) {
                l.prefetch_wasted_bytes += p.device;
            }
            if let Ok(f) = Arc::try_unwrap(p.fill) {
                self.free.push(f.into_inner());
            }
        }
    }

    /// Judge the PILOT read of `key` wrong: a read still in flight counts its bytes as wasted
    /// when it lands; a finished, still unused one returns its bytes (wasted now).
    fn judge_wrong(&mut self, key: (usize, usize)) -> u64 {
        if let Some(p) = self.pending.get_mut(&key) {
            p.wrong |= p.pilot;
        } else if let Some(e) = self.entries.get_mut(&key)
            && e.pilot_unused
        {
            e.pilot_unused = false;
            return e.pilot_bytes;
        }
        0
    }

    /// A newer guess for `layer` replaced one that issued reads of `experts` it does not
    /// repeat: their unstarted pieces leave the queue now, so they do not hold up the newer
    /// guess's reads (what those reads transferred is wasted: their buffers go back). Returns
    /// the ones whose reads finished or have every piece in flight: they stay cached and are
    /// judged with the newer guess when the layer begins.
    fn discard_superseded(&mut self, layer: usize, experts: &[usize]) -> Vec<usize> {
        let mut cut = std::collections::BTreeSet::new();
        self.pilot.retain(|job| {
            let gone = job.layer == layer && experts.contains(&job.expert);
            if gone {
                cut.insert((job.layer, job.expert));
            }
            !gone
        });
        let n_cut = cut.len() as u64;
        for key in cut {
            self.cut_unstarted(key);
        }
        if let Some(l) = self.layers.get_mut(layer) {
            l.prefetch_issued += n_cut;
        }
        experts
            .iter()
            .copied()
            .filter(|&e| {
                self.entries.contains_key(&(layer, e))
                    && self.pending.get(&(layer, e)).is_none_or(|p| !p.cancelled)
            })
            .collect()
    }
}

struct Shared {
    table: ExpertTable,
    /// Files opened once (tables of at most [`MAX_OPEN_FILES`] files); empty otherwise, and
    /// each read opens its file (one `open` per multi-megabyte read).
    files: Vec<SourceFile>,
    /// How the last per-read-opened file was served (when `files` is empty).
    last_path: Mutex<Option<(IoPath, Option<String>)>>,
    opts: StreamOptions,
    buf_cap: u64,
    window: usize,
    half_life: f64,
    st: Mutex<State>,
    loaded: Condvar,
    work: Condvar,
}

/// Routed experts streamed from files with explicit reads; see the module docs.
pub struct StreamingExperts {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for StreamingExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingExperts")
            .field("experts", &self.shared.table.expert_count())
            .field("cache_bytes", &self.shared.opts.cache_bytes)
            .finish()
    }
}

impl StreamingExperts {
    /// Validate `table`, open its files and start the I/O threads.
    pub fn new(table: ExpertTable, opts: StreamOptions) -> Result<StreamingExperts, ExpertError> {
        table.validate()?;
        if !(1..=16).contains(&opts.read_threads) {
            return Err(ExpertError::Setup(format!(
                "read threads must be 1…16, got {}",
                opts.read_threads
            )));
        }
        if let PilotGate::On { threshold, warmup } = opts.pilot
            && (!(0.0..1.0).contains(&threshold) || warmup == 0)
        {
            return Err(ExpertError::Setup(format!(
                "PILOT gate threshold must be in [0, 1) and warmup ≥ 1, got {threshold} / {warmup}"
            )));
        }
        if let PilotGate::Ranked {
            precision, warmup, ..
        } = opts.pilot
            && (!(0.0..=1.0).contains(&precision) || warmup == 0)
        {
            return Err(ExpertError::Setup(format!(
                "ranked PILOT precision must be in [0, 1] and warmup ≥ 1, got {precision} / {warmup}"
            )));
        }
        let buf_cap = table.max_buffer_bytes();
        if buf_cap == 0 {
            return Err(ExpertError::Setup("the table holds no experts".into()));
        }
        if opts.cache_bytes < buf_cap {
            return Err(ExpertError::Setup(format!(
                "an expert cache of {} bytes cannot hold one expert buffer ({buf_cap} bytes)",
                opts.cache_bytes
            )));
        }
        let open_all = table.files.len() <= MAX_OPEN_FILES;
        let files = table
            .files
            .iter()
            .filter(|_| open_all)
            .map(|p| {
                SourceFile::open(p, opts.direct_io)
                    .map_err(|e| ExpertError::Setup(format!("cannot open {}: {e}", p.display())))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let capacity = (opts.cache_bytes / buf_cap) as usize;
        let window = (capacity - 1).min(2 * opts.read_threads);
        let n_layers = table.layers.len();
        let st = State {
            piece: READ_PIECE_BYTES,
            predictions: (0..n_layers).map(|_| None).collect(),
            layers: vec![LayerStats::default(); n_layers],
            ..State::default()
        };
        let shared = Arc::new(Shared {
            table,
            files,
            last_path: Mutex::new(None),
            buf_cap,
            window,
            half_life: default_half_life(capacity),
            opts,
            st: Mutex::new(st),
            loaded: Condvar::new(),
            work: Condvar::new(),
        });
        let workers = (0..shared.opts.read_threads)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("deltafin-expert-io-{i}"))
                    .spawn(move || worker(&s))
                    .map_err(|e| ExpertError::Setup(format!("cannot start an I/O thread: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(StreamingExperts { shared, workers })
    }

    /// Bytes of one expert's payload.
    pub fn expert_bytes(&self) -> u64 {
        self.shared.table.shape.expert_bytes()
    }

    /// Bytes of one cache buffer (payload plus alignment).
    pub fn buffer_bytes(&self) -> u64 {
        self.shared.buf_cap
    }

    /// Experts the cache can hold at once.
    pub fn capacity(&self) -> usize {
        (self.shared.opts.cache_bytes / self.shared.buf_cap) as usize
    }

    /// The options in force.
    pub fn options(&self) -> &StreamOptions {
        &self.shared.opts
    }

    /// Give `pin_bytes` of the cache budget to a pinned tier filled from `candidates`
    /// (hottest first; entries outside the table are skipped). Candidates become sticky when
    /// an authoritative read uses them, up to `pin_bytes / buffer_bytes()` experts. Returns the
    /// tier's size in experts. The tier must leave at least one buffer for everything else.
    pub fn set_pin_tier(
        &self,
        candidates: &[(usize, usize)],
        pin_bytes: u64,
    ) -> Result<usize, ExpertError> {
        let s = &*self.shared;
        let slots = (pin_bytes / s.buf_cap) as usize;
        if pin_bytes > 0 && slots + 1 > self.capacity() {
            return Err(ExpertError::Setup(format!(
                "a pinned tier of {pin_bytes} bytes ({slots} experts of {} bytes) leaves no buffer of the {}-byte expert cache for unpinned experts",
                s.buf_cap, s.opts.cache_bytes
            )));
        }
        let mut st = s.lock();
        st.pin_slots = slots;
        st.pin_candidates = candidates
            .iter()
            .copied()
            .filter(|&(l, e)| s.table.get(l, e).is_ok())
            .take(slots)
            .collect();
        Ok(slots)
    }

    /// Seed the in-process heat from a persisted histogram: `rates` holds each expert's
    /// learned share of passes `r` (heat / mass), `requests_per_pass` the expert requests of
    /// one pass (MoE layers × k for decode). Each expert starts at the heat the in-process
    /// counter settles at for that rate, `r / requests_per_pass × H / ln 2`, so admission and
    /// eviction favour the historically hot experts from the first token; it then decays and
    /// is replaced by what this process sees.
    pub fn seed_heat(&self, rates: &[((usize, usize), f64)], requests_per_pass: f64) {
        let s = &*self.shared;
        if requests_per_pass <= 0.0 {
            return;
        }
        let scale = s.half_life / std::f64::consts::LN_2 / requests_per_pass;
        let mut st = s.lock();
        let now = st.tick;
        for &(key, r) in rates {
            if r > 0.0 && r.is_finite() && s.table.get(key.0, key.1).is_ok() {
                st.heat.insert(key, Heat::with_value(r * scale, now));
            }
        }
    }

    /// Split every later read into aligned pieces of at most `bytes` (a multiple of 4096),
    /// each served by any I/O thread; 0 reads each contiguous region in one piece.
    pub fn set_read_piece_bytes(&self, bytes: u64) -> Result<(), ExpertError> {
        if !bytes.is_multiple_of(ALIGN) {
            return Err(ExpertError::Setup(format!(
                "the read piece size must be a multiple of {ALIGN} bytes, got {bytes}"
            )));
        }
        self.shared.lock().piece = bytes;
        Ok(())
    }

    /// Buffer bytes the cache owns now.
    pub fn cache_bytes_now(&self) -> u64 {
        self.shared.lock().allocated
    }

    /// `direct`, or `buffered (why)`, over all files.
    pub fn io_path(&self) -> String {
        let mut buffered: Option<String> = None;
        let mut direct = 0;
        let lazy = self.shared.last_path.lock().ok().and_then(|g| g.clone());
        for path in self
            .shared
            .files
            .iter()
            .map(SourceFile::io_path)
            .chain(lazy)
        {
            match path {
                (IoPath::Direct, _) => direct += 1,
                (IoPath::Buffered, why) => {
                    buffered.get_or_insert(why.unwrap_or_else(|| "buffered".into()));
                }
            }
        }
        match (buffered, direct) {
            (None, _) => "direct".into(),
            (Some(w), 0) => format!("buffered ({w})"),
            (Some(w), d) => format!("mixed ({d} files direct; others: {w})"),
        }
    }

    #[cfg(test)]
    pub(crate) fn files(&self) -> &[SourceFile] {
        &self.shared.files
    }

    /// Block until no read is queued, in flight or still being published (tests: makes PILOT
    /// accounting exact).
    #[cfg(test)]
    pub(crate) fn settle(&self) {
        let s = &*self.shared;
        let mut st = s.lock();
        while !st.pending.is_empty() || st.finishing > 0 {
            st = s.wait(st);
        }
    }
}

impl Drop for StreamingExperts {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A worker panicking mid-update leaves counters at worst stale; keep serving.
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.loaded.wait(g).unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer for a new read: reuse a free one, allocate within budget, or evict the
    /// coldest unpinned resident expert. `None` when none is possible right now.
    fn take_buffer(&self, st: &mut State, allow_pinned: bool) -> Option<ExpertBuffer> {
        if let Some(b) = st.free.pop() {
            return Some(b);
        }
        let cap = self.buf_cap;
        if st.allocated + cap <= self.opts.cache_bytes {
            st.allocated += cap;
            st.peak = st.peak.max(st.allocated);
            return Some(ExpertBuffer::new(cap));
        }
        let (now, hl) = (st.tick, self.half_life);
        let heat = &st.heat;
        let score = |k: &(usize, usize), e: &Entry| {
            (
                e.pinned,
                !e.transient,
                heat.get(k).map_or(0.0, |h| h.at(now, hl)),
            )
        };
        let victim = st
            .entries
            .iter()
            .filter(|(_, e)| {
                matches!(e.slot, Slot::Ready(..)) && !e.sticky && (allow_pinned || !e.pinned)
            })
            .map(|(k, e)| (score(k, e), *k))
            .min_by(|a, b| {
                a.0.partial_cmp(&b.0)
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then(a.1.cmp(&b.1))
            })
            .map(|(_, k)| k)?;
        let e = st.entries.remove(&victim)?;
        if e.pinned {
            st.pinned -= 1;
        }
        if e.pilot_unused
            && let Some(l) = st.layers.get_mut(victim.0)
        {
            // A guess evicted before its layer used it.
            l.prefetch_wasted_bytes += e.pilot_bytes;
        }
        match e.slot {
            Slot::Ready(w, buf) => {
                drop(w);
                match Arc::try_unwrap(buf) {
                    Ok(b) => Some(b),
                    // Still being multiplied: its bytes are freed when that ends.
                    Err(_) => Some(ExpertBuffer::new(cap)),
                }
            }
            _ => None,
        }
    }

    /// The read-ahead window with `pin_slots` buffers given to the pinned tier.
    fn window_now(&self, pin_slots: usize) -> usize {
        let capacity = (self.opts.cache_bytes / self.buf_cap) as usize;
        self.window.min(capacity.saturating_sub(pin_slots + 1))
    }

    /// Issue window reads until `window` unconsumed entries are pinned.
    fn pump_window(&self, st: &mut State) {
        let mut issued = false;
        while let Some(w) = st.window.as_mut() {
            if w.next >= w.order.len() || st.pinned >= self.window_now(st.pin_slots) {
                break;
            }
            let (layer, e) = (w.layer, w.order[w.next]);
            if st.entries.contains_key(&(layer, e)) {
                w.next += 1;
                continue;
            }
            let Some(buf) = self.take_buffer(st, false) else {
                break;
            };
            if let Some(w) = st.window.as_mut() {
                w.next += 1;
            }
            self.insert_loading(st, layer, e, buf, true, false);
            issued = true;
        }
        if issued {
            self.work.notify_all();
        }
    }

    fn insert_loading(
        &self,
        st: &mut State,
        layer: usize,
        expert: usize,
        buf: ExpertBuffer,
        pinned: bool,
        pilot: bool,
    ) {
        if pinned {
            st.pinned += 1;
        }
        let located = self.table.get(layer, expert).map(|loc| {
            let plan = ReadPlan::new(loc);
            let pieces = split_regions(&plan, st.piece);
            (loc.file, plan, pieces)
        });
        let slot = match located {
            Ok((file, plan, pieces)) => {
                let queue = if pilot { &mut st.pilot } else { &mut st.demand };
                queue.extend((0..pieces.len()).map(|piece| Job {
                    layer,
                    expert,
                    piece,
                }));
                st.pending.insert(
                    (layer, expert),
                    Pending {
                        fill: Arc::new(Filling::new(buf)),
                        plan,
                        file,
                        expected: pieces.len(),
                        cancelled: false,
                        pieces,
                        started: 0,
                        done: 0,
                        reads: 0,
                        direct: 0,
                        device: 0,
                        err: None,
                        pilot,
                        wrong: false,
                    },
                );
                Slot::Loading
            }
            Err(e) => {
                st.free.push(buf);
                Slot::Failed(e)
            }
        };
        st.entries.insert(
            (layer, expert),
            Entry {
                slot,
                pinned,
                fresh: true,
                transient: false,
                pilot_unused: pilot,
                sticky: false,
                pilot_bytes: 0,
            },
        );
    }

    /// Read one piece into its range of the expert's buffer. Returns the path taken and the
    /// bytes transferred.
    fn read_piece(
        &self,
        layer: usize,
        expert: usize,
        file: usize,
        region: &Region,
        fill: &Filling,
    ) -> Result<(IoPath, u64), ExpertError> {
        let opened;
        let source = match self.files.get(file) {
            Some(f) => f,
            None => {
                let path = self
                    .table
                    .files
                    .get(file)
                    .ok_or_else(|| ExpertError::Unavailable {
                        layer,
                        expert,
                        message: format!("internal: file {file} is not in the table"),
                    })?;
                opened = SourceFile::open(path, self.opts.direct_io).map_err(|source| {
                    ExpertError::Io {
                        layer,
                        expert,
                        path: path.clone(),
                        offset: 0,
                        len: 0,
                        source,
                    }
                })?;
                &opened
            }
        };
        // SAFETY: the pieces of one expert cover disjoint buffer ranges and each piece is
        // read by exactly one job.
        let dst = unsafe { fill.piece(region.buf_offset as usize, region.len as usize) };
        let piece = Region {
            buf_offset: 0,
            ..*region
        };
        let out = source
            .read_region(&piece, dst)
            .map_err(|e| ExpertError::Io {
                layer,
                expert,
                path: source.path().to_path_buf(),
                offset: region.file_offset,
                len: region.need_to,
                source: e,
            })?;
        if self.files.is_empty()
            && let Ok(mut g) = self.last_path.lock()
        {
            *g = Some(source.io_path());
        }
        Ok(out)
    }
}

/// The three matrices over the tensors of `plan` inside `buf`.
fn weights(
    buf: &Arc<ExpertBuffer>,
    plan: &ReadPlan,
    shape: ExpertShape,
    layer: usize,
    expert: usize,
) -> Result<ExpertWeights, ExpertError> {
    let owner: Arc<dyn ByteOwner> = buf.clone();
    let all = Bytes::from_owner(owner);
    let sizes = shape.tensor_bytes();
    let part = |k: usize| {
        let at = plan.tensor_at[k] as usize;
        all.slice(at..at + sizes[k] as usize)
            .ok_or_else(|| ExpertError::Unavailable {
                layer,
                expert,
                message: format!("internal: tensor {k} lies outside its read buffer"),
            })
    };
    let names = ["w1", "w2", "w3"];
    let mut mats = Vec::with_capacity(3);
    for (m, (rows, cols)) in shape.matrix_shapes().into_iter().enumerate() {
        let name = format!(
            "model.layers.{layer}.block_sparse_moe.experts.{expert}.{}",
            names[m]
        );
        mats.push(
            Mxfp4Matrix::new(&name, part(2 * m)?, part(2 * m + 1)?, rows, cols).map_err(
                |source| ExpertError::Tensor {
                    layer,
                    expert,
                    source,
                },
            )?,
        );
    }
    let mut it = mats.into_iter();
    match (it.next(), it.next(), it.next()) {
        (Some(w1), Some(w2), Some(w3)) => Ok(ExpertWeights { w1, w2, w3 }),
        _ => Err(ExpertError::Unavailable {
            layer,
            expert,
            message: "internal: expected three matrices".into(),
        }),
    }
}

fn worker(s: &Shared) {
    loop {
        let (job, file, region, fill) = {
            let mut st = s.lock();
            loop {
                if st.shutdown {
                    return;
                }
                let Some(j) = st.demand.pop_front().or_else(|| st.pilot.pop_front()) else {
                    st = s.work.wait(st).unwrap_or_else(|p| p.into_inner());
                    continue;
                };
                // Pieces of a cancelled read are skipped.
                let Some(p) = st.pending.get_mut(&(j.layer, j.expert)) else {
                    continue;
                };
                let Some(region) = p.pieces.get(j.piece).copied() else {
                    continue;
                };
                p.started += 1;
                let (file, fill) = (p.file, p.fill.clone());
                st.in_flight += 1;
                if st.in_flight == 1 {
                    st.busy_since = Some(Instant::now());
                }
                break (j, file, region, fill);
            }
        };
        let key = (job.layer, job.expert);
        let outcome = s.read_piece(job.layer, job.expert, file, &region, &fill);
        // The last piece to land must find the buffer's only `Arc` in `pending`.
        drop(fill);
        let finished = {
            let mut st = s.lock();
            st.in_flight -= 1;
            if st.in_flight == 0
                && let Some(t) = st.busy_since.take()
            {
                st.busy += t.elapsed();
            }
            let Some(p) = st.pending.get_mut(&key) else {
                continue;
            };
            p.done += 1;
            match outcome {
                Ok((path, n)) => {
                    p.reads += 1;
                    p.device += n;
                    if path == IoPath::Direct {
                        p.direct += 1;
                    }
                }
                Err(e) => {
                    p.err.get_or_insert(e);
                }
            }
            if p.done < p.expected {
                continue;
            }
            let done = st.pending.remove(&key);
            st.finishing += usize::from(done.is_some());
            done
        };
        if let Some(p) = finished {
            finish(s, key, p);
        }
    }
}

/// Every expected piece of `p` has landed: build the weights and publish the slot (or, for a
/// cancelled guess, give the buffer back).
fn finish(s: &Shared, (layer, expert): (usize, usize), p: Pending) {
    if p.cancelled {
        let mut st = s.lock();
        st.finishing = st.finishing.saturating_sub(1);
        st.reads += p.reads;
        st.direct_reads += p.direct;
        st.device_bytes += p.device;
        if let Some(l) = st.layers.get_mut(layer) {
            l.prefetch_wasted_bytes += p.device;
        }
        if let Some(e) = st.entries.remove(&(layer, expert))
            && e.pinned
        {
            st.pinned -= 1;
        }
        if let Ok(f) = Arc::try_unwrap(p.fill) {
            st.free.push(f.into_inner());
        }
        drop(st);
        s.loaded.notify_all();
        return;
    }
    let buf = Arc::try_unwrap(p.fill).map(Filling::into_inner);
    let result = match (p.err, buf) {
        (Some(e), Ok(b)) => Err((e, Some(b))),
        (Some(e), Err(_)) => Err((e, None)),
        (None, Err(_)) => Err((
            ExpertError::Unavailable {
                layer,
                expert,
                message: "internal: a piece read still holds the buffer".into(),
            },
            None,
        )),
        (None, Ok(b)) => {
            let buf = Arc::new(b);
            match weights(&buf, &p.plan, s.table.shape, layer, expert) {
                Ok(w) => Ok((w, buf)),
                Err(e) => Err((e, Arc::try_unwrap(buf).ok())),
            }
        }
    };
    let mut st = s.lock();
    st.finishing = st.finishing.saturating_sub(1);
    st.reads += p.reads;
    st.direct_reads += p.direct;
    st.device_bytes += p.device;
    let slot = match result {
        Ok((w, buf)) => {
            let eb = s.table.shape.expert_bytes();
            if let Some(l) = st.layers.get_mut(layer) {
                l.bytes_read += eb;
                if p.pilot {
                    l.prefetch_bytes += eb;
                }
                if p.wrong {
                    l.prefetch_wasted_bytes += p.device;
                }
            }
            Slot::Ready(w, buf)
        }
        Err((e, buf)) => {
            st.free.extend(buf);
            Slot::Failed(e)
        }
    };
    match st.entries.get_mut(&(layer, expert)) {
        Some(entry) => {
            entry.slot = slot;
            if p.wrong {
                entry.pilot_unused = false;
            } else if p.pilot {
                entry.pilot_bytes = p.device;
            }
        }
        None => {
            // Cancelled while in flight: keep the buffer for reuse.
            if let Slot::Ready(w, b) = slot {
                drop(w);
                if let Ok(b) = Arc::try_unwrap(b) {
                    st.free.push(b);
                }
            }
        }
    }
    drop(st);
    s.loaded.notify_all();
}

impl ExpertSource for StreamingExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        let s = &*self.shared;
        s.table.get(layer, expert)?;
        let key = (layer, expert);
        let started = Instant::now();
        let mut st = s.lock();
        st.tick += 1;
        let tick = st.tick;
        let in_window = st
            .window
            .as_ref()
            .is_some_and(|w| w.layer == layer && w.order.binary_search(&expert).is_ok());
        let mut counted = in_window;
        let result = loop {
            let (now, hl) = (tick, s.half_life);
            let look = match st.entries.get_mut(&key) {
                Some(e) => match &e.slot {
                    Slot::Ready(w, _) => {
                        let w = Box::new(w.clone());
                        e.pilot_unused = false;
                        let fresh = std::mem::replace(&mut e.fresh, false);
                        Look::Ready(w, std::mem::replace(&mut e.pinned, false), fresh)
                    }
                    Slot::Loading => Look::Loading,
                    Slot::Failed(_) => Look::Failed,
                },
                None => Look::Absent,
            };
            if let Look::Ready(_, _, fresh) = &look {
                let before = st.heat.get(&key).map_or(0.0, |h| h.at(now, hl));
                st.heat
                    .entry(key)
                    .and_modify(|h| h.touch(now, hl))
                    .or_insert_with(|| Heat::new(now));
                // Admission: a freshly read expert stays only if it was hotter than the
                // coldest settled resident (checked when the cache is full).
                if *fresh && st.free.is_empty() && st.allocated + s.buf_cap > s.opts.cache_bytes {
                    let heat = &st.heat;
                    let coldest = st
                        .entries
                        .iter()
                        .filter(|(k, e)| {
                            **k != key
                                && !e.transient
                                && !e.sticky
                                && !e.fresh
                                && matches!(e.slot, Slot::Ready(..))
                        })
                        .map(|(k, _)| heat.get(k).map_or(0.0, |h| h.at(now, hl)))
                        .min_by(f64::total_cmp);
                    if let (Some(c), Some(e)) = (coldest, st.entries.get_mut(&key)) {
                        e.transient = before <= c;
                    }
                }
            }
            match look {
                Look::Ready(w, was_pinned, _) => {
                    if was_pinned {
                        st.pinned -= 1;
                    }
                    // Sticky, never speculative: promoted only here, when the route that
                    // needs this expert has read it.
                    if st.sticky < st.pin_slots && st.pin_candidates.contains(&key) {
                        let promoted = st.entries.get_mut(&key).is_some_and(|e| {
                            let was = std::mem::replace(&mut e.sticky, true);
                            e.transient = false;
                            !was
                        });
                        if promoted {
                            st.sticky += 1;
                        }
                    }
                    break Ok(*w);
                }
                Look::Loading => st = s.wait(st),
                Look::Failed => {
                    if let Some(Entry {
                        slot: Slot::Failed(err),
                        pinned,
                        ..
                    }) = st.entries.remove(&key)
                    {
                        if pinned {
                            st.pinned -= 1;
                        }
                        break Err(err);
                    }
                }
                Look::Absent => {
                    if !counted {
                        counted = true;
                        if let Some(l) = st.layers.get_mut(layer) {
                            l.misses += 1;
                        }
                    }
                    let idle = st.in_flight == 0 && st.demand.is_empty() && st.pilot.is_empty();
                    // Everything pinned and nothing in flight: give up a pinned expert (it
                    // is read again later) rather than wait forever.
                    let buf = s.take_buffer(&mut st, false).or_else(|| {
                        if idle {
                            s.take_buffer(&mut st, true)
                        } else {
                            None
                        }
                    });
                    match buf {
                        Some(b) => {
                            s.insert_loading(&mut st, layer, expert, b, true, false);
                            s.work.notify_all();
                        }
                        None if idle => {
                            break Err(ExpertError::Unavailable {
                                layer,
                                expert,
                                message: "the expert cache has no buffer to read into".into(),
                            });
                        }
                        None => st = s.wait(st),
                    }
                }
            }
        };
        s.pump_window(&mut st);
        st.wait += started.elapsed();
        result
    }

    fn begin_layer(&self, layer: usize, experts: &[usize]) {
        let s = &*self.shared;
        let mut st = s.lock();
        let st = &mut *st;
        // Recall of this layer's PILOT prediction, and precision per rank.
        let pred = st.predictions.get_mut(layer).and_then(Option::take);
        if let Some(pred) = &pred
            && let Some(l) = st.layers.get_mut(layer)
        {
            l.predictions += 1;
            l.predicted_total += experts.len() as u64;
            l.predicted_hits += pred
                .guesses
                .iter()
                .filter(|g| experts.binary_search(&g.expert).is_ok())
                .count() as u64;
            if let PilotGate::On { threshold, warmup } = s.opts.pilot {
                l.gated = l.predictions >= warmup && l.recall().unwrap_or(0.0) < threshold;
            }
        }
        if let Some(pred) = &pred {
            let table = &mut st.ranks[pred.class];
            for (g, &issued) in pred.guesses.iter().zip(&pred.issued) {
                let rank = g.rank.min(MAX_PILOT_RANKS - 1);
                if table.len() <= rank {
                    table.resize(rank + 1, RankCounter::default());
                }
                let right = experts.binary_search(&g.expert).is_ok();
                table[rank].judge(right, issued, s.opts.pilot);
            }
        }
        // Release the previous window's pins.
        for e in st.entries.values_mut() {
            e.pinned = false;
        }
        st.pinned = 0;
        // PILOT reads not started yet: promote right guesses, drop wrong ones (and stale
        // guesses of earlier layers).
        // A wrong guess loses its unstarted pieces; one with pieces in flight gives its
        // buffer back when they land.
        let mut keep = VecDeque::new();
        let mut dropped = std::collections::BTreeSet::new();
        for job in std::mem::take(&mut st.pilot) {
            let key = (job.layer, job.expert);
            let wanted = job.layer == layer && experts.binary_search(&job.expert).is_ok();
            if wanted {
                st.demand.push_back(job);
            } else if job.layer <= layer && st.pending.contains_key(&key) {
                dropped.insert(key);
            } else {
                keep.push_back(job);
            }
        }
        st.pilot = keep;
        for key in dropped {
            st.cut_unstarted(key);
        }
        // Judge the issued guesses still held: right ones are useful prefetches; wrong ones
        // waste what they transferred (now, or when their in-flight pieces land).
        if let Some(pred) = &pred {
            let (mut issued, mut right, mut wasted) = (0, 0, 0);
            let judged = pred
                .guesses
                .iter()
                .zip(&pred.issued)
                .filter(|(_, i)| **i)
                .map(|(g, _)| g.expert)
                .chain(pred.carried.iter().copied());
            for e in judged {
                issued += 1;
                let key = (layer, e);
                if experts.binary_search(&e).is_ok() {
                    right += u64::from(st.entries.contains_key(&key));
                } else {
                    wasted += st.judge_wrong(key);
                }
            }
            if let Some(l) = st.layers.get_mut(layer) {
                l.prefetch_issued += issued;
                l.prefetch_right += right;
                l.prefetch_wasted_bytes += wasted;
            }
        }
        let (mut hits, mut pf_hits, mut pin_hits) = (0, 0, 0);
        for &e in experts {
            if let Some(entry) = st.entries.get_mut(&(layer, e)) {
                hits += 1;
                if entry.sticky {
                    pin_hits += 1;
                }
                if entry.pilot_unused {
                    pf_hits += 1;
                    entry.pilot_unused = false;
                }
                entry.pinned = true;
                st.pinned += 1;
            }
        }
        if let Some(l) = st.layers.get_mut(layer) {
            l.hits += hits;
            l.prefetch_hits += pf_hits;
            l.pinned_hits += pin_hits;
            l.misses += experts.len() as u64 - hits;
        }
        st.window = Some(Window {
            layer,
            order: experts.to_vec(),
            next: 0,
        });
        s.pump_window(st);
    }

    fn wants_prediction(&self) -> bool {
        true
    }

    fn next_ready(&self, layer: usize, pending: &[usize]) -> usize {
        let s = &*self.shared;
        let started = Instant::now();
        let mut st = s.lock();
        let pick = loop {
            let mut loading = false;
            let mut ready = None;
            for (i, &e) in pending.iter().enumerate() {
                match st.entries.get(&(layer, e)).map(|en| &en.slot) {
                    Some(Slot::Ready(..) | Slot::Failed(_)) => {
                        ready = Some(i);
                        break;
                    }
                    Some(Slot::Loading) => loading = true,
                    None => {}
                }
            }
            match ready {
                Some(i) => break i,
                // Nothing in flight: the first one is read on request.
                None if !loading => break 0,
                None => st = s.wait(st),
            }
        };
        st.wait += started.elapsed();
        pick
    }

    fn predict(&self, layer: usize, rows: usize, guesses: &[PilotGuess]) {
        let s = &*self.shared;
        if !matches!(s.table.layers.get(layer), Some(Some(_))) {
            return;
        }
        let mut st = s.lock();
        let st = &mut *st;
        let class = usize::from(rows > 1);
        let mut issued = vec![false; guesses.len()];
        let gated = st.layers.get(layer).is_some_and(|l| l.gated);
        let read = match s.opts.pilot {
            PilotGate::Measure => false,
            PilotGate::On { .. } => !gated,
            PilotGate::Off | PilotGate::Ranked { .. } => true,
        };
        let cap = match s.opts.pilot {
            PilotGate::Ranked { max_guesses, .. } if max_guesses > 0 => max_guesses,
            _ => usize::MAX,
        };
        // An earlier guess for this layer that has not been judged yet (the next token's
        // first MoE layer is guessed at the end of a pass from a provisional token, then
        // again from the real one): the reads it issued that this guess repeats are judged
        // with this one; the others are wrong and discarded now.
        let earlier: Vec<usize> = st.predictions[layer]
            .take()
            .map(|p| {
                p.guesses
                    .iter()
                    .zip(&p.issued)
                    .filter(|(_, i)| **i)
                    .map(|(g, _)| g.expert)
                    .chain(p.carried)
                    .collect()
            })
            .unwrap_or_default();
        for (g, issued) in guesses.iter().zip(issued.iter_mut()) {
            *issued = earlier.contains(&g.expert) && st.entries.contains_key(&(layer, g.expert));
        }
        let superseded: Vec<usize> = earlier
            .iter()
            .copied()
            .filter(|e| !guesses.iter().any(|g| g.expert == *e))
            .collect();
        let carried = st.discard_superseded(layer, &superseded);
        let mut n = 0;
        // Most confident first: what is still unstarted when the layer begins is the least
        // likely to be needed.
        for (g, issued) in guesses.iter().zip(issued.iter_mut()) {
            if !read || n >= cap {
                break;
            }
            if st.entries.contains_key(&(layer, g.expert)) {
                continue;
            }
            let rank = g.rank.min(MAX_PILOT_RANKS - 1);
            if st.ranks[class]
                .get(rank)
                .is_some_and(|c| c.gated(s.opts.pilot))
            {
                continue;
            }
            let Some(buf) = s.take_buffer(st, false) else {
                break;
            };
            s.insert_loading(st, layer, g.expert, buf, false, true);
            *issued = true;
            n += 1;
        }
        st.predictions[layer] = Some(Prediction {
            class,
            guesses: guesses.to_vec(),
            issued,
            carried,
        });
        if n > 0 {
            s.work.notify_all();
        }
    }

    fn stats(&self) -> Option<ExpertStats> {
        let s = &*self.shared;
        let io_path = self.io_path();
        let st = s.lock();
        let busy = st.busy + st.busy_since.map_or(Duration::ZERO, |t| t.elapsed());
        Some(ExpertStats {
            layers: st.layers.clone(),
            reads: st.reads,
            direct_reads: st.direct_reads,
            device_bytes: st.device_bytes,
            io_busy_seconds: busy.as_secs_f64(),
            wait_seconds: st.wait.as_secs_f64(),
            io_path,
            cache_budget_bytes: s.opts.cache_bytes,
            cache_peak_bytes: st.peak,
            pin_budget_bytes: st.pin_slots as u64 * s.buf_cap,
            pinned_experts: st.sticky,
            expert_bytes: s.table.shape.expert_bytes(),
            read_threads: s.opts.read_threads,
            pilot_ranks: st.ranks[0].iter().map(|c| c.stats.clone()).collect(),
            pilot_ranks_batch: st.ranks[1].iter().map(|c| c.stats.clone()).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ExpertLocation;
    use std::sync::atomic::Ordering;

    type Parts = HashMap<(usize, usize), Vec<Vec<u8>>>;

    const SHAPE: ExpertShape = ExpertShape { f: 64, lr: 64 };

    /// One file holding `layers` (layer 0 dense) × `experts` experts after a 1000-byte header;
    /// returns the table and each expert's six tensors.
    fn fixture(dir: &std::path::Path, layers: usize, experts: usize) -> (ExpertTable, Parts) {
        let mut data = vec![0u8; 1000];
        let mut want = HashMap::new();
        let mut table_layers = vec![None];
        let mut x = 12345u64;
        for l in 1..layers {
            let mut locs = Vec::new();
            for e in 0..experts {
                let mut ranges = [(0, 0); 6];
                let mut parts = Vec::new();
                for (k, &len) in SHAPE.tensor_bytes().iter().enumerate() {
                    let bytes: Vec<u8> = (0..len)
                        .map(|_| {
                            x = x
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(1442695040888963407);
                            let b = (x >> 33) as u8;
                            if k % 2 == 1 { 110 + b % 30 } else { b }
                        })
                        .collect();
                    ranges[k] = (data.len() as u64, len);
                    data.extend_from_slice(&bytes);
                    parts.push(bytes);
                }
                want.insert((l, e), parts);
                locs.push(ExpertLocation { file: 0, ranges });
            }
            table_layers.push(Some(locs));
        }
        let path = dir.join("experts.bin");
        std::fs::write(&path, &data).unwrap();
        (
            ExpertTable {
                files: vec![path],
                shape: SHAPE,
                layers: table_layers,
            },
            want,
        )
    }

    fn check(w: &ExpertWeights, parts: &[Vec<u8>]) {
        assert_eq!(w.w1.packed(), &parts[0][..]);
        assert_eq!(w.w1.scales(), &parts[1][..]);
        assert_eq!(w.w2.packed(), &parts[2][..]);
        assert_eq!(w.w2.scales(), &parts[3][..]);
        assert_eq!(w.w3.packed(), &parts[4][..]);
        assert_eq!(w.w3.scales(), &parts[5][..]);
    }

    /// One row's guesses, most confident first.
    fn guesses(ids: &[usize]) -> Vec<PilotGuess> {
        crate::rank_guesses([ids])
    }

    fn opts(capacity: u64, table: &ExpertTable, pilot: PilotGate) -> StreamOptions {
        StreamOptions {
            cache_bytes: capacity * table.max_buffer_bytes(),
            read_threads: 2,
            direct_io: DirectIo::Auto,
            pilot,
        }
    }

    #[test]
    fn streamed_bytes_match_the_file_and_the_budget_holds() {
        let dir = tempfile::tempdir().unwrap();
        let (table, want) = fixture(dir.path(), 3, 8);
        let o = opts(3, &table, PilotGate::Off);
        let budget = o.cache_bytes;
        let src = StreamingExperts::new(table, o).unwrap();
        for round in 0..4 {
            for l in 1..3 {
                let union: Vec<usize> = (0..8).filter(|e| (e + round + l) % 3 != 0).collect();
                src.begin_layer(l, &union);
                for &e in &union {
                    check(&src.expert(l, e).unwrap(), &want[&(l, e)]);
                    assert!(src.cache_bytes_now() <= budget);
                }
            }
        }
        let st = src.stats().unwrap();
        assert!(st.cache_peak_bytes <= budget, "{st:?}");
        assert!(st.total().misses > 0 && st.reads > 0);
        // Unhinted requests work too.
        check(&src.expert(2, 7).unwrap(), &want[&(2, 7)]);
    }

    #[test]
    fn regions_split_into_aligned_pieces_that_cover_them() {
        let plan = ReadPlan {
            regions: vec![
                Region {
                    file_offset: 8192,
                    len: 5 * ALIGN,
                    buf_offset: 0,
                    need_to: 4 * ALIGN + 100,
                },
                Region {
                    file_offset: 65536,
                    len: ALIGN,
                    buf_offset: 5 * ALIGN,
                    need_to: ALIGN,
                },
            ],
            tensor_at: [0; 6],
            buf_len: 6 * ALIGN,
        };
        let pieces = split_regions(&plan, 2 * ALIGN);
        let got: Vec<(u64, u64, u64, u64)> = pieces
            .iter()
            .map(|r| (r.file_offset, r.len, r.buf_offset, r.need_to))
            .collect();
        assert_eq!(
            got,
            vec![
                (8192, 2 * ALIGN, 0, 2 * ALIGN),
                (8192 + 2 * ALIGN, 2 * ALIGN, 2 * ALIGN, 2 * ALIGN),
                (8192 + 4 * ALIGN, ALIGN, 4 * ALIGN, 100),
                (65536, ALIGN, 5 * ALIGN, ALIGN),
            ]
        );
        assert_eq!(split_regions(&plan, 0).len(), 2);
        // Equal pieces: 5 blocks in pieces of ≤ 4 blocks are 3 + 2, not 4 + 1.
        let lens: Vec<u64> = split_regions(&plan, 4 * ALIGN)
            .iter()
            .map(|r| r.len / ALIGN)
            .collect();
        assert_eq!(lens, vec![3, 2, 1]);
    }

    #[test]
    fn piecewise_reads_give_the_same_bytes_and_count_every_piece() {
        let dir = tempfile::tempdir().unwrap();
        let (table, want) = fixture(dir.path(), 3, 8);
        let o = StreamOptions {
            read_threads: 4,
            ..opts(4, &table, PilotGate::Measure)
        };
        let src = StreamingExperts::new(table.clone(), o).unwrap();
        let e = src.set_read_piece_bytes(1000).unwrap_err().to_string();
        assert!(e.contains("multiple of 4096"), "{e}");
        src.set_read_piece_bytes(ALIGN).unwrap();
        // One piece per aligned block of every expert (each is read once: a cold pass).
        let mut pieces = 0;
        for l in 1..3 {
            let union: Vec<usize> = (0..8).collect();
            src.begin_layer(l, &union);
            for &e in &union {
                pieces += ReadPlan::new(table.get(l, e).unwrap()).buf_len / ALIGN;
                check(&src.expert(l, e).unwrap(), &want[&(l, e)]);
            }
        }
        let st = src.stats().unwrap();
        assert_eq!(st.total().bytes_read, 16 * SHAPE.expert_bytes());
        assert!(pieces > 16 * 2, "{pieces}");
        assert_eq!(st.reads, pieces, "{st:?}");
    }

    #[test]
    fn wrong_guesses_cancelled_mid_read_keep_bytes_and_budget_right() {
        let dir = tempfile::tempdir().unwrap();
        let (table, want) = fixture(dir.path(), 4, 12);
        let o = StreamOptions {
            read_threads: 3,
            ..opts(6, &table, PilotGate::Off)
        };
        let budget = o.cache_bytes;
        let src = StreamingExperts::new(table.clone(), o).unwrap();
        src.set_read_piece_bytes(ALIGN).unwrap();
        for round in 0..40usize {
            for l in 1..4 {
                let union: Vec<usize> = (0..12).filter(|e| (e + round * l) % 4 == 0).collect();
                src.begin_layer(l, &union);
                if l < 3 {
                    // Half right, half wrong guesses for the next layer.
                    let guess: Vec<usize> =
                        (0..12).filter(|e| (e + round) % 3 != 1).take(5).collect();
                    src.predict(l + 1, 1, &guesses(&guess));
                }
                let mut pending = union.clone();
                while !pending.is_empty() {
                    let e = pending.remove(src.next_ready(l, &pending));
                    check(&src.expert(l, e).unwrap(), &want[&(l, e)]);
                    assert!(src.cache_bytes_now() <= budget);
                }
            }
        }
        let st = src.stats().unwrap();
        assert!(st.cache_peak_bytes <= budget, "{st:?}");
        assert!(st.total().prefetch_bytes > 0, "{st:?}");
    }

    #[test]
    fn next_ready_names_a_resident_expert_before_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        let (table, want) = fixture(dir.path(), 2, 8);
        // Two buffers: a window of one, taken by the hit, so expert 0 is not read yet.
        let src =
            StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Measure)).unwrap();
        src.begin_layer(1, &[3]);
        src.expert(1, 3).unwrap();
        src.begin_layer(1, &[0, 3]);
        assert_eq!(src.next_ready(1, &[0, 3]), 1);
        check(&src.expert(1, 3).unwrap(), &want[&(1, 3)]);
        // Consuming the hit started expert 0's read; next_ready waits for it.
        assert_eq!(src.next_ready(1, &[0]), 0);
        check(&src.expert(1, 0).unwrap(), &want[&(1, 0)]);
        let t = src.stats().unwrap().total();
        assert_eq!((t.hits, t.misses), (1, 2));
    }

    #[test]
    fn a_cold_pass_reads_each_union_expert_exactly_once() {
        let dir = tempfile::tempdir().unwrap();
        let (table, _) = fixture(dir.path(), 4, 16);
        let eb = SHAPE.expert_bytes();
        // The cache holds 4 experts, each layer's union is 10: the window reads ahead in order.
        let src =
            StreamingExperts::new(table.clone(), opts(4, &table, PilotGate::Measure)).unwrap();
        let mut pairs = 0u64;
        for l in 1..4 {
            let union: Vec<usize> = (0..16).filter(|e| (e * 7 + l) % 16 < 10).collect();
            pairs += union.len() as u64;
            src.begin_layer(l, &union);
            for &e in &union {
                src.expert(l, e).unwrap();
            }
        }
        let t = src.stats().unwrap().total();
        assert_eq!(t.bytes_read, pairs * eb);
        assert_eq!((t.misses, t.hits), (pairs, 0));
    }

    #[test]
    fn pilot_prefetch_counts_recall_and_hits() {
        let dir = tempfile::tempdir().unwrap();
        let (table, want) = fixture(dir.path(), 3, 8);
        let src = StreamingExperts::new(table.clone(), opts(8, &table, PilotGate::Off)).unwrap();
        src.begin_layer(1, &[0, 1]);
        src.predict(2, 1, &guesses(&[2, 3, 4, 5]));
        src.expert(1, 0).unwrap();
        src.expert(1, 1).unwrap();
        src.begin_layer(2, &[3, 4, 6]);
        for e in [3, 4, 6] {
            check(&src.expert(2, e).unwrap(), &want[&(2, e)]);
        }
        let l2 = &src.stats().unwrap().layers[2];
        assert_eq!((l2.predicted_hits, l2.predicted_total), (2, 3));
        assert_eq!((l2.hits, l2.prefetch_hits, l2.misses), (2, 2, 1));

        // `measure` predicts but reads nothing speculatively.
        let src =
            StreamingExperts::new(table.clone(), opts(8, &table, PilotGate::Measure)).unwrap();
        src.predict(2, 1, &guesses(&[2, 3]));
        src.begin_layer(2, &[3]);
        src.expert(2, 3).unwrap();
        let l2 = &src.stats().unwrap().layers[2];
        assert_eq!((l2.prefetch_bytes, l2.hits, l2.predicted_hits), (0, 0, 1));
    }

    /// Bytes a fresh source transfers for a PILOT guess of expert `e` of `layer` alone.
    fn guess_read_alone(table: &ExpertTable, layer: usize, e: usize) -> u64 {
        let src = StreamingExperts::new(table.clone(), opts(2, table, PilotGate::Off)).unwrap();
        src.predict(layer, 1, &guesses(&[e]));
        src.settle();
        src.stats().unwrap().device_bytes
    }

    /// A source with one I/O thread and pieces of [`ALIGN`] bytes (reads stay in flight long
    /// enough for a test to act between them), 8 buffers, PILOT reads on.
    fn one_thread_small_pieces(table: &ExpertTable) -> StreamingExperts {
        let src = StreamingExperts::new(
            table.clone(),
            StreamOptions {
                read_threads: 1,
                ..opts(8, table, PilotGate::Off)
            },
        )
        .unwrap();
        src.set_read_piece_bytes(ALIGN).unwrap();
        src
    }

    #[test]
    fn guesses_rank_by_best_position_then_votes_then_id() {
        let g = crate::rank_guesses([&[5usize, 2, 7][..], &[2, 9, 5], &[3, 9, 1]]);
        let got: Vec<(usize, usize, usize)> =
            g.iter().map(|g| (g.expert, g.rank, g.votes)).collect();
        assert_eq!(
            got,
            vec![
                (2, 0, 2),
                (5, 0, 2),
                (3, 0, 1),
                (9, 1, 2),
                (1, 2, 1),
                (7, 2, 1)
            ]
        );
        assert_eq!(
            guesses(&[4, 1])
                .iter()
                .map(|g| (g.expert, g.rank))
                .collect::<Vec<_>>(),
            vec![(4, 0), (1, 1)]
        );
    }

    #[test]
    fn pilot_reads_the_most_confident_guesses_first_and_accounts_waste() {
        let dir = tempfile::tempdir().unwrap();
        let (table, want) = fixture(dir.path(), 3, 8);
        // Two buffers: only the two most confident guesses (5, then 2) can be read; id order
        // would have read 2 and 5, router order 7 last.
        let alone = |l: usize, e: usize| guess_read_alone(&table, l, e);
        let src = StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Off)).unwrap();
        src.predict(2, 1, &guesses(&[5, 2, 7]));
        src.settle();
        assert_eq!(src.stats().unwrap().device_bytes, alone(2, 5) + alone(2, 2));
        src.begin_layer(2, &[5, 7]);
        let st = src.stats().unwrap();
        let l2 = &st.layers[2];
        assert_eq!((l2.hits, l2.prefetch_hits, l2.misses), (1, 1, 1));
        assert_eq!((l2.prefetch_issued, l2.prefetch_right), (2, 1));
        assert_eq!(
            l2.prefetch_wasted_bytes,
            alone(2, 2),
            "the wrong guess 2 was read whole"
        );
        assert_eq!(l2.prefetch_precision(), Some(0.5));
        assert_eq!(l2.prefetch_recall(), Some(0.5));
        let ranks: Vec<(u64, u64, u64, u64)> = st
            .pilot_ranks
            .iter()
            .map(|r| (r.guesses, r.right, r.prefetched, r.prefetched_right))
            .collect();
        assert_eq!(ranks, vec![(1, 1, 1, 1), (1, 0, 1, 0), (1, 1, 0, 0)]);
        assert!(st.pilot_ranks_batch.is_empty());
        for e in [5, 7] {
            check(&src.expert(2, e).unwrap(), &want[&(2, e)]);
        }
        let line = st.summary_line();
        assert!(line.contains("prefetch_precision=50.0%"), "{line}");
        assert!(
            st.per_rank_precision().starts_with("0:100.0(100.0)"),
            "{st:?}"
        );

        // Wrong guesses cut at the layer's start (dropped unread, cancelled mid-read, or
        // landed whole, depending on timing) waste exactly the bytes they transferred.
        let src = one_thread_small_pieces(&table);
        src.predict(1, 1, &guesses(&[0, 1, 2, 3, 4, 5]));
        src.begin_layer(1, &[0]);
        src.settle();
        let st = src.stats().unwrap();
        let l1 = &st.layers[1];
        assert_eq!(l1.prefetch_issued, 6);
        // Whatever was transferred for the five wrong guesses is wasted, nothing more.
        assert_eq!(l1.prefetch_wasted_bytes, st.device_bytes - alone(1, 0));
        let all: u64 = (0..6).map(|e| alone(1, e)).sum();
        assert!(st.device_bytes <= all);
    }

    #[test]
    fn a_newer_guess_for_the_same_layer_keeps_what_it_repeats_and_discards_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let (table, want) = fixture(dir.path(), 3, 8);
        let alone = |e: usize| guess_read_alone(&table, 1, e);
        // The same guess twice (a provisional next token that turned out right): nothing is
        // read twice, and the reads count as the guess's, right and prefetched.
        let src = StreamingExperts::new(table.clone(), opts(8, &table, PilotGate::Off)).unwrap();
        src.predict(1, 1, &guesses(&[2, 5]));
        src.settle();
        src.predict(1, 1, &guesses(&[2, 5]));
        src.settle();
        let once = alone(2) + alone(5);
        assert_eq!(src.stats().unwrap().device_bytes, once);
        src.begin_layer(1, &[2, 5]);
        let l1 = src.stats().unwrap().layers[1].clone();
        assert_eq!((l1.hits, l1.prefetch_hits, l1.misses), (2, 2, 0));
        assert_eq!((l1.prefetch_issued, l1.prefetch_right), (2, 2));
        assert_eq!(l1.prefetch_wasted_bytes, 0);
        assert_eq!((l1.predictions, l1.predicted_hits), (1, 2));

        // A different second guess: the first's reads it does not repeat lose their unstarted
        // pieces at once (issued, what they transferred wasted); the repeated one is judged
        // with the second guess.
        let src = one_thread_small_pieces(&table);
        src.predict(1, 1, &guesses(&[0, 1, 2, 3]));
        src.predict(1, 1, &guesses(&[3, 6]));
        src.begin_layer(1, &[3, 6]);
        src.settle();
        let st = src.stats().unwrap();
        let l1 = &st.layers[1];
        assert_eq!(l1.prefetch_issued, 5, "{l1:?}");
        assert_eq!(l1.prefetch_right, 2, "{l1:?}");
        assert_eq!(
            l1.prefetch_wasted_bytes,
            st.device_bytes - alone(3) - alone(6)
        );
        assert_eq!((l1.predictions, l1.predicted_hits), (1, 2));
        for e in [3, 6] {
            check(&src.expert(1, e).unwrap(), &want[&(1, e)]);
        }

        // A superseded read that had landed stays cached and is judged when the layer
        // begins: here it is needed after all, so it is a right prefetch, not waste.
        let src = StreamingExperts::new(table.clone(), opts(8, &table, PilotGate::Off)).unwrap();
        src.predict(1, 1, &guesses(&[4]));
        src.settle();
        src.predict(1, 1, &guesses(&[5]));
        src.settle();
        src.begin_layer(1, &[4, 5]);
        let l1 = src.stats().unwrap().layers[1].clone();
        assert_eq!((l1.hits, l1.prefetch_hits, l1.misses), (2, 2, 0));
        assert_eq!((l1.prefetch_issued, l1.prefetch_right), (2, 2));
        assert_eq!(l1.prefetch_wasted_bytes, 0);
        for e in [4, 5] {
            check(&src.expert(1, e).unwrap(), &want[&(1, e)]);
        }
    }

    #[test]
    fn ranked_gate_turns_a_rank_off_and_back_on_by_measured_precision() {
        let dir = tempfile::tempdir().unwrap();
        let (table, _) = fixture(dir.path(), 3, 64);
        let gate = PilotGate::Ranked {
            precision: 0.5,
            warmup: 4,
            max_guesses: 0,
        };
        let src = StreamingExperts::new(table.clone(), opts(4, &table, gate)).unwrap();
        // Each round guesses two fresh experts; rank 0 is always right, rank 1 is right only
        // from round 30 on.
        let round = |r: usize| {
            let (a, b) = ((2 * r) % 64, (2 * r + 1) % 64);
            src.predict(2, 1, &guesses(&[a, b]));
            src.settle();
            let union: Vec<usize> = if r >= 30 { vec![a, b] } else { vec![a] };
            src.begin_layer(2, &union);
            for &e in &union {
                src.expert(2, e).unwrap();
            }
            src.stats().unwrap().pilot_ranks
        };
        for r in 0..30 {
            let ranks = round(r);
            // Judged before the gate: warm-up prefetches, then rank 1 is switched off.
            assert_eq!(ranks[1].gated, r >= 3, "round {r}: {ranks:?}");
            assert!(!ranks[0].gated);
        }
        let ranks = round(30);
        assert_eq!(ranks[0].prefetched, 31);
        assert_eq!(
            ranks[1].prefetched, 4,
            "rank 1 read only during its warm-up"
        );
        let mut back_on = None;
        for r in 31..90 {
            let ranks = round(r);
            if !ranks[1].gated {
                back_on = Some(r);
                break;
            }
        }
        // ≈ 30 wrong then right guesses: precision passes 1/2 after ≈ 30 right ones.
        let r = back_on.expect("rank 1 is measured while gated and comes back");
        assert!((55..65).contains(&r), "back on at round {r}");
        let before = round(r + 1)[1].prefetched;
        assert_eq!(round(r + 2)[1].prefetched, before + 1);
        // Batch passes keep their own table.
        src.predict(1, 4, &crate::rank_guesses([&[0usize, 1][..], &[1, 2]]));
        src.begin_layer(1, &[1]);
        let st = src.stats().unwrap();
        assert_eq!(st.pilot_ranks_batch.len(), 2);
        assert_eq!(st.pilot_ranks_batch[0].guesses, 2);
    }

    #[test]
    fn ranked_gate_caps_the_reads_of_one_prediction() {
        let dir = tempfile::tempdir().unwrap();
        let (table, _) = fixture(dir.path(), 3, 8);
        let gate = PilotGate::Ranked {
            precision: 0.0,
            warmup: 1,
            max_guesses: 2,
        };
        let src = StreamingExperts::new(table.clone(), opts(8, &table, gate)).unwrap();
        src.predict(2, 1, &guesses(&[6, 1, 4, 3]));
        src.settle();
        src.begin_layer(2, &[1, 3, 6]);
        let st = src.stats().unwrap();
        let prefetched: Vec<u64> = st.pilot_ranks.iter().map(|r| r.prefetched).collect();
        assert_eq!(prefetched, vec![1, 1, 0, 0]);
        assert_eq!((st.layers[2].prefetch_issued, st.layers[2].hits), (2, 2));
        let bad = StreamingExperts::new(
            table.clone(),
            opts(
                8,
                &table,
                PilotGate::Ranked {
                    precision: 1.5,
                    warmup: 1,
                    max_guesses: 0,
                },
            ),
        )
        .unwrap_err()
        .to_string();
        assert!(bad.contains("ranked PILOT precision"), "{bad}");
    }

    #[test]
    fn pinned_tier_fills_on_authoritative_reads_and_is_never_evicted() {
        let dir = tempfile::tempdir().unwrap();
        let (table, want) = fixture(dir.path(), 3, 16);
        // 6 buffers, 3 of them pinned: candidates (1,5), (2,9), (1,2); (2,0) is beyond the
        // tier's size and (7,0) outside the table.
        let src = StreamingExperts::new(table.clone(), opts(6, &table, PilotGate::Off)).unwrap();
        let eb = src.buffer_bytes();
        let e = src.set_pin_tier(&[(1, 5)], 6 * eb).unwrap_err().to_string();
        assert!(e.contains("leaves no buffer"), "{e}");
        let slots = src
            .set_pin_tier(&[(7, 0), (1, 5), (2, 9), (1, 2), (2, 0)], 3 * eb)
            .unwrap();
        assert_eq!(slots, 3);
        // A PILOT guess of a candidate does not pin it.
        src.predict(2, 1, &guesses(&[9]));
        src.begin_layer(1, &[0, 1]);
        for e in [0, 1] {
            src.expert(1, e).unwrap();
        }
        assert_eq!(src.stats().unwrap().pinned_experts, 0);
        // Authoritative reads pin the candidates.
        src.begin_layer(1, &[2, 5]);
        src.expert(1, 2).unwrap();
        src.expert(1, 5).unwrap();
        src.begin_layer(2, &[0, 9]);
        src.expert(2, 0).unwrap();
        src.expert(2, 9).unwrap();
        assert_eq!(src.stats().unwrap().pinned_experts, 3);
        // Churn through every other expert many times: the pinned ones stay resident.
        for round in 0..5 {
            for l in 1..3 {
                let union: Vec<usize> = (0..16).filter(|e| (e + round) % 2 == 0).collect();
                src.begin_layer(l, &union);
                for &e in &union {
                    check(&src.expert(l, e).unwrap(), &want[&(l, e)]);
                }
            }
        }
        let before = src.stats().unwrap();
        src.begin_layer(1, &[2, 5]);
        src.begin_layer(2, &[9]);
        let after = src.stats().unwrap();
        let t = |s: &ExpertStats| s.total();
        assert_eq!(t(&after).hits - t(&before).hits, 3);
        assert_eq!(t(&after).pinned_hits - t(&before).pinned_hits, 3);
        assert_eq!(t(&after).misses, t(&before).misses);
        assert!(after.cache_peak_bytes <= 6 * eb);
        assert_eq!(after.pin_budget_bytes, 3 * eb);
        assert!(after.summary_line().contains("pinned_hits="));
    }

    #[test]
    fn seeded_heat_keeps_historically_hot_experts_through_a_scan() {
        let dir = tempfile::tempdir().unwrap();
        let (table, _) = fixture(dir.path(), 2, 16);
        // Read expert 3 once, then scan the 12 experts 4…15 three times, two per pass, through
        // a 4-expert cache: by the third scan they are hotter than an unseeded expert 3.
        let run = |seed: bool| {
            let src =
                StreamingExperts::new(table.clone(), opts(4, &table, PilotGate::Measure)).unwrap();
            if seed {
                src.seed_heat(&[((1, 3), 0.9), ((1, 99), 1.0), ((0, 0), 1.0)], 4.0);
            }
            src.begin_layer(1, &[3]);
            src.expert(1, 3).unwrap();
            for _ in 0..3 {
                for pair in [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15].chunks(2) {
                    src.begin_layer(1, pair);
                    for &e in pair {
                        src.expert(1, e).unwrap();
                    }
                }
            }
            let before = src.stats().unwrap().total().hits;
            src.begin_layer(1, &[3]);
            src.stats().unwrap().total().hits - before
        };
        assert_eq!(run(true), 1, "the seeded expert stayed resident");
        assert_eq!(run(false), 0, "without a seed the scan evicts it");
    }

    #[test]
    fn direct_io_refusal_falls_back_to_buffered_reads() {
        let dir = tempfile::tempdir().unwrap();
        let (table, want) = fixture(dir.path(), 2, 4);
        let src =
            StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Measure)).unwrap();
        let before = src.io_path();
        eprintln!("io path on {}: {before}", dir.path().display());
        src.files()[0]
            .fail_next_direct_read
            .store(true, Ordering::Relaxed);
        check(&src.expert(1, 0).unwrap(), &want[&(1, 0)]);
        let after = src.io_path();
        assert!(after.starts_with("buffered"), "{after}");
        if before == "direct" {
            assert!(after.contains("refused at read"), "{after}");
        }
        check(&src.expert(1, 3).unwrap(), &want[&(1, 3)]);
        let st = src.stats().unwrap();
        assert_eq!(st.direct_reads, 0);

        let off = StreamOptions {
            direct_io: DirectIo::Off,
            ..opts(2, &table, PilotGate::Measure)
        };
        let src = StreamingExperts::new(table, off).unwrap();
        check(&src.expert(1, 2).unwrap(), &want[&(1, 2)]);
        assert!(src.io_path().starts_with("buffered"));
    }

    #[test]
    fn bad_storage_is_an_error_naming_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let (table, _) = fixture(dir.path(), 2, 4);
        let e = StreamingExperts::new(
            table.clone(),
            StreamOptions {
                cache_bytes: 100,
                ..opts(1, &table, PilotGate::Off)
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("cannot hold one expert"), "{e}");

        let mut short = table.clone();
        if let Some(Some(l)) = short.layers.get_mut(1) {
            l[2].ranges[3].1 -= 1;
        }
        let e = StreamingExperts::new(short, opts(2, &table, PilotGate::Off))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("expert 2 of layer 1") && e.contains("tensor 3"),
            "{e}"
        );

        // A NaN scale byte and a truncated file.
        let path = table.files[0].clone();
        let mut bytes = std::fs::read(&path).unwrap();
        let loc = table.get(1, 1).unwrap().clone();
        bytes[loc.ranges[1].0 as usize] = 255;
        std::fs::write(&path, &bytes).unwrap();
        let src = StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Off)).unwrap();
        let e = src.expert(1, 1).unwrap_err().to_string();
        assert!(e.contains("NaN") && e.contains("experts.1.w1"), "{e}");
        let last = table.get(1, 3).unwrap().ranges[5];
        bytes.truncate((last.0 + 10) as usize);
        std::fs::write(&path, &bytes).unwrap();
        let src = StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Off)).unwrap();
        let e = src.expert(1, 3).unwrap_err().to_string();
        assert!(e.contains("experts.bin") && e.contains("layer 1"), "{e}");
        assert!(
            src.expert(0, 0)
                .unwrap_err()
                .to_string()
                .contains("not a MoE layer")
        );
    }
}
