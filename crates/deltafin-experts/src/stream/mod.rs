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

mod cache;
mod gate;
mod hints;
mod homes;
mod options;
mod pieces;
mod read;

pub use crate::io::DirectIo;
pub use gate::{PILOT_BREAK_EVEN_PRECISION, PILOT_RANK_HALF_LIFE, PilotGate};
pub use options::{
    DEFAULT_READ_DEPTH, MAX_OPEN_FILES, MAX_READ_DEPTH, OPEN_FILE_CACHE, READ_PIECE_BYTES,
    StreamOptions,
};

use crate::error::ExpertError;
use crate::homes::ExpertHomes;
use crate::io::{IoPath, SourceFile};
use crate::layout::{ALIGN, ExpertTable};
use crate::policy::{Heat, default_half_life};
use crate::source::{ExpertSource, ExpertWeights, PilotGuess};
use crate::stats::{ExpertStats, HomeReadStats, LayerStats};
use cache::{Shared, State};
use homes::HomeReaders;
use read::worker;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

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
        StreamingExperts::with_homes(table, opts, None)
    }

    /// [`StreamingExperts::new`] with expert homes (docs/K3.md §12.11): an expert a home
    /// holds is read from the holding home with the fewest bytes outstanding, each home by
    /// its own `read_threads` I/O threads (a reader queue per drive); a copy whose read fails
    /// is not used again and the read moves to the next copy, then to the model root. The
    /// model root's threads read the experts no home holds.
    pub fn with_homes(
        table: ExpertTable,
        opts: StreamOptions,
        homes: Option<ExpertHomes>,
    ) -> Result<StreamingExperts, ExpertError> {
        table.validate()?;
        if !(1..=MAX_READ_DEPTH).contains(&opts.read_threads) {
            return Err(ExpertError::Setup(format!(
                "read threads (reads in flight per drive) must be 1…{MAX_READ_DEPTH}, got {}",
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
        let homes = homes
            .map(|h| HomeReaders::open(h, &table, opts.direct_io))
            .transpose()?;
        let slot_cap = homes.as_ref().map_or(0, |h| h.homes.model().slot_bytes());
        let buf_cap = table.max_buffer_bytes().max(slot_cap);
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
            home_stats: vec![
                homes::HomeCounters::default();
                homes.as_ref().map_or(0, |h| h.homes.homes().len())
            ],
            ..State::default()
        };
        let drives = 1 + homes.as_ref().map_or(0, |h| h.homes.homes().len());
        let shared = Arc::new(Shared {
            table,
            homes,
            files,
            recent: Mutex::new(std::collections::VecDeque::new()),
            opened: std::sync::atomic::AtomicU64::new(0),
            last_path: Mutex::new(None),
            buf_cap,
            window,
            half_life: default_half_life(capacity),
            opts,
            st: Mutex::new(st),
            loaded: Condvar::new(),
            work: Condvar::new(),
        });
        let threads = shared.opts.read_threads;
        let workers = (0..drives * threads)
            .map(|i| {
                let s = shared.clone();
                let drive = i / threads;
                let name = match drive {
                    0 => format!("deltafin-expert-io-{i}"),
                    d => format!("deltafin-home{}-io-{}", d - 1, i % threads),
                };
                std::thread::Builder::new()
                    .name(name)
                    .spawn(move || worker(&s, drive))
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

    /// Per-expert files opened since setup (tables of more than [`MAX_OPEN_FILES`] files,
    /// which keep the last [`OPEN_FILE_CACHE`] open).
    pub fn files_opened(&self) -> u64 {
        self.shared
            .opened
            .load(std::sync::atomic::Ordering::Relaxed)
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

impl ExpertSource for StreamingExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        self.shared.expert(layer, expert)
    }

    fn begin_layer(&self, layer: usize, experts: &[usize]) {
        self.shared.begin_layer(layer, experts)
    }

    fn wants_prediction(&self) -> bool {
        true
    }

    fn next_ready(&self, layer: usize, pending: &[usize]) -> usize {
        self.shared.next_ready(layer, pending)
    }

    fn predict(&self, layer: usize, rows: usize, guesses: &[PilotGuess]) {
        self.shared.predict(layer, rows, guesses)
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
            homes: s
                .homes
                .iter()
                .flat_map(|h| h.homes.homes())
                .zip(&st.home_stats)
                .map(|(home, c)| HomeReadStats {
                    dir: home.dir.display().to_string(),
                    copies: home.journal().copies.len(),
                    reads: c.reads,
                    bytes: c.bytes,
                    failures: c.failures,
                })
                .collect(),
            home_fallbacks: st.home_fallbacks,
        })
    }
}

#[cfg(test)]
mod tests;
